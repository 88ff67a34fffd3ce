"""Issue 13: the fused MLP kernel with and without a cluster of two CTAs sharing each B tile by
TMA multicast (Tiles.cluster; commit of this file, reverted with it: bench/RESULTS.md 10n).
H100 only.

    python bench/bench_cluster_pingpong.py
"""
import sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench")
from bench_gemm_gelu import timed
from isojax.kernels import dense_gelu, Tiles
print(jax.devices()[0].device_kind, flush=True)
for name, (m, k, n) in {"70m": (262144, 512, 2048), "410m": (262144, 1024, 4096), "1.4b": (65536, 2048, 8192)}.items():
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    b = (0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)).astype(jnp.bfloat16)
    fl = 2 * m * k * n / 1e9
    outs = {}
    for cl in (1, 2):
        t = Tiles(cluster=cl)
        f = jax.jit(lambda a, w, b, t=t: dense_gelu(a, w, b, t))
        p = jax.jit(lambda a, w, b, t=t: dense_gelu(a, w, b, t, epilogue=False))
        outs[cl] = f(a, w, b)
        print(f"{name} cluster {cl}: product {fl / timed(p, a, w, b):.0f} TFLOP/s, fused {timed(f, a, w, b):.3f} ms", flush=True)
    print(f"{name} equal: {bool(jnp.array_equal(outs[1], outs[2]))}", flush=True)
