"""cka_debiased (debiased linear CKA: Song et al. 2012's unbiased HSIC of the linear Grams, as Nguyen et al.
2021 and Kornblith's feature_space_linear_cka(debiased=True) use it) as sample_metrics reads it out of the
sample, against the estimator written out on the n x n Grams with a zero diagonal (float64 numpy, not
centered: the estimator does not need it), on Hugging Face states of random checkpoints of two families."""

import numpy as np
import pytest
from measure_cases import FAMILIES, alone, hf_points
from test_measure_block_influence import sampled


def reference(x, y) -> float | None:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    n = len(x)
    if n < 4 or not (np.ptp(x, axis=0).any() and np.ptp(y, axis=0).any()):  # a state that does not vary
        return None

    def hsic(k, l):
        k, l = k - np.diag(np.diag(k)), l - np.diag(np.diag(l))
        one = np.ones(n)
        return (np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * (one @ k @ l @ one)) / (n * (n - 3))

    k, l = x @ x.T, y @ y.T
    kk, ll = hsic(k, k), hsic(l, l)
    return None if kk <= 0 or ll <= 0 else float(hsic(k, l) / np.sqrt(kk * ll))


@pytest.mark.parametrize("family", FAMILIES)
def test_cka_debiased_equals_the_estimator_on_hugging_face_states(family):
    x = hf_points(family)
    got = [m["cka_debiased"] for m in sampled(x, ("cka_debiased",), host=family == "gpt_neox")]  # numpy; jitted
    assert got[0] is None  # embed: no state before it
    for i in range(1, len(x)):
        assert got[i] == pytest.approx(reference(x[i - 1], x[i]), rel=1e-8, abs=1e-10), i


@pytest.mark.parametrize("host", [True, False])
def test_cka_debiased_of_a_rotated_copy_unrelated_points_and_few_or_constant_points(host, capsys):
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(300, 6)) * np.arange(1, 7)).astype(np.float32)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0].astype(np.float32)
    assert alone("cka_debiased", x, 3.0 * x @ rotation + 1.0, host=host) == pytest.approx(1.0, abs=1e-6)
    other = rng.normal(size=(300, 6)).astype(np.float32)
    got = alone("cka_debiased", x, other, host=host)
    assert got == pytest.approx(reference(x, other), rel=1e-8, abs=1e-10) and abs(got) < 0.05  # near 0: unrelated
    assert alone("cka_debiased", x[:3], other[:3], host=host) is None  # n - 3 = 0: no estimate
    assert alone("cka_debiased", x, np.full_like(x, 0.5), host=host) is None  # a state that does not vary
    assert reference(x[:3], other[:3]) is None and reference(x, np.full_like(x, 0.5)) is None
    assert sampled(np.stack([x, np.full_like(x, 0.5)]), ("cka_debiased",), host=host)[1]["cka_debiased"] is None
    assert "cka_debiased" in [line for line in capsys.readouterr().err.splitlines() if "of s1: null" in line][0]


@pytest.mark.parametrize("host", [True, False])
def test_cka_debiased_of_bfloat16_points_is_that_of_the_rounded_points(host):
    """A bf16 run keeps its sample in bf16: read out in float64 from the rounded points."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, 6)).astype(ml_dtypes.bfloat16)
    y = (x.astype(np.float32) + rng.normal(size=(300, 6))).astype(ml_dtypes.bfloat16)
    want = reference(x.astype(np.float64), y.astype(np.float64))
    assert alone("cka_debiased", x, y, host=host) == pytest.approx(want, rel=1e-8, abs=1e-10)
