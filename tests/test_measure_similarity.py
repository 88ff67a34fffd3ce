"""The similarity of consecutive states on the sample beyond linear CKA: cka_debiased (Song et al. 2012's
unbiased HSIC of the linear Grams, Nguyen et al. 2021), procrustes_distance (Ding et al. 2021) and svcca
(Raghu et al. 2017, 99% of the variance) as sample_metrics reads them out of the sample, against float64
numpy/scipy written from the papers' formulas on the same points: the n x n Grams with a zero diagonal,
scipy's orthogonal_procrustes and the residual it leaves, a full SVD then CCA by Cholesky whitening of the
covariances. Hugging Face states of random checkpoints of two families (tests/measure_cases.py)."""

import numpy as np
import pytest
from measure_cases import FAMILIES, hf_points
from scipy.linalg import cholesky, orthogonal_procrustes, solve_triangular, svdvals
from test_measure_block_influence import sampled

from isojax.stats import measures

KEYS = ("cka_debiased", "procrustes_distance", "svcca")


def similarities(x, y, host: bool) -> dict:
    """The three measures alone on two states' points, as the registry writes them: numpy, or jitted (x64)."""
    import jax
    pending = {}
    with jax.enable_x64(True):
        for key in KEYS:
            readout = measures.MEASURES[key].readout
            pending.update(readout(x, y) if host else jax.jit(readout)(jax.numpy.asarray(x), jax.numpy.asarray(y)))
    return {key: measures.sample_values(pending)[key] for key in KEYS}


def cka_debiased(x, y) -> float:
    n = len(x)

    def hsic(k, l):
        k, l = k - np.diag(np.diag(k)), l - np.diag(np.diag(l))
        one = np.ones(n)
        return (np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * (one @ k @ l @ one)) / (n * (n - 3))

    k, l = x @ x.T, y @ y.T  # not centered: the estimator does not need it
    return hsic(k, l) / np.sqrt(hsic(k, k) * hsic(l, l))


def normalized(x):
    x = x - x.mean(0)
    return x / np.linalg.norm(x)


def procrustes_distance(x, y) -> float:
    x, y = normalized(x[:2048]), normalized(y[:2048])
    q, _ = orthogonal_procrustes(x, y)
    return float(np.sum((x @ q - y) ** 2))


def svcca(x, y, kept=0.99) -> float | None:
    def reduced(z):
        z = z - z.mean(0)
        u, s, _ = np.linalg.svd(z, full_matrices=False)
        k = int(np.searchsorted(np.cumsum(s ** 2) / np.sum(s ** 2), kept) + 1)  # the fewest reaching 99%
        return u[:, :k] * s[:k]

    a, b = reduced(x[:2048]), reduced(y[:2048])
    if a.shape[1] + b.shape[1] >= len(a):
        return None
    cov = np.cov(np.hstack([a, b]).T)
    ka = a.shape[1]
    la, lb = cholesky(cov[:ka, :ka], lower=True), cholesky(cov[ka:, ka:], lower=True)
    whitened = solve_triangular(lb, solve_triangular(la, cov[:ka, ka:], lower=True).T, lower=True)
    return float(np.mean(svdvals(whitened)[:min(ka, b.shape[1])]))


REFERENCES = {"cka_debiased": cka_debiased, "procrustes_distance": procrustes_distance, "svcca": svcca}


@pytest.mark.parametrize("family", FAMILIES)
def test_similarities_equal_the_papers_formulas_on_hugging_face_states(family):
    x = hf_points(family)
    got = sampled(x, KEYS, host=family == "gpt_neox")  # numpy on the host; jitted (the accelerators' way)
    assert all(v is None for v in got[0].values())  # embed: no state before it
    x64 = x.astype(np.float64)
    for i in range(1, len(x)):
        for key, reference in REFERENCES.items():
            want = reference(x64[i - 1], x64[i])
            assert want is not None and np.isfinite(want), (key, i)
            assert got[i][key] == pytest.approx(want, rel=1e-8, abs=1e-10), (key, i)


@pytest.mark.parametrize("host", [True, False])
def test_similarities_of_a_rotated_copy_unrelated_points_and_few_points(host):
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(300, 6)) * np.arange(1, 7)).astype(np.float32)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    rotated = similarities(x, 3.0 * x @ rotation.astype(np.float32) + 1.0, host)
    assert rotated["cka_debiased"] == pytest.approx(1.0, abs=1e-6)
    assert rotated["procrustes_distance"] == pytest.approx(0.0, abs=1e-6)
    assert rotated["svcca"] == pytest.approx(1.0, abs=1e-6)
    other = rng.normal(size=(300, 6)).astype(np.float32)
    unrelated = similarities(x, other, host)
    for key, reference in REFERENCES.items():
        assert unrelated[key] == pytest.approx(reference(x.astype(np.float64), other.astype(np.float64)),
                                               rel=1e-8, abs=1e-10), key
    assert abs(unrelated["cka_debiased"]) < 0.05  # debiased: near 0 for unrelated points
    # 3 points: no debiased estimate (n - 3 = 0); 4 wide points: SVCCA's subspaces meet by counting alone
    assert similarities(x[:3], other[:3], host)["cka_debiased"] is None
    assert similarities(x[:4], other[:4], host)["svcca"] is None


@pytest.mark.parametrize("host", [True, False])
def test_similarities_are_null_with_a_constant_state(host, capsys):
    x = np.random.default_rng(9).normal(size=(2, 40, 5)).astype(np.float32)
    x[1] = 0.5
    got = sampled(x, KEYS, host=host)[1]
    assert got == {key: None for key in KEYS}
    said = [line for line in capsys.readouterr().err.splitlines() if "of s1: null" in line]
    assert len(said) == 1 and all(key in said[0] for key in KEYS)


def test_procrustes_and_svcca_take_the_first_2048_sampled_tokens():
    """Their cost grows as min(K, D)^3: the tokens after the first 2048 of the (random) sample do not count."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=(2, 2100, 3)).astype(np.float32)
    x[1] += 0.5 * x[0]
    got = similarities(*x, host=True)
    x[1, 2048:] = rng.normal(size=(52, 3))
    again = similarities(*x, host=True)
    assert again["procrustes_distance"] == got["procrustes_distance"] and again["svcca"] == got["svcca"]
    assert again["cka_debiased"] != got["cka_debiased"]  # debiased CKA reads every sampled token
    x64 = x.astype(np.float64)
    for key, reference in REFERENCES.items():
        assert again[key] == pytest.approx(reference(x64[0], x64[1]), rel=1e-8, abs=1e-10), key
