"""Per-pair GPU cost of the registered sample measures: K x D random points, each read-out jitted in
float64 (x64) as an accelerator runs it; the first call (compile) and the best of three.
Usage: python bench/sample_measures_cost.py K D (bench/RESULTS.md 17). No peer: no Hugging Face code computes
these; the loop they are weighed against is bench_sweep.py's, where the peer runs beside."""
import time, sys
import numpy as np, jax, jax.numpy as jnp
from isojax.stats import measures
k, d = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
x = jax.device_put(rng.normal(size=(k, d)).astype(np.float32))
y = jax.device_put((np.asarray(x) @ rng.normal(size=(d, d)).astype(np.float32) / d**0.5 + rng.normal(size=(k, d)).astype(np.float32)))
print("| measure | K | D | first call (s) | then (ms) |\n|---|---|---|---|---|")
with jax.enable_x64(True):
    for name in ("block_influence", "linearity", "neighbourhood_overlap", "gride", "cka_debiased", "procrustes_distance", "svcca"):
        m = measures.MEASURES[name]
        f = jax.jit(m.readout)
        args = (x,) if m.reads == "sample" else (x, y)
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); c = time.perf_counter() - t0
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t0)
        print(f"| {name} | {k} | {d} | {c:.2f} | {1000 * min(ts):.1f} |", flush=True)
