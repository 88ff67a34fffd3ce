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

# Rudman & Eickhoff (ICLR 2024), I-STAR/analysis.py: IsoScore* of a layer's points with
# zeta = 0.75 and C0 = np.cov of a large sample of the same layer's states (training, ~250k points).
ISOSCORE_ZETA = 0.75
# alpha-ReQ's fit range (Agrawal et al. 2022 as reptrix.alpha.get_alpha fits it: fit_range
# np.arange(10, 100), 0-based): ranks 11 to 100 of the descending spectrum.
ALPHA_REQ_RANKS = (11, 100)
FLOAT32_ROUNDOFF = 2.0 ** -24
FLOOR_ULPS = 64  # the float32 floor in unit roundoffs of lambda_1 (spectral_floor)
BF16_ROUNDOFF = 2.0 ** -9


def spectral_floor(eig_D, bf16_mean_sq: float | None = None) -> float:
    """The eigenvalue below which a streamed covariance's spectrum is rounding, not signal: every
    spectral measure counts an eigenvalue at or under it as 0 (floored). bf16_mean_sq: None for
    float32 states; for bfloat16 states, the largest mean square of a coordinate, max_i mean_t x_ti^2.

    - FLOOR_ULPS x 2^-24 x lambda_1 (float32 Grams). A null eigenvalue's computed value is the Gram's
      rounding error in that direction: measured within 2.5 u x lambda_1 (1.5e-7 lambda_1 for an
      embedding's null space at D = 64 on the CPU, tests/test_author_measures.py; ~1e-7 lambda_1
      for a LayerNorm's on a GPU, issue 45), so 64 u leaves a margin of 25. Not D u lambda_1, the
      bound if each of D summed terms added u: at D = 2048 that is 1.2e-4 lambda_1, above most of
      the spectrum of an anisotropic state (lambda_1 = 0.9 of the trace leaves the others 5e-5
      lambda_1 on average), which it would call null.
    - at least 2^-18 x max(lambda_1, bf16_mean_sq) with bf16 states. The forward rounds each state
      to bf16 (x_ti + r_ti, independent errors |r_ti| <= 2^-9 |x_ti|, variance <= 2^-18 / 3 x_ti^2),
      and the step rounds the deviations from the batch mean to bf16 again before their Gram
      (accumulators._centered_gram, errors relative to d_ti). A direction v null for the exact
      states then holds, per token on average, at most Sum_i v_i^2 2^-18 / 3 mean_t x_ti^2 <=
      2^-18 / 3 x bf16_mean_sq of the first and 2^-18 / 3 x lambda_1 of the second: the floor is 3
      times the larger. Relative to |x|, not to the deviations: a state whose mean dwarfs its
      spread (a random GPT-2's final LayerNorm in the test: lambda_1 = 0.008, mean_t x_i^2 up to
      8.5) has its null direction at 2.4e-4 lambda_1 once rounded to bf16. The worst case, every
      rounding aligned with v (2^-18 x trace), cut eigenvalues that bf16 resolves to 3%.
    """
    eig = np.asarray(eig_D, np.float64)
    if eig.size == 0:
        return 0.0
    top = max(float(eig.max()), 0.0)
    bf16 = 0.0 if bf16_mean_sq is None else BF16_ROUNDOFF ** 2 * max(top, float(bf16_mean_sq))
    return max(FLOOR_ULPS * FLOAT32_ROUNDOFF * top, bf16)


def floored(eig_D, floor: float) -> np.ndarray:
    """The spectrum descending in float64, eigenvalues at or under `floor` set to 0."""
    eig = np.sort(np.asarray(eig_D, np.float64))[::-1]
    return np.where(eig > floor, eig, 0.0)


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
    """IsoScore (Rudman et al. 2022) from the (floored) eigenvalues of a point cloud's covariance:
    the package's IsoScore(points) takes torch.cov (ddof=1) and its singular values; the score is
    invariant to the covariance's scale, so the population covariance (ddof=0) gives the same."""
    return _isoscore_of(np.abs(np.asarray(eig_D, np.float64)))


def isoscore_star(eig_D, n: int, zeta: float = ISOSCORE_ZETA) -> float | None:
    """IsoScore* (Rudman & Eickhoff 2024) as I-STAR's analysis uses it, the package's
    IsoScore_star(points, C0, zeta) with C0 the covariance (np.cov, ddof=1) of a large sample of the
    same space: here the exact covariance of all n states of the layer from its streamed second
    moments, eigenvalues eig_D (ddof=0). Points and C0 are then the same states, so (1 - zeta) C +
    zeta C0 = C: the score equals IsoScore whatever zeta. A source's states against the layer's C0
    differ: stats.finalize shrinks each source's covariance toward the layer's and takes IsoScore
    of that."""
    if n < 2:
        return None
    cov_D = np.asarray(eig_D, np.float64) * (n / (n - 1))
    return _isoscore_of(np.abs((1.0 - zeta) * cov_D + zeta * cov_D))


def alpha_req(eig_D) -> float | None:
    """alpha-ReQ (Agrawal et al. 2022) as reptrix fits it (after Stringer et al. 2019): the decay
    alpha of lambda_k ~ k^-alpha, by least squares of log lambda_k against log k weighted by 1/k,
    over the ranks ALPHA_REQ_RANKS (11 to 100) of the descending (floored) spectrum, cut at the
    last nonzero eigenvalue; None with fewer than two ranks there (D or rank under 12)."""
    eig = np.sort(np.asarray(eig_D, np.float64))[::-1]
    lo, hi = ALPHA_REQ_RANKS
    hi = min(hi, int((eig > 0).sum()))
    if hi - lo + 1 < 2:
        return None
    k = np.arange(lo, hi + 1, dtype=np.float64)
    x, y, w = np.log(k), np.log(eig[lo - 1:hi]), 1.0 / k
    x0, y0 = x - (w @ x) / w.sum(), y - (w @ y) / w.sum()
    return float(-(w * x0 @ y0) / (w * x0 @ x0))


def effective_rank(eig_D) -> float | None:
    """Roy & Vetterli (2007): exp of the Shannon entropy of p_k = s_k / Sum s_j, s_k =
    sqrt(lambda_k) the centered states' singular values (floored spectrum); None without variance."""
    sv = np.sqrt(np.clip(np.asarray(eig_D, np.float64), 0.0, None))
    if not sv.sum() > 0:
        return None
    p = sv[sv > 0] / sv.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def erank(eig_D) -> float | None:
    """Wei et al. (2024)'s effective rank: exp of the Shannon entropy of the eigenvalues (lambda,
    not sqrt) of a trace-normalized covariance (floored spectrum); None without variance."""
    lam = np.clip(np.asarray(eig_D, np.float64), 0.0, None)
    if not lam.sum() > 0:
        return None
    p = lam[lam > 0] / lam.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


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
