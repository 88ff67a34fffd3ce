"""neighbourhood_overlap (Doimo et al. 2020; dadapy's return_data_overlap: mean over points of the shared
fraction of their k = 30 nearest neighbours in two representations; isojax: the first 2048 sampled tokens) as sample_metrics reads it out of the
sample, against an exhaustive float64 search (scipy's cdist, per-row intersections) on the same points:
Hugging Face states of random checkpoints of two families. dadapy itself pins numpy < 2 and jax 0.4.30:
not installable beside isojax."""

import numpy as np
import pytest
from measure_cases import FAMILIES, hf_points
from scipy.spatial.distance import cdist
from test_measure_block_influence import sampled


def reference(x, y, k=30) -> float | None:
    """Over the first 2048 points, those that equal no earlier point in either state, as the README
    says; None where fewer than half remain."""
    x, y = x[:2048], y[:2048]
    first_in_both = np.ones(len(x), bool)
    for z in (x, y):
        first = np.zeros(len(z), bool)
        first[np.unique(z, axis=0, return_index=True)[1]] = True  # the first of each group of equal rows
        first_in_both &= first
    keep = np.flatnonzero(first_in_both)
    if 2 * len(keep) < len(x):
        return None

    def nn(z):
        d = cdist(z[keep], z[keep])
        np.fill_diagonal(d, np.inf)
        return np.argsort(d, axis=1, kind="stable")[:, :k]
    a, b = nn(x), nn(y)
    return float(np.mean([len(np.intersect1d(p, q)) / k for p, q in zip(a, b)]))


@pytest.mark.parametrize("family", FAMILIES)
def test_neighbourhood_overlap_equals_an_exhaustive_search_on_hugging_face_states(family, capsys):
    x = hf_points(family)[:, :700]  # 700 tokens: two row blocks, the second partial
    # numpy on the host; jitted (the accelerators' way)
    got = [m["neighbourhood_overlap"] for m in sampled(x, ("neighbourhood_overlap",), host=family == "gpt_neox")]
    assert got[0] is None  # embed: no state before it
    x64 = x.astype(np.float64)
    for i in range(1, len(x)):
        want = reference(x64[i - 1], x64[i])
        if want is None:  # the embedding of 40 token ids repeats its points: null, and the log says so
            assert got[i] is None and i == 1, i
            assert "neighbourhood_overlap of s1: null" in capsys.readouterr().err
            continue
        assert 0.0 < want < 1.0
        assert got[i] == pytest.approx(want, abs=1e-12), i


@pytest.mark.parametrize("host", [True, False])
def test_neighbourhood_overlap_leaves_out_repeated_points(host):
    """Equal points (the same token in the same context) are left out of both states' neighbours."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 120, 6)).astype(np.float32)
    x[:, 100:] = x[:, :20]  # 20 repeats, in both states
    x[0, 90] = x[0, 5]  # and one in the first state only
    got = sampled(x, ("neighbourhood_overlap",), host=host)[1]["neighbourhood_overlap"]
    assert got == pytest.approx(reference(x[0].astype(np.float64), x[1].astype(np.float64)), abs=1e-12)
    assert got == pytest.approx(reference(np.delete(x[0], [90, *range(100, 120)], 0).astype(np.float64),
                                        np.delete(x[1], [90, *range(100, 120)], 0).astype(np.float64)), abs=1e-12)


def test_neighbourhood_overlap_of_a_state_with_itself_is_1_and_null_for_few_points():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(80, 6)).astype(np.float32)
    assert sampled(np.stack([x, x]), ("neighbourhood_overlap",))[1]["neighbourhood_overlap"] == 1.0
    assert sampled(np.stack([x[:30], x[:30]]), ("neighbourhood_overlap",))[1]["neighbourhood_overlap"] is None


def test_neighbourhood_overlap_takes_the_first_2048_sampled_tokens():
    """One density whatever K: the tokens after the first 2048 of the (randomly ordered) sample do not count."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 2100, 4)).astype(np.float32)
    got = sampled(x, ("neighbourhood_overlap",))[1]["neighbourhood_overlap"]
    x[1, 2048:] = rng.normal(size=(52, 4))
    assert sampled(x, ("neighbourhood_overlap",))[1]["neighbourhood_overlap"] == got
    assert got == pytest.approx(reference(*x.astype(np.float64)), abs=1e-12)
