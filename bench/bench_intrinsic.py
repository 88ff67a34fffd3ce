"""Time isojax.stats.intrinsic (accelerator) against scikit-dimension (CPU) on low-dimensional data.

    PYTHONPATH=. python -m bench.bench_intrinsic                       # 100k x 2048, twonn + mle
    PYTHONPATH=. python -m bench.bench_intrinsic --n 5000 --d 256      # small, runs on CPU
    PYTHONPATH=. python -m bench.bench_intrinsic --skdim-n 20000       # skdim on 20k rows only
    PYTHONPATH=. python -m bench.bench_intrinsic --search auto,highest --no-skdim --check 1000

Data: a `--latent`-dim standard Gaussian through a random linear map to D dims plus Gaussian
noise (`--noise` per coordinate), float32. isojax times exclude compilation (shown apart:
first call minus the best of `--repeat` calls). skdim (optional; without it only isojax
columns) is timed on the first `--skdim-n` rows; by default on a 10k pilot first, then on
all N rows if that is predicted to take under `--skdim-budget` seconds, else on as many rows
as fit the budget. When skdim ran on fewer than N rows, its full-N time is extrapolated as
O(N^2) (its neighbour search is brute force above 15 dims) and a second row gives both at
that subsample. Without skdim, the 100,000 x 2048 rows take bench/RESULTS.md 9's skdim times
(one H200 host's 16 cores) as the reference, marked so. `--search`: the first pass of the
neighbour search, `auto` (TF32 on GPU, float32 elsewhere: the library's) and/or `highest`
(float32 on every device: the cost of the search before the certificate); the fallback
column gives the rows searched again at HIGHEST / exhaustively. `--check R`: the k distances
of R random rows against a float64 numpy search on the host. Writes the table to
$OUT/bench_intrinsic.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.stats import intrinsic

try:
    import skdim
except ImportError:  # isojax columns only
    skdim = None


def make_points(n: int, d: int, latent: int, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, latent), dtype=np.float32)
    w = rng.standard_normal((latent, d), dtype=np.float32) / np.sqrt(latent)
    return z @ w + noise * rng.standard_normal((n, d), dtype=np.float32)


# bench/RESULTS.md 9: scikit-dimension 0.5.0 on one H200 host's 16 cores, 100,000 x 2048
SKDIM_RESULTS = {("twonn", 100_000, 2048): (209.7, "RESULTS 9: O(N^2) from 91,020"),
                 ("mle", 100_000, 2048): (51.2, "RESULTS 9: measured")}
K_OF = {"twonn": lambda k: 2, "mle": lambda k: k, "mom": lambda k: k}


def set_search(first: str) -> None:
    """The first pass's precision: the library's choice, or HIGHEST (float32) everywhere."""
    intrinsic._cheap_precision = (CHEAP if first == "auto" else lambda x: lax.Precision.HIGHEST)


CHEAP = intrinsic._cheap_precision


def check(x_np: np.ndarray, x_dev, k: int, rows: int, seed: int) -> float:
    """Largest relative difference of the k distances of `rows` random points from float64."""
    pick = np.random.default_rng(seed).choice(x_np.shape[0], rows, replace=False)
    x = x_np.astype(np.float64)
    sq = np.sum(x * x, axis=1)
    d2 = sq[pick, None] + sq[None, :] - 2 * (x[pick] @ x.T)  # float64: only to pick candidates
    d2[np.arange(rows), pick] = np.inf
    cand = np.argpartition(d2, k + 16, axis=1)[:, :k + 16]
    exact = np.sqrt(np.sort(np.sum((x[pick, None, :] - x[cand]) ** 2, axis=2), axis=1)[:, :k])
    ours = intrinsic.knn_distances(x_dev, k)[pick]
    return float(np.max(np.abs(ours / np.where(exact > 0, exact, 1) - np.where(exact > 0, 1, 0))))


def isojax_fn(name: str, k: int):
    return {"twonn": lambda x: intrinsic.twonn(x),
            "mle": lambda x: intrinsic.mle(x, k=k),
            "mom": lambda x: intrinsic.mom(x, k=k)}[name]


def skdim_fn(name: str, k: int):
    return {"twonn": lambda x: skdim.id.TwoNN().fit(x).dimension_,
            "mle": lambda x: skdim.id.MLE().fit(x, n_neighbors=k).dimension_,
            "mom": lambda x: skdim.id.MOM().fit(x, n_neighbors=k).dimension_}[name]


def time_isojax(fn, x, repeat: int):
    t = time.perf_counter()
    value = fn(x)
    first = time.perf_counter() - t
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        value = fn(x)
        runs.append(time.perf_counter() - t)
    return min(runs), max(first - min(runs), 0.0), value


def time_skdim(fn, x):
    t = time.perf_counter()
    value = fn(x)
    return time.perf_counter() - t, float(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="points")
    ap.add_argument("--d", type=int, default=2048, help="ambient dimension")
    ap.add_argument("--latent", type=int, default=16, help="dimension of the Gaussian latent")
    ap.add_argument("--noise", type=float, default=0.01, help="noise std per coordinate")
    ap.add_argument("--estimators", default="twonn,mle", help="comma-separated: twonn, mle, mom")
    ap.add_argument("--k", type=int, default=20, help="neighbours for mle and mom")
    ap.add_argument("--skdim-n", type=int, default=None,
                    help="time skdim on the first SKDIM_N rows (default: as many as fit --skdim-budget)")
    ap.add_argument("--skdim-budget", type=float, default=180.0,
                    help="seconds one skdim estimate may take when --skdim-n is not given")
    ap.add_argument("--no-skdim", action="store_true", help="isojax columns only")
    ap.add_argument("--repeat", type=int, default=2, help="timed isojax calls after the first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--search", default="auto",
                    help="comma-separated first passes to time: auto (TF32 on GPU), highest (float32)")
    ap.add_argument("--check", type=int, default=0, metavar="R",
                    help="compare R random rows' distances with a float64 search on the host")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.estimators.split(",") if s.strip()]
    use_skdim = skdim is not None and not args.no_skdim

    x_np = make_points(args.n, args.d, args.latent, args.noise, args.seed)
    x_dev = jax.device_put(jnp.asarray(x_np))
    dev = jax.devices()[0]
    lines = [f"# isojax.stats.intrinsic vs scikit-dimension {skdim.__version__ if skdim else '(not installed)'}; "
             f"device {dev.platform}:{dev.device_kind}, jax {jax.__version__}, {os.cpu_count()} CPUs; "
             f"data: {args.latent}-dim Gaussian -> random linear map to {args.d} dims + noise "
             f"{args.noise}, float32; k = {args.k}, discard_fraction = 0.1; compile = first call "
             "minus best call (0 where an earlier row compiled the same search); fallback = rows "
             "searched again at HIGHEST / exhaustively"
             + ("" if use_skdim else "; skdim s: bench/RESULTS.md 9 (H200 host, 16 cores) where "
                "its shape matches, not measured here"),
             "| estimator | search | N x D | isojax s | compile s | fallback | skdim s | skdim timing "
             "| speedup | isojax | skdim | rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)

    def row(name, n, t_iso, t_comp, est_iso, t_sk=None, how="", est_sk=None):
        fallback: list = []
        intrinsic.knn_distances(x_dev[:n], K_OF[name](args.k), fallback=fallback)
        if t_sk is None and not use_skdim and (name, n, args.d) in SKDIM_RESULTS:
            t_sk, how = SKDIM_RESULTS[name, n, args.d]
        sk = f"{t_sk:.2f}" if t_sk is not None else "-"
        speed = f"{t_sk / t_iso:.0f}x" if t_sk is not None else "-"
        sk_est = f"{est_sk:.4f}" if est_sk is not None else "-"
        diff = f"{abs(est_iso / est_sk - 1):.1e}" if est_sk is not None else "-"
        line = (f"| {name} | {first} | {n} x {args.d} | {t_iso:.3f} | {t_comp:.1f} | "
                f"{'/'.join(map(str, fallback[0]))} | {sk} | {how or '-'} | {speed} "
                f"| {est_iso:.4f} | {sk_est} | {diff} |")
        lines.append(line)
        print(line, flush=True)

    def run_skdim(name, t_iso, t_comp, est):
        fn = skdim_fn(name, args.k)
        if args.skdim_n:
            skdim_n = min(args.skdim_n, args.n)
            t_sk, est_sk = time_skdim(fn, x_np[:skdim_n])
        else:  # a pilot, then the most rows that fit the budget by O(N^2)
            skdim_n = min(10_000, args.n)
            t_sk, est_sk = time_skdim(fn, x_np[:skdim_n])
            fit_n = min(args.n, int(skdim_n * (args.skdim_budget / t_sk) ** 0.5))
            if fit_n > 1.2 * skdim_n:
                skdim_n = fit_n
                t_sk, est_sk = time_skdim(fn, x_np[:skdim_n])
        if skdim_n == args.n:
            row(name, args.n, t_iso, t_comp, est, t_sk, "measured", est_sk)
            return
        scale = (args.n / skdim_n) ** 2
        row(name, args.n, t_iso, t_comp, est, t_sk * scale, f"O(N^2) from {skdim_n}")
        t_iso_s, t_comp_s, est_s = time_isojax(isojax_fn(name, args.k), x_dev[:skdim_n], args.repeat)
        row(name, skdim_n, t_iso_s, t_comp_s, est_s, t_sk, "measured", est_sk)

    searches = [s.strip() for s in args.search.split(",") if s.strip()]
    for first in searches:
        set_search(first)
        for name in names:
            t_iso, t_comp, est = time_isojax(isojax_fn(name, args.k), x_dev, args.repeat)
            if not use_skdim or first != searches[0]:  # skdim against the first search only
                row(name, args.n, t_iso, t_comp, est)
                continue
            run_skdim(name, t_iso, t_comp, est)
    set_search("auto")

    if args.check:
        for k in sorted({K_OF[name](args.k) for name in names}):
            line = (f"# check: k = {k}, {args.check} random rows, largest relative difference from "
                    f"float64: {check(x_np, x_dev, k, args.check, args.seed):.1e}")
            lines.append(line)
            print(line, flush=True)
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], "bench_intrinsic.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
