"""The geometry measures' formulas (isojax/stats/measures/: isoscore, isoscore_star, alpha_req, rogue_dims,
feature_kurtosis; isojax.stats.geometry: the sample's) against independent float64 references on random points:
the IsoScore package itself (IsoScore 2.0.1, torch), and plain numpy written here by the papers' definitions."""

from __future__ import annotations

import numpy as np
import pytest

from isojax.stats import geometry
from isojax.stats.measures.alpha_req import alpha_req
from isojax.stats.measures.feature_kurtosis import feature_kurtosis
from isojax.stats.measures.isoscore import isoscore
from isojax.stats.measures.isoscore_star import ZETA, isoscore_star
from isojax.stats.measures.rogue_dims import rogue_dims


def anisotropic_points(rng, n=300, d=12):
    """Points with one rogue dimension, a mean offset and unequal scales."""
    x = rng.standard_normal((n, d)) * np.linspace(0.3, 3.0, d) + rng.standard_normal(d)
    x[:, 4] += 8.0 + rng.standard_normal(n)
    return x


def population_eigs(x):
    """Eigenvalues of the population covariance (ddof=0), as stats.finalize reads them out."""
    return np.linalg.eigvalsh(np.cov(x.T, ddof=0))[::-1]


@pytest.mark.parametrize("n, d", [(300, 12), (8, 12)])  # n < d: rank-deficient
def test_isoscore_and_isoscore_star_equal_the_isoscore_package(n, d):
    """IsoScore*, as I-STAR's analysis calls it: C0 = np.cov of a large sample of the same space, here
    all the points themselves (isojax's C0: every state of the layer), so it equals IsoScore at any zeta."""
    from conftest import need
    torch, package = need("torch"), need("IsoScore.IsoScore")

    rng = np.random.default_rng(n)
    x = anisotropic_points(rng, n, d)
    eig = population_eigs(x)
    assert abs(isoscore(eig) - float(package.IsoScore(x))) < 1e-6
    for zeta in (0.0, ZETA, 1.0):
        want = float(package.IsoScore_star(x, torch.tensor(np.cov(x.T)), zeta))
        assert abs(isoscore_star(eig, n, zeta) - want) < 1e-6, zeta
    assert ZETA == 0.75
    assert isoscore(np.zeros(d)) is None and isoscore_star(eig, 1, 0.75) is None


def test_isoscore_of_isotropic_and_one_dimensional_points():
    assert isoscore(np.ones(7)) == pytest.approx(1.0, abs=1e-12)
    assert isoscore(np.r_[1.0, np.zeros(6)]) == pytest.approx(0.0, abs=1e-12)


def test_alpha_req_is_the_weighted_fit_over_ranks_11_to_100():
    """reptrix's fit: log lambda_k on log k over ranks 11..100, residuals weighted by 1/k (polyfit's
    w multiplies residuals before squaring: w = k^-1/2)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((400, 150)) * np.arange(1, 151) ** -0.8 + rng.standard_normal(150)
    lam = np.sort(np.linalg.eigvalsh(np.cov(x.T)))[::-1]
    k = np.arange(11, 101)
    want = -np.polyfit(np.log(k), np.log(lam[k - 1]), 1, w=k ** -0.5)[0]
    assert abs(alpha_req(population_eigs(x)) - want) < 1e-10  # the scale (ddof) moves only the intercept
    # cut at the last nonzero (floored) eigenvalue: ranks 11..30
    lam_cut = np.r_[lam[:30], np.zeros(5)]
    k = np.arange(11, 31)
    want_cut = -np.polyfit(np.log(k), np.log(lam[k - 1]), 1, w=k ** -0.5)[0]
    assert abs(alpha_req(lam_cut) - want_cut) < 1e-10
    power = 1.0 / np.arange(1, 150) ** 1.3
    power[:10] = 1.0  # the head is outside the fit
    assert alpha_req(power) == pytest.approx(1.3, abs=1e-12)
    assert alpha_req(np.r_[np.ones(11), 0.0]) is None and alpha_req(np.zeros(30)) is None


def test_rogue_dims_against_brute_pairs():
    rng = np.random.default_rng(2)
    x = anisotropic_points(rng, n=40, d=9)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    n = len(u)
    c = np.zeros(u.shape[1])  # per dimension: the sum over distinct pairs of u_ti u_si
    for t in range(n):
        for s in range(n):
            if s != t:
                c += u[t] * u[s]
    c /= n * n - n
    inter = ((u @ u.T).sum() - n) / (n * n - n)
    assert abs(c.sum() - inter) < 1e-12
    got = rogue_dims(n, u.sum(0), (u * u).sum(0))
    order = np.argsort(-c)[:3]
    assert [r["dim"] for r in got] == list(order) and got[0]["dim"] == 4
    for r, i in zip(got, order):
        assert abs(r["share"] - c[i] / inter) < 1e-10
    assert rogue_dims(1, u[0], u[0] ** 2) is None


def test_feature_kurtosis_from_the_points():
    rng = np.random.default_rng(3)
    x = anisotropic_points(rng)
    s2 = (x ** 2).mean(0)  # uncentered: He et al. take the second moment, not the variance
    want = (s2 ** 2).mean() / s2.mean() ** 2
    assert abs(feature_kurtosis(len(x), (x ** 2).sum(0)) - want) < 1e-12
    var = x.var(0)
    assert abs(feature_kurtosis(len(x), (x ** 2).sum(0)) - (var ** 2).mean() / var.mean() ** 2) > 1e-3
    assert feature_kurtosis(5, np.zeros(4)) is None


def test_inter_sim_standardized_against_pairwise_cosines():
    rng = np.random.default_rng(4)
    x = anisotropic_points(rng, n=200, d=10)
    x[:, 7] = 3.0  # a constant dimension: z-scored to 0
    z = np.zeros_like(x)
    keep = x.std(0, ddof=1) > 0
    z[:, keep] = (x[:, keep] - x[:, keep].mean(0)) / x[:, keep].std(0, ddof=1)
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    n = len(u)
    want = ((u @ u.T).sum() - np.trace(u @ u.T)) / (n * n - n)
    got = float(geometry.inter_sim_standardized(x))
    assert abs(got - want) < 1e-12
    raw = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert abs(got - ((raw @ raw.T).sum() - n) / (n * n - n)) > 1e-2  # standardizing changes it
    assert np.isnan(geometry.inter_sim_standardized(x[:1]))


def test_median_abs_and_on_jax_arrays():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    x = rng.standard_normal((31, 4)).astype(np.float32)  # an even count of entries
    want = np.median(np.abs(x.astype(np.float64)))
    assert float(geometry.median_abs(x)) == want
    with jax.enable_x64(True):
        assert float(jax.jit(geometry.median_abs)(jnp.asarray(x))) == want
        got = float(jax.jit(geometry.inter_sim_standardized)(jnp.asarray(x)))
    assert abs(got - float(geometry.inter_sim_standardized(x))) < 1e-12


def hsic_cka(x, y):
    """Kornblith et al. (2019): HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with linear kernels
    K = X X^T, L = Y Y^T and the centering matrix H = I - 11^T / n."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    hsic = lambda k, l: np.trace(k @ h @ l @ h)
    k, l = x @ x.T, y @ y.T
    return hsic(k, l) / np.sqrt(hsic(k, k) * hsic(l, l))


@pytest.mark.parametrize("n", [50, 7])  # the D x D and the K x K form (K < D)
def test_linear_cka_against_centered_gram_hsic(n):
    rng = np.random.default_rng(n)
    x = anisotropic_points(rng, n, 12)
    y = np.tanh(x @ rng.standard_normal((12, 9))) + 5.0
    assert abs(geometry.linear_cka(x, y) - hsic_cka(x, y)) < 1e-10
    assert abs(geometry.linear_cka(x, x) - 1.0) < 1e-12
    uncentered = np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))
    assert abs(geometry.linear_cka(x, y) - uncentered) > 1e-3
    states = [x, y, x[:, ::-1] * 2.0]
    cross = [[geometry.centered_cross(a, b) for b in states] for a in states]
    matrix = geometry.cka_matrix(cross)
    for i, a in enumerate(states):
        for j, b in enumerate(states):
            assert abs(matrix[i][j] - hsic_cka(a, b)) < 1e-10
    const = np.ones_like(x)
    assert geometry.linear_cka(x, const) is None


def test_spectral_floor_takes_rounding_and_keeps_an_anisotropic_spectrum():
    """The floor (README "Measures"): 64 x 2^-24 lambda_1; with bf16 states at least 2^-18 x
    max(lambda_1, max_i mean x_i^2). A state at D = 2048 whose lambda_1 is 0.9 of the trace keeps
    its other 2047 eigenvalues (5e-5 lambda_1 on average; D x 2^-24 lambda_1 would floor most),
    and loses a null eigenvalue at float32 noise (2.5 u lambda_1) or at bf16 rounding of its values."""
    rng = np.random.default_rng(3)
    rest = rng.uniform(0.2, 1.8, 2047) * 0.1 / 2047
    eig = np.r_[0.9, rest, 2.5 * 2.0 ** -24 * 0.9]
    assert (geometry.floored(eig, geometry.spectral_floor(eig)) > 0).sum() == 2048
    assert geometry.spectral_floor(eig) == 64 * 2.0 ** -24 * 0.9
    assert geometry.spectral_floor(eig, bf16_mean_sq=0.1) == 2.0 ** -18 * 0.9  # lambda_1 the larger
    assert geometry.spectral_floor(eig, bf16_mean_sq=50.0) == 2.0 ** -18 * 50.0  # a mean that dwarfs the spread
    assert geometry.spectral_floor(np.zeros(3)) == 0.0
