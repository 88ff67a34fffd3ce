"""svcca (Raghu et al. 2017: each state's centered points reduced by SVD to the top directions that explain
99% of the variance, then the mean canonical correlation; isojax: the first 2048 sampled tokens) as
sample_metrics reads it out of the sample, against a full SVD then CCA by Cholesky whitening of the
covariances (float64 numpy/scipy) on Hugging Face states of random checkpoints of two families."""

import numpy as np
import pytest
from measure_cases import FAMILIES, alone, hf_points
from test_measure_block_influence import sampled
from scipy.linalg import cholesky, solve_triangular, svdvals


def reference(x, y, kept=0.99) -> float | None:
    def reduced(z):
        z = z - z.mean(0)
        u, s, _ = np.linalg.svd(z, full_matrices=False)
        k = int(np.searchsorted(np.cumsum(s ** 2) / np.sum(s ** 2), kept) + 1)  # the fewest reaching 99%
        return u[:, :k] * s[:k]

    x, y = (np.asarray(z, np.float64)[:2048] for z in (x, y))
    if not (np.ptp(x, axis=0).any() and np.ptp(y, axis=0).any()):
        return None
    a, b = reduced(x), reduced(y)
    if a.shape[1] + b.shape[1] >= len(a):
        return None
    cov = np.cov(np.hstack([a, b]).T)
    ka = a.shape[1]
    la, lb = cholesky(cov[:ka, :ka], lower=True), cholesky(cov[ka:, ka:], lower=True)
    whitened = solve_triangular(lb, solve_triangular(la, cov[:ka, ka:], lower=True).T, lower=True)
    return float(np.mean(svdvals(whitened)[:min(ka, b.shape[1])]))


@pytest.mark.parametrize("family", FAMILIES)
def test_svcca_equals_svd_then_cca_on_hugging_face_states(family):
    x = hf_points(family)
    got = [m["svcca"] for m in sampled(x, ("svcca",), host=family == "gpt_neox")]  # numpy; jitted
    assert got[0] is None  # embed: no state before it
    for i in range(1, len(x)):
        want = reference(x[i - 1], x[i])
        assert want is not None and got[i] == pytest.approx(want, rel=1e-8, abs=1e-10), i


@pytest.mark.parametrize("host", [True, False])
def test_svcca_of_a_rotated_copy_unrelated_points_and_where_undefined(host):
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(300, 6)) * np.arange(1, 7)).astype(np.float32)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0].astype(np.float32)
    assert alone("svcca", x, 3.0 * x @ rotation + 1.0, host=host) == pytest.approx(1.0, abs=1e-6)
    other = rng.normal(size=(300, 6)).astype(np.float32)
    assert alone("svcca", x, other, host=host) == pytest.approx(reference(x, other), rel=1e-8)
    # 4 points in 6 dimensions: the two subspaces meet by counting alone; a state that does not vary
    assert alone("svcca", x[:4], other[:4], host=host) is None and reference(x[:4], other[:4]) is None
    assert alone("svcca", x, np.full_like(x, 0.5), host=host) is None


def test_svcca_takes_the_first_2048_sampled_tokens():
    """Its cost grows as min(K, D)^3: the tokens after the first 2048 of the (random) sample do not count."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=(2, 2100, 3)).astype(np.float32)
    x[1] += 0.5 * x[0]
    got = alone("svcca", *x)
    x[1, 2048:] = rng.normal(size=(52, 3))
    assert alone("svcca", *x) == got == pytest.approx(reference(*x), rel=1e-8)


@pytest.mark.parametrize("host", [True, False])
def test_svcca_of_bfloat16_points_is_that_of_the_rounded_points(host):
    """A bf16 run keeps its sample in bf16: read out in float64 from the rounded points."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, 6)).astype(ml_dtypes.bfloat16)
    y = (x.astype(np.float32) + rng.normal(size=(300, 6))).astype(ml_dtypes.bfloat16)
    want = reference(x.astype(np.float64), y.astype(np.float64))
    assert alone("svcca", x, y, host=host) == pytest.approx(want, rel=1e-8, abs=1e-10)
