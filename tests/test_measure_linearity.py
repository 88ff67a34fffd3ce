"""linearity (Razzhigaev et al. 2024, "Your Transformer is Secretly Linear": 1 - min_A ||X~ A - Y~||_F^2
of consecutive states centered and divided by their Frobenius norm) as sample_metrics reads it out of the
sample, against numpy's least squares (SVD, singular values under the README's floor cut: rcond
= sqrt(64 x 2^-24)) on the same points: Hugging Face states of random checkpoints of two families."""

import numpy as np
import pytest
from measure_cases import FAMILIES, hf_points
from test_measure_block_influence import sampled


def reference(x, y) -> float:
    x, y = x - x.mean(0), y - y.mean(0)
    x, y = x / np.linalg.norm(x), y / np.linalg.norm(y)
    a = np.linalg.lstsq(x, y, rcond=np.sqrt(64 * 2.0 ** -24))[0]
    return 1.0 - float(((x @ a - y) ** 2).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_linearity_equals_the_papers_least_squares_on_hugging_face_states(family):
    x = hf_points(family)
    got = sampled(x, host=family == "gpt_neox")  # numpy on the host; jitted (the accelerators' way)
    assert got[0]["linearity"] is None  # embed: no state before it
    x64 = x.astype(np.float64)
    for i in range(1, len(x)):
        want = reference(x64[i - 1], x64[i])
        assert 0.0 < want < 1.0
        assert got[i]["linearity"] == pytest.approx(want, rel=1e-9), i


@pytest.mark.parametrize("host", [True, False])
def test_linearity_from_fewer_tokens_than_dimensions_and_null_where_any_fit_is_exact(host):
    """K < D: the K x K Gram's path. X in a 5-dimensional subspace fits Y partly; X of full rank (K - 1
    centered directions) fits any Y exactly: null."""
    rng = np.random.default_rng(7)
    k, d = 20, 64
    x = (rng.normal(size=(k, 5)) @ rng.normal(size=(5, d))).astype(np.float32)
    y = (x @ rng.normal(size=(d, d)) * 0.1 + rng.normal(size=(k, d))).astype(np.float32)
    got = sampled(np.stack([x, y]), host=host)[1]["linearity"]
    assert got == pytest.approx(reference(x.astype(np.float64), y.astype(np.float64)), rel=1e-9)
    assert 0.0 < got < 1.0
    full = rng.normal(size=(k, d)).astype(np.float32)
    assert sampled(np.stack([full, y]), host=host)[1]["linearity"] is None
