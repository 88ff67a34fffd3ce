"""procrustes_distance (Ding et al. 2021: min over orthogonal Q of ||XQ - Y||_F^2 of the centered,
Frobenius-normalized points, 2 - 2 ||X^T Y||_*; isojax: the first 2048 sampled tokens) as sample_metrics
reads it out of the sample, against scipy's orthogonal_procrustes and the residual it leaves (float64) on
Hugging Face states of random checkpoints of two families."""

import numpy as np
import pytest
from measure_cases import FAMILIES, alone, hf_points
from test_measure_block_influence import sampled
from scipy.linalg import orthogonal_procrustes


def normalized(x):
    x = x - x.mean(0)
    return x / np.linalg.norm(x)


def reference(x, y) -> float | None:
    x, y = (np.asarray(z, np.float64)[:2048] for z in (x, y))
    if not (np.ptp(x, axis=0).any() and np.ptp(y, axis=0).any()):
        return None
    x, y = normalized(x), normalized(y)
    q, _ = orthogonal_procrustes(x, y)
    return float(np.sum((x @ q - y) ** 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_procrustes_distance_equals_scipys_on_hugging_face_states(family):
    x = hf_points(family)
    got = [m["procrustes_distance"] for m in sampled(x, ("procrustes_distance",), host=family == "gpt_neox")]
    assert got[0] is None  # embed: no state before it
    for i in range(1, len(x)):  # D < K (numpy: the D x D product) and jitted
        assert got[i] == pytest.approx(reference(x[i - 1], x[i]), rel=1e-8, abs=1e-10), i


@pytest.mark.parametrize("host", [True, False])
def test_procrustes_distance_of_a_rotated_copy_wide_points_and_a_constant_state(host):
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(300, 6)) * np.arange(1, 7)).astype(np.float32)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0].astype(np.float32)
    assert alone("procrustes_distance", x, 3.0 * x @ rotation + 1.0, host=host) == pytest.approx(0.0, abs=1e-6)
    wide, other = rng.normal(size=(2, 12, 20)).astype(np.float32)  # D > K: the QR factors' product
    assert alone("procrustes_distance", wide, other, host=host) == pytest.approx(reference(wide, other), rel=1e-8)
    assert alone("procrustes_distance", x, np.full_like(x, 0.5), host=host) is None


def test_procrustes_distance_takes_the_first_2048_sampled_tokens():
    """Its cost grows as min(K, D)^3: the tokens after the first 2048 of the (random) sample do not count."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=(2, 2100, 3)).astype(np.float32)
    x[1] += 0.5 * x[0]
    got = alone("procrustes_distance", *x)
    x[1, 2048:] = rng.normal(size=(52, 3))
    assert alone("procrustes_distance", *x) == got == pytest.approx(reference(*x), rel=1e-8)


@pytest.mark.parametrize("host", [True, False])
def test_procrustes_distance_of_bfloat16_points_is_that_of_the_rounded_points(host):
    """A bf16 run keeps its sample in bf16: read out in float64 from the rounded points."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, 6)).astype(ml_dtypes.bfloat16)
    y = (x.astype(np.float32) + rng.normal(size=(300, 6))).astype(ml_dtypes.bfloat16)
    want = reference(x.astype(np.float64), y.astype(np.float64))
    assert alone("procrustes_distance", x, y, host=host) == pytest.approx(want, rel=1e-8, abs=1e-10)
