"""Issue 13: the MLP's second product with the parallel residual's adds in its epilogue
(isojax.kernels.dense_residual) against cuBLAS's product followed by XLA's add pass (H100 only).

    python bench/bench_gemm_residual.py

For the 4h -> h product of each Pythia shape at the step's batch: XLA as the model runs it (dot +
bias, + attention output, + state), XLA's product alone, the kernel's product alone and the kernel
with its epilogue; the kernel's output against XLA's (bf16 ulps) and against float64.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench_gemm_gelu import timed
from isojax.kernels import available, dense_gelu, dense_residual

SHAPES = {"pythia-70m": (262144, 2048, 512), "pythia-410m": (262144, 4096, 1024), "pythia-1.4b": (65536, 8192, 2048)}


def main() -> int:
    if not available():
        print("bench_gemm_residual: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    for name, (m, k, n) in SHAPES.items():
        ku, kw, kb, ka, kx = jax.random.split(jax.random.key(0), 5)
        u = jax.random.normal(ku, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        b = (0.1 * jax.random.normal(kb, (n,), jnp.float32)).astype(jnp.bfloat16)
        attn = jax.random.normal(ka, (m, n), jnp.bfloat16)
        x = (4 * jax.random.normal(kx, (m, n), jnp.float32)).astype(jnp.bfloat16)
        flop = 2 * m * k * n
        xla = jax.jit(lambda u, w, b, a, x: jnp.dot(u, w) + b + a + x)
        ref = xla(u, w, b, attn, x)
        fused = jax.jit(dense_residual)
        out = fused(u, w, b, attn, x)
        idx = np.arange(0, m, m // 256)
        f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        exact = f64(u[idx]) @ f64(w) + f64(b) + f64(attn[idx]) + f64(x[idx])
        err = lambda o: np.mean(np.abs(f64(o[idx]) - exact))
        rows = [("XLA: dot + bias + attn + x", timed(xla, u, w, b, attn, x), f"mean |err| vs float64 {err(ref):.2e}"),
                ("XLA: dot alone", timed(jax.jit(jnp.dot), u, w), ""),
                ("Mosaic: dot alone", timed(jax.jit(lambda u, w, b: dense_gelu(u, w, b, epilogue=False)), u, w, b), ""),
                ("Mosaic: dot + bias + attn + x", timed(fused, u, w, b, attn, x),
                 f"mean |err| vs float64 {err(out):.2e}; differs from XLA on {np.mean(np.asarray(out != ref)):.2%}")]
        print(f"\n{name}: [{m}, {k}] x [{k}, {n}], {flop / 1e12:.2f} TFLOP")
        for label, ms, note in rows:
            print(f"  {label:<36}{ms:>9.3f} ms {flop / ms / 1e9:>6.0f} TFLOP/s  {note}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
