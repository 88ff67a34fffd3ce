"""Neighbourhood overlap between consecutive states on the sample (Doimo et al. 2020)."""

from isojax.stats.measures.base import Measure, Metric

K_NEIGHBOURS = 30  # dadapy's default for return_data_overlap, as Doimo et al. use it
TOKENS = 2048  # the first this many sampled tokens (the sample is in random order): one density for every run
ROW_BLOCKS = 16  # the distance matrix in at most this many blocks of rows (at least 512 rows each): never K x K


MIN_KEPT = 0.5  # null where fewer than this fraction of the sampled tokens are kept (intrinsic.MIN_KEPT_SAMPLE)


def _neighbours(x, kept, rows, xp):
    """[B, k] indices of the K_NEIGHBOURS nearest other kept points of x[rows] (Euclidean, float64)."""
    sq = xp.sum(x * x, axis=1)
    d2 = sq[rows][:, None] + sq[None, :] - 2.0 * (x[rows] @ x.T)
    itself = xp.arange(x.shape[0])[None, :] == xp.arange(rows.start, rows.stop)[:, None]
    d2 = xp.where(itself | ~kept[None, :], xp.inf, d2)
    if xp.__name__.startswith("jax"):  # selections, not sorts: equal distances (measure zero) in any order
        import jax
        return jax.lax.top_k(-d2, K_NEIGHBOURS)[1]
    import numpy as np
    return np.argpartition(d2, K_NEIGHBOURS - 1, axis=1)[:, :K_NEIGHBOURS]


def _repeats(x, xp):
    """[K] bool: the points equal to an earlier sampled point (equal projections on a fixed direction:
    distinct points project apart but for a measure-zero coincidence)."""
    v = x @ (1.0 + xp.sin(xp.arange(x.shape[1], dtype=xp.float64) * 1.618))
    order = xp.argsort(v, stable=True)  # equal values keep the sample's order: the first one is kept
    sv = xp.take(v, order)
    later = xp.concat([xp.asarray([False]), sv[1:] == sv[:-1]])
    return xp.take(later, xp.argsort(order))


def readout(x_KxD, y_KxD) -> dict:
    """mean over the kept points i of the first TOKENS sampled of |N_k(i) in X  &  N_k(i) in Y| / k,
    N_k(i) the k nearest other kept points among them. A point equal to an earlier one in either state (the same token in the same
    context: its neighbours would tie) is left out; NaN where fewer than MIN_KEPT of the points, or at
    most k, are kept."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD[:TOKENS], xp.float64), xp.astype(y_KxD[:TOKENS], xp.float64)
    n = x.shape[0]
    if n <= K_NEIGHBOURS:
        return {"neighbourhood_overlap": xp.asarray(xp.nan, dtype=xp.float64)}
    kept = ~(_repeats(x, xp) | _repeats(y, xp))
    shared = xp.asarray(0.0, dtype=xp.float64)
    block = max(512, -(-n // ROW_BLOCKS))
    for start in range(0, n, block):
        rows = slice(start, min(n, start + block))
        a, b = _neighbours(x, kept, rows, xp), _neighbours(y, kept, rows, xp)
        common = xp.sum(xp.astype(a[:, :, None] == b[:, None, :], xp.float64), axis=(1, 2))
        shared = shared + xp.sum(xp.where(kept[rows], common, 0.0))
    count = xp.sum(xp.astype(kept, xp.float64))
    undefined = (count < MIN_KEPT * n) | (count <= K_NEIGHBOURS)
    return {"neighbourhood_overlap": xp.where(undefined, xp.nan, shared / (xp.where(undefined, 1.0, count)
                                                                             * K_NEIGHBOURS))}


MEASURE = Measure(
    metrics=(Metric("neighbourhood_overlap", "fraction of neighbours", "neighbourhood overlap with the previous state "
                    f"(k = {K_NEIGHBOURS})"),),
    reads="pairs", readout=readout, paper="Doimo et al. 2020",
    on_by_default=False,  # 1.6 ms a pair at 16,384 x 1,024 on an H200: 1.3% of a 410m 2M-token loop (bench/RESULTS.md 17)
    readme_row="| `neighbourhood_overlap` | **off by default** (`--measure neighbourhood_overlap`; 40 ms a 410m checkpoint on an H200, 1.3% of a 2M-token loop); χ = meanᵢ \\|Nₖ(i) ∩ N′ₖ(i)\\|/k over the first min(K, 2048) sampled tokens "
               "(the sample is in random order: a uniform subsample; one density, so runs of any K compare), Nₖ(i) "
               "the k = 30 nearest other points among them of token i in state i − 1 and N′ₖ(i) in state i "
               "(Euclidean, float64; "
               "dadapy's `return_data_overlap` with its default k = 30). A token whose point equals an earlier "
               "sampled token's in either state (the same token in the same context) is left out: its neighbours "
               "would tie. Null for `embed`, without a sample, and where fewer than half the sampled tokens, or at "
               "most k, are kept (the embedding repeats one point per token type: `block_1` is usually null) "
               "| Doimo et al. 2020 |")
