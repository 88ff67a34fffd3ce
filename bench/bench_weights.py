"""Time isojax.weights.isotropy on random matrices of Pythia shapes (CPU, float64).

    PYTHONPATH=. python -m bench.bench_weights [--dims 512,2048,5120] [--rows 50688]

Prints one row per matrix size with the seconds of each phase; writes the table to
$OUT/bench_weights.txt when OUT is set. Random Gaussian rows plus a common offset, stored
float16 like a Pythia checkpoint; timings do not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time

import numpy as np

from isojax.weights import isotropy

PHASES = ["gram_pass", "eigh_uncentered", "eigh_centered", "eigh_scaled_centered",
          "projection_pass"]


def bench(n: int, d: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((n, d), dtype=np.float32) * 0.02
         + rng.standard_normal(d, dtype=np.float32) * 0.01).astype(np.float16)
    timings: dict = {}
    t, c = time.perf_counter(), time.process_time()
    rep = isotropy.analyze_matrix(W, timings=timings)
    timings["total"] = time.perf_counter() - t
    timings["cpu"] = time.process_time() - c
    t = time.perf_counter()
    isotropy.layer_norm_metrics(rng.standard_normal(d) + 1, rng.standard_normal(d) * 0.1)
    timings["layer_norm"] = time.perf_counter() - t
    timings["isotropy"] = rep.metrics["isotropy"]
    return timings


def gemm_gflops(d: int = 2048, n: int = 4096) -> float:
    """float64 GEMM throughput right now: tells a busy machine from a slow algorithm."""
    a, b = np.ones((n, d)), np.ones((d, d))
    a @ b
    t = time.perf_counter()
    a @ b
    return 2 * n * d * d / (time.perf_counter() - t) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="512,2048,5120", help="comma-separated d values")
    ap.add_argument("--rows", type=int, default=50688, help="n, the vocabulary size (pythia-12b: 50688)")
    args = ap.parse_args(argv)
    cols = PHASES + ["layer_norm", "total", "cpu"]
    lines = [f"# isojax.weights.isotropy.analyze_matrix, float64, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, numpy {np.__version__}, load average at start "
             f"{os.getloadavg()[0]:.1f}, float64 GEMM {gemm_gflops():.0f} GFLOP/s "
             "(wall seconds per phase; cpu = process CPU seconds)",
             "| n x d | " + " | ".join(c + " s" for c in cols) + " | I(W) |",
             "|---" * (len(cols) + 2) + "|"]
    print("\n".join(lines), flush=True)
    for d in [int(x) for x in args.dims.split(",")]:
        t = bench(args.rows, d)
        row = f"| {args.rows} x {d} | " + " | ".join(f"{t.get(c, 0.0):.2f}" for c in cols) \
            + f" | {t['isotropy']:.4f} |"
        print(row, flush=True)
        lines.append(row)
    if os.environ.get("OUT"):
        out = pathlib.Path(os.environ["OUT"]) / "bench_weights.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
