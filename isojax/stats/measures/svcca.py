"""SVCCA between consecutive states on the sample (Raghu et al. 2017)."""

from isojax.stats.measures.base import Measure, Metric
from isojax.stats.measures.neighbourhood_overlap import TOKENS  # the first 2048: cost ~ min(K, D)^3 bounded

VARIANCE_KEPT = 0.99  # the paper's: the top singular directions that explain 99% of the variance


def _top_directions(x, xp):
    """([K, M] the left singular vectors of the centered X, M = min(K, D), in descending order of
    their singular values, those past the VARIANCE_KEPT share of the variance set to 0; their count)."""
    k, d = x.shape
    if d <= k:  # X^T X = V diag(lambda) V^T; U = X V / sqrt(lambda)
        lam, v = xp.linalg.eigh(x.T @ x)
    else:
        lam, u = xp.linalg.eigh(x @ x.T)
    lam = xp.flip(xp.clip(lam, 0.0, None))
    before = xp.cumulative_sum(lam) - lam  # the variance of the directions before each
    kept = before < VARIANCE_KEPT * xp.sum(lam)
    if d <= k:
        u = (x @ xp.flip(v, axis=1)) / xp.sqrt(xp.where(kept & (lam > 0), lam, 1.0))
    else:
        u = xp.flip(u, axis=1)
    return xp.where(kept[None, :], u, 0.0), xp.sum(xp.astype(kept, xp.int64))


def readout(x_KxD, y_KxD) -> dict:
    """On the first n = min(K, TOKENS) points, the mean of the min(kx, ky) canonical correlations
    between X's and Y's top kx and ky singular directions (the centered points' SVD, each keeping
    the fewest directions that explain VARIANCE_KEPT of the variance): the singular values of
    Ux^T Uy, Ux and Uy those directions' orthonormal left singular vectors (float64). NaN where a
    state does not vary, or where kx + ky >= n (two subspaces of the n - 1 dimensions of centered
    points then share a direction: a correlation of 1 by counting alone)."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD[:TOKENS], xp.float64), xp.astype(y_KxD[:TOKENS], xp.float64)
    n = x.shape[0]
    x, y = x - xp.mean(x, axis=0), y - xp.mean(y, axis=0)
    (ux, kx), (uy, ky) = _top_directions(x, xp), _top_directions(y, xp)
    rho = xp.clip(xp.linalg.svdvals(ux.T @ uy), 0.0, 1.0)  # descending; past min(kx, ky): 0 but rounding
    m = xp.minimum(kx, ky)
    mean = xp.sum(xp.where(xp.arange(rho.shape[0]) < m, rho, 0.0)) / xp.astype(xp.maximum(m, 1), xp.float64)
    varies = (xp.sum(x * x) > 0) & (xp.sum(y * y) > 0)
    return {"svcca": xp.where(varies & (kx + ky < n), mean, xp.nan)}


MEASURE = Measure(
    metrics=(Metric("svcca", "mean correlation", "SVCCA with the previous state (99% of the variance)"),),
    reads="pairs", readout=readout, paper="Raghu et al. 2017 (SVCCA)", on_by_default=False, to_final=True,
    readme_row="| `svcca` | **off by default** (`--measure svcca`; 3.0 s a 410m checkpoint on an H200, 97% of a 2M-token loop); SVCCA of state i with state i − 1 on the first min(K, 2048) sampled tokens (a uniform "
               "subsample: the cost grows as min(K, D)³): each state's centered points reduced by SVD to their "
               "fewest top singular directions that explain 99% of the variance (the paper's threshold; kᵢ₋₁ and "
               "kᵢ of them), then the mean of the min(kᵢ₋₁, kᵢ) canonical correlations between the two (the "
               "singular values of Uᵢ₋₁ᵀUᵢ, U the kept left singular vectors; float64). Null for `embed`, without "
               "a sample, where a state does not vary, and where kᵢ₋₁ + kᵢ ≥ min(K, 2048) (the two subspaces of "
               "the centered points' dimensions then share a direction: a correlation of 1 by counting alone). In a "
               "sweep also each layer against itself at the final checkpoint (`svcca_to_final`: \"Sweeps\") "
               "| Raghu et al. 2017 (SVCCA) |")
