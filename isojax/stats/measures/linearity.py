"""Linearity score between consecutive states on the sample (Your Transformer is Secretly Linear)."""

from isojax.stats import geometry
from isojax.stats.measures.base import Measure, Metric


def readout(x_KxD, y_KxD) -> dict:
    """1 - min_A ||X A - Y||_F^2 with X, Y the points centered and divided by their Frobenius norm:
    ||P Y||_F^2, P the projection onto the span of X's principal directions whose variance is above
    the spectral floor (geometry.spectral_floor, float32's: a null direction of the exact states
    holds only rounding, which would fit about 1/K of Y by chance). From the smaller of the D x D
    and K x K Grams. NaN where X keeps K - 1 directions (every centered Y is then fitted exactly:
    K <= D + 1) or Y does not vary."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD, xp.float64), xp.astype(y_KxD, xp.float64)
    k, d = x.shape
    x, y = x - xp.mean(x, axis=0), y - xp.mean(y, axis=0)
    nx, ny = xp.sqrt(xp.sum(x * x)), xp.sqrt(xp.sum(y * y))
    x, y = x / xp.where(nx > 0, nx, 1.0), y / xp.where(ny > 0, ny, 1.0)
    if d <= k:  # P Y = X V diag(1/lambda) V^T X^T Y over the kept eigenpairs of X^T X
        lam, v = xp.linalg.eigh(x.T @ x)
        fit = (v.T @ (x.T @ y)) ** 2  # [D, D]: row i, (v_i^T X^T Y)^2
    else:  # P Y = U U^T Y over the kept eigenvectors u of X X^T (the same eigenvalues)
        lam, u = xp.linalg.eigh(x @ x.T)
        fit = (u.T @ y) ** 2
    floor = geometry.FLOOR_ULPS * geometry.FLOAT32_ROUNDOFF * xp.max(lam)
    kept = lam > floor
    per_direction = xp.sum(fit, axis=1) / (xp.where(kept, lam, 1.0) if d <= k else 1.0)
    score = xp.sum(xp.where(kept, per_direction, 0.0))
    exact = xp.sum(xp.astype(kept, xp.int64)) >= k - 1
    return {"linearity": xp.where(exact | (nx == 0) | (ny == 0), xp.nan, score)}


MEASURE = Measure(
    metrics=(Metric("linearity", "fraction of variance", "linearity score with the previous state"),),
    reads="pairs", readout=readout, paper="Razzhigaev et al. 2024 (Your Transformer is Secretly Linear)",
    on_by_default=False,  # one float64 eigh of D x D per pair: 12.6 ms at D = 1024 on an H200 (bench/RESULTS.md 17)
    readme_row="| `linearity` | **off by default** (`--measure linearity`; 0.3 s a 410m checkpoint on an H200, 10% of a "
               "2M-token loop); the linearity score of state i from state i − 1 on the K sampled tokens: "
               "1 − min_A ‖X̃A − Ỹ‖²_F with X̃, Ỹ the two states' sampled points centered and divided by their "
               "Frobenius norm (the paper's Procrustes normalization) = ‖PỸ‖²_F, P the projection onto X̃'s principal "
               "directions above the float32 spectral floor (64·2⁻²⁴·λ₁: a null direction holds only rounding), in "
               "float64; null for `embed`, without a sample, and where X̃ keeps K − 1 directions (K ≤ D + 1: any Ỹ is "
               "then fitted exactly) | Razzhigaev et al. 2024 (Your Transformer is Secretly Linear) |")
