"""The spectral floor that every spectral measure reads its spectrum under (spectral_floor, floored; the
measures themselves: stats/measures/, one file each), and the sample's geometry in float64 (README "Conventions
and metric definitions"): inter_sim_standardized, median_abs and centered_cross take points [K, D] of any array
library with the array API (numpy, or jax.numpy under jax.jit where the sample lies on the devices) and return a
0-d float64 array, NaN where undefined; cka_matrix and linear_cka read linear CKA from them.
"""

from __future__ import annotations

import numpy as np

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
