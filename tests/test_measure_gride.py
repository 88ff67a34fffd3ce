"""gride (Denti et al. 2022's GRIDE intrinsic dimension at the neighbour ranks n2 = 2, 4, ..., 64, as dadapy
0.3.4's Data.remove_identical_points() then return_id_scaling_gride(range_max=64) compute it) as
sample_metrics reads it out of the sample: against dadapy's own numbers on fixed points, and against
dadapy's algorithm written out below in float64 numpy (scipy's cdist, an exhaustive sort, np.unique,
np.percentile, dadapy's bisection) on Hugging Face states of random checkpoints of two families. dadapy
itself pins numpy < 2 and jax 0.4.30, so it cannot be installed beside isojax: its numbers were computed
once in a separate environment (DADAPY below)."""

import numpy as np
import pytest
from measure_cases import FAMILIES, hf_points
from scipy.spatial.distance import cdist
from test_measure_block_influence import sampled

from isojax.stats import measures
from isojax.stats.measures import gride

RANKS = [2, 4, 8, 16, 32, 64]


def reference(x, n_max=2048) -> list[float | None]:
    """dadapy's GRIDE (id_estimation.return_id_scaling_gride, utils._filter_mus, _argmax_loglik,
    _neg_dloglik_did at their defaults) of the distinct points among the first n_max; None where fewer
    than half are distinct or at most n2 (README)."""
    x = np.asarray(x, np.float64)[:n_max]
    pts = np.unique(x, axis=0)  # dadapy's remove_identical_points
    if 2 * len(pts) < len(x):
        return [None] * len(RANKS)
    r = np.sort(cdist(pts, pts), axis=1)  # column 0: the point itself
    r[:, 1:] = np.maximum(r[:, 1:], np.finfo(np.float64).eps)  # remove_zero_dists
    out = []
    for n2 in RANKS:
        if len(pts) <= n2:
            out.append(None)
            continue
        n1 = n2 // 2
        mus = r[:, n2] / r[:, n1]
        mus[mus == 1] += 10 * np.finfo(np.float64).eps
        q3, q2 = np.percentile(mus, [95, 50])
        mus = mus[mus < 20 * (q3 - q2) + q2]

        def slope(d):
            one_m = 1.0 - mus ** (-d)
            one_m[one_m < 2e-7] = 2e-7
            return np.sum(((1 - n2 + n1) / one_m + n2 - 1.0) * np.log(mus)) - (len(mus) - 1) / d

        d0, d1 = 0.001, 1000.0
        l1 = slope(d1)
        while abs(d0 - d1) > 1e-7:
            d2 = (d0 + d1) / 2.0
            if slope(d2) * l1 > 0:
                d1 = d2
            else:
                d0 = d2
        out.append((d0 + d1) / 2.0)
    return out


def gride_of(x, host: bool) -> dict:
    """The measure alone on one state's points x, as the registry writes it: numpy, or jitted (x64)."""
    import jax
    with jax.enable_x64(True):
        value = (gride.readout(x) if host else jax.jit(gride.readout)(jax.numpy.asarray(x)))["gride"]
    return measures.sample_values({"gride": value})["gride"]


def points() -> np.ndarray:
    """700 float32 points near a 6-dimensional plane in 40 dimensions, the last 50 repeating the first 50."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(700, 6)) @ rng.normal(size=(6, 40)) + 0.05 * rng.normal(size=(700, 40))).astype(np.float32)
    x[650:] = x[:50]
    return x


# dadapy 0.3.4 (numpy 1.26.4, scikit-learn's distances): Data(points().astype(float64)),
# remove_identical_points() (it kept 650), return_id_scaling_gride(range_max=64, return_ranks=True)
DADAPY = [6.484307231538841, 5.975618709688627, 6.007010768319102, 5.6313561881138305, 5.343896777999151,
          5.102889130317403]


@pytest.mark.parametrize("host", [True, False])
def test_gride_equals_dadapy_on_fixed_points_with_repeats(host):
    x = points()
    got = gride_of(x, host)
    assert list(got) == [str(k) for k in RANKS]
    assert list(got.values()) == pytest.approx(DADAPY, abs=1e-9)
    assert reference(x) == pytest.approx(DADAPY, abs=1e-9)  # the algorithm below is dadapy's


@pytest.mark.parametrize("family", FAMILIES)
def test_gride_equals_dadapys_algorithm_on_hugging_face_states(family, capsys):
    x = hf_points(family)
    got = [m["gride"] for m in sampled(x, ("gride",), host=family == "gpt_neox")]  # numpy; jitted
    for i, state in enumerate(x):
        want = reference(state)
        if i == 0 and family == "gpt_neox":  # the embedding of 40 token ids: 40 distinct points of 1,024
            assert want == [None] * len(RANKS) and list(got[0].values()) == want
            assert "gride of s0: null" in capsys.readouterr().err
            continue
        assert all(w is not None and 0.001 < w < 1000 for w in want), (i, want)
        # the bisection's last step may go either way on a rounding of the distances: 1e-7 apart at most
        assert list(got[i].values()) == pytest.approx(want, abs=2e-7), i


@pytest.mark.parametrize("host", [True, False])
def test_gride_is_null_at_scales_past_the_kept_points_and_takes_the_first_2048_tokens(host):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 2100, 3)).astype(np.float32)
    x[1, :2048:2] = x[1, 1:2048:2]  # the second state: half its first 2048 points repeat another
    x[1, 1] = rng.normal(size=3)  # one more distinct: just over half kept
    first, second = gride_of(x[0], host), gride_of(x[1], host)
    assert list(first.values()) == pytest.approx(reference(x[0]), abs=2e-7)
    assert list(second.values()) == pytest.approx(reference(x[1]), abs=2e-7)
    x[0, 2048:] = 0.0  # the tokens past 2048 do not count
    assert gride_of(x[0], host) == first
    few = gride_of(x[0, :20], host)
    assert [few[str(k)] is None for k in RANKS] == [False] * 4 + [True] * 2  # 19 other points: n2 <= 16 only
    assert list(few.values())[:4] == pytest.approx(reference(x[0, :20])[:4], abs=2e-7)


@pytest.mark.parametrize("host", [True, False])
def test_gride_of_bfloat16_points_is_that_of_the_rounded_points(host):
    """A bf16 run keeps its sample in bf16: read out in float64 from the rounded points."""
    import ml_dtypes
    x = points().astype(ml_dtypes.bfloat16)
    assert list(gride_of(x, host).values()) == pytest.approx(reference(x.astype(np.float64)), abs=2e-7)
