"""Issue 13: the MLP's products alone at Pythia's shapes: cuBLAS, isojax's ping-pong kernel, and jax's
stock Hopper kernel (hopper_matmul_mgpu) over its tiles, warpgroup split and thread-block clusters
(H100 only).

    python -m bench.bench_products

Prints ms and TFLOP/s per configuration; configurations that do not fit shared memory are listed
as failed. bench/RESULTS.md 10n.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from bench.common import timed
from isojax.kernels.mlp import available, dense_gelu

SHAPES = {"pythia-410m up": (262144, 1024, 4096), "pythia-1.4b up": (65536, 2048, 8192),
          "pythia-1.4b down": (65536, 8192, 2048)}


def main() -> int:
    if not available():
        print("bench_products: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    import jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu as hm
    dim = hm.MatmulDimension
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    for name, (m, k, n) in SHAPES.items():
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        b = jnp.zeros((n,), jnp.bfloat16)
        rows = [("cuBLAS", timed(jax.jit(jnp.dot), a, w)),
                ("isojax ping-pong", timed(jax.jit(lambda a, w, b: dense_gelu(a, w, b, epilogue=False)), a, w, b))]
        for cluster in (None, dim.M, dim.N):
            for wg in (dim.N, dim.M):
                for tm, tn, stages in ((128, 128, 4), (64, 256, 4)):
                    label = f"stock cluster={cluster} wg={wg} {tm}x{tn} stages={stages}"
                    cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=stages,
                                          grid_tile_width=8, grid_minor_dim=dim.N, wg_dimension=wg,
                                          cluster_dimension=cluster)
                    try:
                        rows.append((label, timed(jax.jit(lambda a, w, cfg=cfg: hm.matmul(a, w, None, cfg)), a, w)))
                    except Exception as e:  # noqa: BLE001 - report and go on
                        rows.append((f"{label}: failed ({str(e).splitlines()[0][:60]})", float("nan")))
        print(f"\n{name}: [{m}, {k}] x [{k}, {n}]")
        for label, ms in rows:
            print(f"  {label:<60}{ms:9.3f} ms {2 * m * k * n / ms / 1e9:7.0f} TFLOP/s")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
