"""GRIDE intrinsic dimension at several scales on the sample (Denti et al. 2022), as dadapy 0.3.4's
Data.remove_identical_points() then Data.return_id_scaling_gride() (range_max = 64, d0 = 0.001,
d1 = 1000, eps = 1e-7: its defaults) compute it."""

import math

from isojax.stats.measures.base import Measure, Metric
from isojax.stats.measures.neighbourhood_overlap import MIN_KEPT, ROW_BLOCKS, TOKENS

RANKS = (2, 4, 8, 16, 32, 64)  # n2 = 2 n1, n1 = 1, 2, ..., 32: dadapy's scales up to range_max = 64
D0, D1, EPS = 0.001, 1000.0, 1e-7  # dadapy's bisection: its bounds and precision
BISECTIONS = math.ceil(math.log2((D1 - D0) / EPS))  # dadapy halves [D0, D1] while wider than EPS: 34 times
FLOAT64_EPS = 2.0 ** -52


def _repeated(x, xp):
    """[n] bool: every point of a group of equal points but one. Points in the order of their
    projection on a fixed direction, each compared with the one before it entry by entry. The
    projection is a product then a sum along each row (not a matrix product, whose rows XLA may sum
    in different orders): equal points project equal, so a group is never split but where a
    different point projects exactly on it (measure zero)."""
    v = xp.sum(x * (1.0 + xp.sin(xp.arange(x.shape[1], dtype=xp.float64) * 1.618)), axis=1)
    order = xp.argsort(v, stable=True)
    xs = xp.take(x, order, axis=0)
    later = xp.concat([xp.asarray([False]), xp.all(xs[1:] == xs[:-1], axis=1)])
    return xp.take(later, xp.argsort(order))


def _nearest(x, kept, rows, xp):
    """[B, 64] ascending distances from x[rows] to their 64 nearest other kept points (float64; inf
    past the n - 1 others)."""
    sq = xp.sum(x * x, axis=1)
    d2 = sq[rows][:, None] + sq[None, :] - 2.0 * (x[rows] @ x.T)
    itself = xp.arange(x.shape[0])[None, :] == xp.arange(rows.start, rows.stop)[:, None]
    d2 = xp.where(itself | ~kept[None, :], xp.inf, d2)
    nearest = min(RANKS[-1], x.shape[0] - 1)
    if xp.__name__.startswith("jax"):
        import jax
        d2 = -jax.lax.top_k(-d2, nearest)[0]
    else:
        import numpy as np
        d2 = np.sort(np.partition(d2, nearest - 1, axis=1)[:, :nearest], axis=1)
    d2 = xp.concat([d2, xp.full((d2.shape[0], RANKS[-1] - nearest), xp.inf, dtype=xp.float64)], axis=1)
    return xp.sqrt(xp.clip(d2, 0.0, None))


def _percentile(v, ok, count, q, xp):
    """numpy's percentile q (linear) of v[ok] along axis 0, per column; count = ok's count per column."""
    s = xp.sort(xp.where(ok, v, xp.inf), axis=0)
    s = xp.where(xp.isfinite(s), s, 0.0)  # past count: never read (but where count is 0)
    pos = q / 100.0 * (count - 1.0)
    lo = xp.astype(xp.floor(pos), xp.int64)
    hi = xp.minimum(lo + 1, xp.astype(count, xp.int64) - 1)
    lo, hi = xp.clip(lo, 0, v.shape[0] - 1), xp.clip(hi, 0, v.shape[0] - 1)
    a, b = (xp.take_along_axis(s, i[None, :], axis=0)[0] for i in (lo, hi))
    return a + (pos - xp.floor(pos)) * (b - a)


def readout(x_KxD) -> dict:
    """{"gride": [len(RANKS)]}: per scale n2 = 2 n1, dadapy's maximum-likelihood id of the ratios
    mu = r_n2 / r_n1 of the n2-th and n1-th nearest-neighbour distances of the first TOKENS kept
    points: its filter (mu == 1 raised by 10 eps; mu >= 20 (q95 - q50) + q50 left out) and its 34
    bisections of the likelihood's derivative on [0.001, 1000]. A point equal to an earlier sampled
    point is left out (dadapy's remove_identical_points); NaN where fewer than MIN_KEPT of the
    points, or at most n2 points, are kept."""
    xp = x_KxD.__array_namespace__()
    x = xp.astype(x_KxD[:TOKENS], xp.float64)
    n = x.shape[0]
    nan = xp.full(len(RANKS), xp.nan, dtype=xp.float64)
    if n <= 2:
        return {"gride": nan}
    kept = ~_repeated(x, xp)
    count = xp.sum(xp.astype(kept, xp.float64))
    x = x - xp.sum(xp.where(kept[:, None], x, 0.0), axis=0) / count  # distances from smaller numbers
    block = max(512, -(-n // ROW_BLOCKS))
    r = xp.concat([_nearest(x, kept, slice(s, min(n, s + block)), xp) for s in range(0, n, block)])
    r = xp.maximum(r, FLOAT64_EPS)  # dadapy's remove_zero_dists (distances below eps set to eps)
    n2 = xp.asarray(RANKS, dtype=xp.float64)
    n1 = n2 / 2
    far, near = (xp.stack([r[:, k - 1] for k in ranks], axis=1) for ranks in (RANKS, [k // 2 for k in RANKS]))
    mu = xp.where(xp.isfinite(far), far / xp.where(xp.isfinite(near), near, 1.0), xp.inf)  # [n, scales]
    mu = xp.where(mu == 1.0, mu + 10 * FLOAT64_EPS, mu)
    ok = kept[:, None] & xp.isfinite(mu)  # a point with fewer than n2 kept others: inf, left out
    have = xp.sum(xp.astype(ok, xp.float64), axis=0)
    q95, q50 = (_percentile(mu, ok, have, q, xp) for q in (95.0, 50.0))
    ok = ok & (mu < 20.0 * (q95 - q50) + q50)
    m = xp.sum(xp.astype(ok, xp.float64), axis=0)
    log_mu = xp.where(ok, xp.log(xp.where(ok, mu, 2.0)), 0.0)

    def slope(d):  # dadapy's _neg_dloglik_did at d [scales]
        one_minus = xp.maximum(1.0 - xp.where(ok, mu, 2.0) ** -d, 2 * EPS)
        return xp.sum(((1.0 - n2 + n1) / one_minus + n2 - 1.0) * log_mu, axis=0) - (m - 1.0) / d

    lo, hi = xp.full(len(RANKS), D0, dtype=xp.float64), xp.full(len(RANKS), D1, dtype=xp.float64)
    at_hi = slope(hi)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2.0
        same = slope(mid) * at_hi > 0
        lo, hi = xp.where(same, lo, mid), xp.where(same, mid, hi)
    undefined = (count < MIN_KEPT * n) | (count <= n2) | (m < 2)
    return {"gride": xp.where(undefined, xp.nan, (lo + hi) / 2.0)}


MEASURE = Measure(
    metrics=(Metric("gride", "dimensions", "GRIDE intrinsic dimension", keys=tuple(str(k) for k in RANKS)),),
    reads="sample", readout=readout, paper="Denti et al. 2022 (GRIDE)", on_by_default=False,
    readme_row="| `gride` | **off by default** (`--measure gride`; 36 ms a 410m checkpoint on an H200, 1.2% of a 2M-token loop); `{\"2\": id, \"4\": id, …, \"64\": id}` (layers.csv: `gride_2` … `gride_64`): the GRIDE "
               "intrinsic dimension at scale n₂ = 2, 4, …, 64, the maximum-likelihood id of the ratios r_n₂/r_n₁ "
               "(n₁ = n₂/2) of each point's n₂-th and n₁-th nearest-neighbour distances, over the first min(K, 2048) "
               "sampled tokens (Euclidean, float64), as dadapy 0.3.4's `remove_identical_points()` then "
               "`return_id_scaling_gride(range_max=64)` compute it (its filter of large ratios and its bisection "
               "on [0.001, 1000] to 1e-7; one density, so runs of any K compare). A token whose point equals an "
               "earlier sampled token's is left out; null where fewer than half the tokens, or at most n₂, are "
               "kept (the embedding repeats one point per token type: `embed` is usually null) "
               "| Denti et al. 2022 (GRIDE) |")
