"""Orthogonal Procrustes distance between consecutive states on the sample (Ding et al. 2021)."""

from isojax.stats.measures.base import Measure, Metric
from isojax.stats.measures.neighbourhood_overlap import TOKENS  # the first 2048: cost ~ min(K, D)^3 bounded


def readout(x_KxD, y_KxD) -> dict:
    """min over orthogonal Q of ||X Q - Y||_F^2 = 2 - 2 ||X^T Y||_* for X, Y the first TOKENS points
    centered and divided by their Frobenius norm, ||.||_* the nuclear norm (the sum of singular
    values): of the D x D X^T Y, or where D > K of R_X R_Y^T, X^T = Q_X R_X and Y^T = Q_Y R_Y their
    QR factors (the same singular values). In [0, 2]; NaN where a state does not vary (or for a
    single point)."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD[:TOKENS], xp.float64), xp.astype(y_KxD[:TOKENS], xp.float64)
    k, d = x.shape
    x, y = x - xp.mean(x, axis=0), y - xp.mean(y, axis=0)
    nx, ny = xp.sqrt(xp.sum(x * x)), xp.sqrt(xp.sum(y * y))
    x, y = x / xp.where(nx > 0, nx, 1.0), y / xp.where(ny > 0, ny, 1.0)
    if d <= k:
        product = x.T @ y
    else:
        product = xp.linalg.qr(x.T, mode="reduced")[1] @ xp.linalg.qr(y.T, mode="reduced")[1].T
    distance = xp.maximum(2.0 - 2.0 * xp.sum(xp.linalg.svdvals(product)), 0.0)  # 0 less rounding: 0
    return {"procrustes_distance": xp.where((nx > 0) & (ny > 0), distance, xp.nan)}


MEASURE = Measure(
    metrics=(Metric("procrustes_distance", "squared distance, 0 to 2", "Procrustes distance to the previous state"),),
    reads="pairs", readout=readout, paper="Ding et al. 2021", on_by_default=False, to_final=True,
    readme_row="| `procrustes_distance` | **off by default** (`--measure procrustes_distance`; 2.2 s a 410m checkpoint on an H200, 70% of a 2M-token loop); the orthogonal Procrustes distance of state i from state i − 1 on the "
               "first min(K, 2048) sampled tokens (a uniform subsample: the cost grows as min(K, D)³): min over "
               "orthogonal Q of ‖X̃Q − Ỹ‖²_F = 2 − 2‖X̃ᵀỸ‖_* with X̃, Ỹ the two states' sampled points centered and "
               "divided by their Frobenius norm, ‖·‖_* the nuclear norm (from the singular values of the D×D X̃ᵀỸ, "
               "or of the K×K product of their QR factors where D > K; float64); from 0 (equal up to a rotation) "
               "to 2. Null for `embed`, without a sample, and where a state does not vary. In a sweep also each layer "
               "against itself at the final checkpoint (`procrustes_distance_to_final`: \"Sweeps\") | Ding et al. 2021 |")
