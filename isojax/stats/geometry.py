"""Geometry measures of issue 37 in float64 (README "Conventions and metric definitions").

Two kinds of function. The spectral ones (isoscore, isoscore_star, alpha_req, rogue_dims,
feature_kurtosis) take what stats.finalize reads out of the accumulators (the centered
covariance's eigenvalues, counts, sums, diagonals) and return a Python float (or list), or None
where the measure is undefined (the caller logs why). The sample ones (inter_sim_standardized,
median_abs, centered_cross) take points [K, D] of any array library with the array API
(numpy, or jax.numpy under jax.jit where the sample lies on the devices) and return a 0-d
float64 array, NaN where undefined.
"""

from __future__ import annotations

import numpy as np

# Rudman & Eickhoff (ICLR 2024) "Stable Anisotropic Regularization": their experiments, and
# their repository's example (I-STAR/run_model.sh: "a shrinkage parameter (zeta) of 0.2"), use 0.2.
ISOSCORE_ZETA = 0.2
ALPHA_REQ_FLOOR = 1e-12  # eigenvalues at or below this fraction of the largest are left out of alpha_req


def _isoscore_of(pcs_D: np.ndarray) -> float | None:
    """The IsoScore of a covariance's principal-component variances (IsoScore 2.0.1, steps 3-6),
    in float64 throughout (the package takes sqrt(D) in float32: ~1e-7 of difference)."""
    d = pcs_D.size
    norm = np.linalg.norm(pcs_D)
    if d < 2 or not norm > 0:
        return None
    pcs_norm = pcs_D * np.sqrt(d) / norm
    defect = np.linalg.norm(pcs_norm - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    return float(((d - defect ** 2 * (d - np.sqrt(d))) ** 2 - d) / (d * (d - 1)))


def isoscore(eig_D) -> float | None:
    """IsoScore (Rudman et al. 2022) from the eigenvalues of a point cloud's covariance: the
    package's IsoScore(points) takes torch.cov (ddof=1) and its singular values; the score is
    invariant to the covariance's scale, so the population covariance (ddof=0) gives the same."""
    return _isoscore_of(np.abs(np.asarray(eig_D, np.float64)))


def isoscore_star(eig_D, n: int, zeta: float = ISOSCORE_ZETA) -> float | None:
    """IsoScore* (Rudman & Eickhoff 2024) as the package's IsoScore_star(points, C0=I, zeta):
    the sample covariance C (ddof=1, from the population covariance's eigenvalues eig_D of n
    points) shrunk to (1 - zeta) C + zeta I, whose eigenvalues are (1 - zeta) eig + zeta."""
    if n < 2:
        return None
    cov_D = np.asarray(eig_D, np.float64) * (n / (n - 1))
    return _isoscore_of(np.abs((1.0 - zeta) * cov_D + zeta))


def alpha_req(eig_D) -> float | None:
    """alpha-ReQ (Agrawal et al. 2022): minus the least-squares slope of log lambda_k against
    log k (k = 1, 2, ... in descending order) over the eigenvalues above ALPHA_REQ_FLOOR x
    lambda_1; None with fewer than two of them."""
    eig = np.sort(np.asarray(eig_D, np.float64))[::-1]
    if eig.size < 2 or not eig[0] > 0:
        return None
    kept = eig[eig > ALPHA_REQ_FLOOR * eig[0]]
    if kept.size < 2:
        return None
    log_k = np.log(np.arange(1, kept.size + 1, dtype=np.float64))
    log_k0 = log_k - log_k.mean()
    return float(-(log_k0 @ np.log(kept)) / (log_k0 @ log_k0))


def rogue_dims(n: int, unit_sum_D, unit_sq_sum_D, top: int = 3) -> list[dict] | None:
    """Timkey & van Schijndel (2021) rogue dimensions: InterSim = sum_i c_i with
    c_i = (S_i^2 - sum_t u_ti^2) / (n^2 - n) the contribution of dimension i (u: unit vectors,
    S = sum_t u_t); the `top` largest c_i as [{"dim": i, "share": c_i / InterSim}]. None for
    n < 2 or InterSim = 0."""
    if n < 2:
        return None
    s_D = np.asarray(unit_sum_D, np.float64)
    c_D = (s_D * s_D - np.asarray(unit_sq_sum_D, np.float64)) / (float(n) * n - n)
    inter = c_D.sum()
    if inter == 0:
        return None
    order = np.argsort(-c_D, kind="stable")[:top]
    return [{"dim": int(i), "share": float(c_D[i] / inter)} for i in order]


def feature_kurtosis(n: int, sq_sum_D) -> float | None:
    """He et al. (2024): with s_i^2 = mean over tokens of x_ti^2 (sq_sum_D = sum_t x_ti^2),
    mean_i(s_i^4) / mean_i(s_i^2)^2 (1 when every dimension has the same scale)."""
    if n < 1:
        return None
    s2_D = np.asarray(sq_sum_D, np.float64) / n
    mean = s2_D.mean()
    return float((s2_D * s2_D).mean() / (mean * mean)) if mean > 0 else None


def inter_sim_standardized(x_KxD):
    """InterSim after Timkey & van Schijndel's standardization: each dimension z-scored with the
    points' own mean and standard deviation (a constant dimension becomes 0; the cosines do not
    depend on ddof), then the mean cosine over distinct pairs. NaN for K < 2, or where a point's
    z-scores are all 0."""
    xp = x_KxD.__array_namespace__()
    x = xp.astype(x_KxD, xp.float64)
    k = x.shape[0]
    if k < 2:
        return xp.asarray(xp.nan, dtype=xp.float64)
    sd = xp.std(x, axis=0)
    z = xp.where(sd > 0, (x - xp.mean(x, axis=0)) / xp.where(sd > 0, sd, 1.0), 0.0)
    norm_K = xp.sqrt(xp.sum(z * z, axis=1))
    s_D = xp.sum(z / norm_K[:, None], axis=0)
    return (xp.sum(s_D * s_D) - k) / (k * k - k)


def median_abs(x_KxD):
    """The median of |x| over every entry (of an even count: the mean of the middle two)."""
    xp = x_KxD.__array_namespace__()
    return xp.median(xp.abs(xp.astype(x_KxD, xp.float64)))


def centered_cross(x_KxD, y_KxD):
    """||X^T Y||_F^2 of the centered (column means removed) points, in float64: the HSIC
    numerator of linear CKA, from the smaller of the D x D cross-covariance and the K x K Grams."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD, xp.float64), xp.astype(y_KxD, xp.float64)
    x, y = x - xp.mean(x, axis=0), y - xp.mean(y, axis=0)
    if x.shape[0] < max(x.shape[1], y.shape[1]):
        return xp.sum((x @ x.T) * (y @ y.T))
    c = x.T @ y
    return xp.sum(c * c)


def cka_matrix(cross_SxS) -> list[list[float | None]]:
    """Linear CKA (Kornblith et al. 2019) of every pair of states from their centered_cross
    values: ||Y^T X||^2 / (||X^T X|| ||Y^T Y||); None where a state has no variance."""
    cross = np.asarray(cross_SxS, np.float64)
    diag = np.sqrt(np.diag(cross))
    return [[float(cross[i, j] / (diag[i] * diag[j])) if diag[i] > 0 and diag[j] > 0 else None
             for j in range(len(diag))] for i in range(len(diag))]


def linear_cka(x_KxD, y_KxD) -> float | None:
    """Linear CKA of two sets of the same K points (numpy)."""
    return cka_matrix([[centered_cross(a, b) for b in (x_KxD, y_KxD)] for a in (x_KxD, y_KxD)])[0][1]
