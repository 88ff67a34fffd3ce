"""Issue 13 experiment: is a Mosaic GPU product with bias + GELU in its epilogue faster than
cuBLAS's product followed by XLA's GELU pass, at the MLP's shapes? (H100 only.)

    python -m bench.bench_gemm_gelu

Rows: XLA as the model runs it (nn.Dense in bf16, then model.gelu), XLA's product alone, the
Mosaic kernel without and with the epilogue, for a few tile shapes. Each fused output is checked
against the XLA output (bf16 ulps) and against float64.
"""

from __future__ import annotations

import itertools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import timed
from isojax.kernels.mlp import Tiles, available, dense_gelu
from isojax.numerics import gelu

SHAPES = {"pythia-70m": (262144, 512, 2048), "pythia-410m": (262144, 1024, 4096), "pythia-1.4b": (65536, 2048, 8192)}


def main() -> int:
    if not available():
        print("bench_gemm_gelu: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    for name, (m, k, n) in SHAPES.items():
        ka, kw, kb = jax.random.split(jax.random.key(0), 3)
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        bias = (0.1 * jax.random.normal(kb, (n,), jnp.float32)).astype(jnp.bfloat16)
        flop = 2 * m * k * n
        xla = jax.jit(lambda a, w, b: gelu(jnp.dot(a, w) + b, False))
        dot = jax.jit(lambda a, w: jnp.dot(a, w))
        idx = np.arange(0, m, m // 256)  # the rows checked (all of them would take seconds per config)
        ref = np.asarray(xla(a, w, bias)[idx].astype(jnp.float32))
        rows = [("XLA: dot + bias, GELU pass", timed(xla, a, w, bias), ""),
                ("XLA: dot alone", timed(dot, a, w), "")]
        # float64 truth of those rows
        u64 = np.asarray(a[idx].astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64) \
            + np.asarray(bias.astype(jnp.float32), np.float64)
        erf = np.vectorize(math.erf)
        g64 = u64 * 0.5 * (1 + erf(u64 / np.sqrt(2)))
        err = lambda out: np.max(np.abs(out - g64) / (np.abs(g64) + 1e-2))
        rows.append(("  (XLA's max error vs float64, rel.)", float("nan"), f"{err(ref):.2e}"))
        configs = [Tiles(grid_tile_width=width, grid_minor_n=minor, in_flight=fl)
                   for fl, width, minor in itertools.product((1, 0), (8, 16), (True, False))]
        configs += [Tiles(stages=s) for s in (3, 5, 6)] + [Tiles(epi_n=128)]
        for cfg in configs:
            label = (f"s{cfg.stages} w{cfg.grid_tile_width} "
                     f"{'N' if cfg.grid_minor_n else 'M'} f{cfg.in_flight} e{cfg.epi_m}x{cfg.epi_n}")
            try:
                plain = jax.jit(lambda a, w, b: dense_gelu(a, w, b, cfg, epilogue=False))
                fused = jax.jit(lambda a, w, b: dense_gelu(a, w, b, cfg, epilogue=True))
                t_plain = timed(plain, a, w, bias)
                out = np.asarray(fused(a, w, bias)[idx].astype(jnp.float32))
                t_fused = timed(fused, a, w, bias)
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((f"Mosaic {label}", float("nan"), f"failed: {str(e).splitlines()[0][:90]}"))
                continue
            ulps = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-3) / 2.0 ** -8
            rows.append((f"Mosaic {label}: dot", t_plain, f"{flop / t_plain / 1e9:.0f} TFLOP/s"))
            rows.append((f"Mosaic {label}: dot+bias+GELU", t_fused,
                         f"diff vs XLA: {np.mean(out != ref):.2%} of elements, max {np.max(ulps):.1f} ulp; "
                         f"vs float64 {err(out):.2e}"))
        print(f"\n{name}: [{m}, {k}] x [{k}, {n}], {flop / 1e12:.2f} TFLOP")
        for label, ms, note in rows:
            print(f"  {label:<44}{ms:>9.3f} ms  {note}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
