"""One state's elementwise statistics and Grams: stats' XLA path against the Pallas kernels.

    python bench/bench_fused_stats.py            # GPU: N = 65536, D = 512, 1024, 2048, 6144, bf16
    python bench/bench_fused_stats.py --quick    # tiny sizes, Pallas interpret mode (runs on CPU)

Per D, milliseconds per state (median of --repeats, after one compile run) of
  xla     kernels.xla_moments: update_state's norms, unit vectors, sums and both _centered_grams
          (default StatsOptions, so the 512-wide upper-block Gram), jitted together, without
          the per-token part
  fused   kernels.fused_moments, once per --block-n x --block-d configuration
and, for the smallest D, the error of each against float64 numpy on the host: M2 entries scaled
by sqrt(M2_ii M2_jj), sums per column by Sum |x| (the scales of tests/test_fused_stats_kernel.py).
"""

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_stats_kernel as kernels  # noqa: E402


def make_state(n, d, seed=0):
    """bf16 states with a common direction (hidden states are anisotropic) and 1% padding rows
    holding garbage."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32) + 4.0 * rng.normal(size=d).astype(np.float32)
    valid = np.ones(n, bool)
    valid[-(n // 100 or 1):] = False
    x[~valid] = np.nan
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(valid)


def time_ms(f, repeats):
    jax.block_until_ready(f())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def float64_moments(x, valid):
    x = np.asarray(x.astype(jnp.float32), np.float64)[np.asarray(valid)]
    norm = np.linalg.norm(x, axis=1)
    u = x / np.where(norm > 0, norm, 1.0)[:, None]
    out = []
    for a in (x, u):
        s = a.sum(0)
        dev = a - s / len(a)
        out += [(s, np.abs(a).sum(0)), dev.T @ dev]
    return out


def errors(got, ref):
    """(max sum error, max M2 error, max unit-sum error, max unit-M2 error)."""
    errs = []
    for g, r in zip((got[0], got[1], got[2], got[3]), ref):
        g = np.asarray(g, np.float64)
        if isinstance(r, tuple):
            errs.append(np.max(np.abs(g - r[0]) / r[1]))
        else:
            scale = np.sqrt(np.outer(np.diag(r), np.diag(r)))
            errs.append(np.max(np.abs(g - r) / scale))
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes in interpret mode (CPU)")
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dims", default="512,1024,2048,6144")
    ap.add_argument("--block-n", default="64", help="comma-separated row blocks to time")
    ap.add_argument("--block-d", default="128,64", help="comma-separated column tiles to time")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.quick:
        args.n, args.dims, args.block_n, args.block_d, args.repeats = 1000, "128,256", "32", "64", 3
    interpret = args.quick or jax.default_backend() != "gpu"
    dims = [int(d) for d in args.dims.split(",")]
    configs = list(itertools.product([int(b) for b in args.block_n.split(",")],
                                     [int(b) for b in args.block_d.split(",")]))
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} {dev.device_kind}, N = {args.n}, bf16 states, "
          f"{'interpret mode' if interpret else 'Triton'}, median of {args.repeats}")
    header = f"{'D':>6} {'variant':>16} {'ms/state':>9} {'speedup':>7}"
    header += f" {'err sum':>8} {'err M2':>8} {'err usum':>8} {'err uM2':>8}"
    print(header)
    for d in dims:
        x, valid = make_state(args.n, d)
        ref = float64_moments(x, valid) if d == min(dims) else None
        variants = [("xla", lambda: kernels.xla_moments(x, valid))]
        for bn, bd in configs:
            if d % bd == 0:
                variants.append((f"fused {bn}x{bd}", lambda bn=bn, bd=bd: kernels.fused_moments(
                    x, valid, interpret=interpret, block_n=bn, block_d=bd)))
        base = None
        for name, f in variants:
            ms = time_ms(f, args.repeats)
            base = base or ms
            line = f"{d:>6} {name:>16} {ms:>9.3f} {base / ms:>6.2f}x"
            if ref is not None:
                line += "".join(f" {e:>8.1e}" for e in errors(f(), ref))
            print(line, flush=True)


if __name__ == "__main__":
    main()
