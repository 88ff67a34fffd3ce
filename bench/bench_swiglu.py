"""Issue 39 experiment: is the gated MLP's Mosaic GPU kernel (isojax.kernels.mlp.dense_swiglu:
both first products and silu(gate) * up in one kernel) faster than XLA's path at the Llama
family's shapes? (H100 only.)

    python -m bench.bench_swiglu

Rows per shape: XLA as the model runs it (two products, then SiLU and the product in one pass),
XLA's two products alone, one cuBLAS product of x with [W_gate | W_up] (the products' floor without
the elementwise pass), the kernel on weights interleaved ahead (mlp.interleave), then the kernel as
the model calls it (interleaving the weights in the step) for a few tile schedules. Each kernel output is checked
against float64 on a sample of rows (kernels.gated_rounding_error <= 0).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import timed
from isojax.kernels import mlp
from isojax.kernels.mlp import Tiles, available, dense_swiglu, gated_rounding_error

# [rows, D, F]: a step's rows of bench_families' presets
SHAPES = {"llama-1b": (32768, 2048, 5632), "mistral-1b": (32768, 2048, 7168), "qwen2-1.5b": (32768, 1536, 8960)}
TILES = [Tiles(), Tiles(stages=3), Tiles(stages=5), Tiles(grid_tile_width=16), Tiles(in_flight=0),
         Tiles(grid_minor_n=False)]


def main() -> int:
    if not available():
        print("bench_swiglu: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    for name, (m, k, f) in SHAPES.items():
        kx, kg, ku = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        wg, wu = ((jax.random.normal(key, (k, f), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16) for key in (kg, ku))
        flop = 2 * 2 * m * k * f
        model = jax.jit(lambda x, wg, wu: jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu))
        dots = jax.jit(lambda x, wg, wu: (jnp.dot(x, wg), jnp.dot(x, wu)))
        both = jnp.concatenate([wg, wu], axis=1)
        one = jax.jit(lambda x, w: jnp.dot(x, w))
        rows = [("XLA: two products, SiLU * up pass", timed(model, x, wg, wu), ""),
                ("XLA: the two products alone", timed(dots, x, wg, wu), ""),
                ("cuBLAS: x @ [W_gate | W_up]", timed(one, x, both), "")]
        idx = np.arange(0, m, m // 128)
        ahead = mlp.interleave(wg, wu, Tiles().tile_n // 2)
        kernel_alone = jax.jit(lambda x, b: mlp._call((x, b), m, k, f, Tiles(), "silu_product", False))
        try:
            rows.append(("Mosaic, weights interleaved ahead", timed(kernel_alone, x, ahead), ""))
        except Exception as e:  # noqa: BLE001
            rows.append(("Mosaic, weights interleaved ahead", float("nan"), f"failed: {str(e).splitlines()[0][:90]}"))
        for t in TILES:
            label = f"s{t.stages} w{t.grid_tile_width} {'N' if t.grid_minor_n else 'M'} f{t.in_flight}"
            try:
                fused = jax.jit(lambda x, wg, wu: dense_swiglu(x, wg, wu, t))
                ms = timed(fused, x, wg, wu)
                beyond = gated_rounding_error(np.asarray(fused(x, wg, wu)[idx], np.float64), x[idx], wg, wu)
                rows.append((f"Mosaic {label}", ms, f"beyond rounding of float64: {beyond:.2g} (<= 0: within)"))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((f"Mosaic {label}", float("nan"), f"failed: {str(e).splitlines()[0][:90]}"))
        print(f"\n{name}: [{m}, {k}] x 2 [{k}, {f}], {flop / 1e12:.2f} TFLOP")
        for label, ms, note in rows:
            print(f"  {label:<40}{ms:>9.3f} ms {flop / ms / 1e9:>6.0f} TFLOP/s  {note}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
