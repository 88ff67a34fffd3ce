"""isojax.stats.intrinsic against scikit-dimension (the reference) on fresh random point clouds."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from isojax.stats import intrinsic
from isojax.errors import UserError
from conftest import need

skdim = need("skdim")
get_nn = need("skdim._commonfuncs").get_nn  # the neighbours skdim's local estimators use

N, D = 2000, 64
RTOL = 1e-3


def _orthonormal(rng, d, big_d):
    q, _ = np.linalg.qr(rng.normal(size=(big_d, d)))
    return q.T  # [d, D], orthonormal rows


def _subspace(rng):  # Gaussian on a 5-dim linear subspace of R^64, plus small noise
    return rng.normal(size=(N, 5)) @ _orthonormal(rng, 5, D) + 1e-3 * rng.normal(size=(N, D))


def _sphere(rng):  # unit 2-sphere, rotated into R^64
    s = rng.normal(size=(N, 3))
    return (s / np.linalg.norm(s, axis=1, keepdims=True)) @ _orthonormal(rng, 3, D)


def _anisotropic(rng):  # Gaussian with axis scales from 1 down to 1e-2
    return rng.normal(size=(N, D)) * np.logspace(0, -2, D)


def _swiss_roll(rng):  # D = 3: skdim's TwoNN takes its low-dimension (NearestNeighbors) branch
    t = 1.5 * np.pi * (1 + 2 * rng.uniform(size=N))
    h = 21 * rng.uniform(size=N)
    return np.stack([t * np.cos(t), h, t * np.sin(t)], axis=1)


KINDS = {"subspace": _subspace, "sphere": _sphere, "anisotropic": _anisotropic, "swiss_roll": _swiss_roll}


def _points(kind, seed):
    """The same points for both: float32 for isojax, their exact float64 values for skdim."""
    x32 = KINDS[kind](np.random.default_rng(seed)).astype(np.float32)
    return x32, x32.astype(np.float64)


def _close(ours, ref, rtol=RTOL):
    assert np.isfinite(ours)
    assert abs(ours / ref - 1) < rtol, (ours, ref, ours / ref - 1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_estimators_equal_skdim(kind):
    x32, x64 = _points(kind, seed=sorted(KINDS).index(kind))
    _close(intrinsic.twonn(x32), skdim.id.TwoNN().fit(x64).dimension_)
    _close(intrinsic.mle(x32), skdim.id.MLE().fit(x64).dimension_)  # k = 20 is skdim's default
    _close(intrinsic.mom(x32, k=20), skdim.id.MOM().fit(x64, n_neighbors=20).dimension_)


@pytest.mark.slow
def test_other_settings_equal_skdim():
    x32, x64 = _points("subspace", seed=7)
    _close(intrinsic.twonn(x32, discard_fraction=0.3), skdim.id.TwoNN(discard_fraction=0.3).fit(x64).dimension_)
    # f = 0: skdim raises (the largest ratio gets y = inf); isojax leaves that one ratio out,
    # which is skdim with any f that keeps N - 1 of N ratios.
    _close(intrinsic.twonn(x32, discard_fraction=0.0),
           skdim.id.TwoNN(discard_fraction=0.5 / N).fit(x64).dimension_)
    _close(intrinsic.mle(x32, k=5), skdim.id.MLE().fit(x64, n_neighbors=5).dimension_)
    _close(intrinsic.mom(x32, k=10), skdim.id.MOM().fit(x64, n_neighbors=10).dimension_)
    both = intrinsic.intrinsic_dimensions(x32, k=20)
    _close(both["twonn"], skdim.id.TwoNN().fit(x64).dimension_)
    _close(both["mle"], skdim.id.MLE().fit(x64).dimension_)


def test_jax_input_and_float64_offset():
    import jax.numpy as jnp

    x32, x64 = _points("sphere", seed=3)
    assert intrinsic.twonn(jnp.asarray(x32)) == intrinsic.twonn(x32)
    # float64 with a large common offset: float32 of the raw values would lose the neighbours.
    # D = 3, where skdim measures exact differences (k-d tree), not |x|^2 + |y|^2 - 2 x.y
    far = _points("swiss_roll", seed=4)[1] + 1e6
    _close(intrinsic.twonn(far), skdim.id.TwoNN().fit(far).dimension_)
    _close(intrinsic.mle(far), skdim.id.MLE().fit(far).dimension_)


@pytest.mark.parametrize("query_block, point_block", [(256, 512), (300, 700)])
def test_blocked_search_is_exact(query_block, point_block):
    """Many query and point blocks, ragged ends: the same k nearest as sklearn's search."""
    x32, x64 = _points("anisotropic", seed=11)
    ref, _ = get_nn(x64, k=20)
    ours = intrinsic.knn_distances(x32, 20, query_block=query_block, point_block=point_block)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_known_dimension():
    rng = np.random.default_rng(5)
    d = 3
    x = (rng.uniform(size=(N, d)) @ _orthonormal(rng, d, D)).astype(np.float32)
    for est in (intrinsic.twonn(x), intrinsic.mle(x), intrinsic.mom(x)):
        assert abs(est - d) < 0.15 * d, est


def test_duplicates():
    # D = 10: skdim then finds neighbours with exact distances (k-d tree), so a duplicate is at
    # distance 0. Above D = 15 (MLE, MoM) or 25 (TwoNN) it uses |x|^2 + |y|^2 - 2 x.y, which
    # puts some duplicates at ~1e-7 and keeps them: there its duplicate rule is not defined.
    rng = np.random.default_rng(13)
    x32 = (rng.normal(size=(N, 5)) @ _orthonormal(rng, 5, 10)).astype(np.float32)
    x32[:20] = x32[20:40]  # 20 pairs of identical points
    x64 = x32.astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skdim warns about the dropped duplicates as well
        ref_twonn = skdim.id.TwoNN().fit(x64).dimension_
        ref_mom = skdim.id.MOM().fit(x64, n_neighbors=20).dimension_
    with pytest.warns(UserWarning, match="twonn: dropped 40 of 2000 points"):
        _close(intrinsic.twonn(x32), ref_twonn)
    # skdim's MLE returns 0.0 here (an infinite term); isojax drops the points with r1 = 0,
    # which is skdim's MLE on the neighbour rows of the other points
    dist, idx = get_nn(x64, k=20)
    keep = dist[:, 0] > 0
    ref_mle = skdim.id.MLE().fit(x64, precomputed_knn_arrays=(dist[keep], idx[keep])).dimension_
    with pytest.warns(UserWarning, match="mle: dropped 40 of 2000 points"):
        _close(intrinsic.mle(x32), ref_mle)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skdim's MoM is finite with duplicates: no drop, no warning
        _close(intrinsic.mom(x32), ref_mom)

    # 13 copies of one point: with k = 10 their 10 distances are all 0 (skdim's MoM: NaN), and
    # a point whose 10 nearest are all these copies has 10 equal distances (skdim: -inf)
    x32[100:112] = x32[99]
    dist, idx = get_nn(x32.astype(np.float64), k=10)
    keep = dist[:, 0] < dist[:, -1]
    assert (~keep).sum() > 13
    ref = skdim.id.MOM().fit(x32, precomputed_knn_arrays=(dist[keep], idx[keep])).dimension_
    with pytest.warns(UserWarning, match=f"mom: dropped {(~keep).sum()} of 2000 points"):
        _close(intrinsic.mom(x32, k=10), ref)


@pytest.mark.parametrize("call, message", [
    (lambda: intrinsic.twonn(np.zeros(10)), "2-D"),
    (lambda: intrinsic.mle(np.zeros((4, 5, 6))), "2-D"),
    (lambda: intrinsic.twonn(np.array([["a", "b"]] * 5)), "real numbers"),
    (lambda: intrinsic.twonn(np.array([[0.0, np.nan]] + [[1.0, 2.0]] * 9)), "NaN or infinite"),
    (lambda: intrinsic.mle(np.array([[np.inf, 0.0]] + [[1.0, 2.0]] * 30)), "NaN or infinite"),
    (lambda: intrinsic.mle(np.random.default_rng(0).normal(size=(20, 3))), "more than k = 20 points"),
    (lambda: intrinsic.mom(np.random.default_rng(0).normal(size=(5, 3)), k=5), "more than k = 5 points"),
    (lambda: intrinsic.mle(np.random.default_rng(0).normal(size=(50, 3)), k=1), "k must be an integer >= 2"),
    (lambda: intrinsic.twonn(np.random.default_rng(0).normal(size=(2, 3))), "at least 3 points"),
    (lambda: intrinsic.twonn(np.random.default_rng(0).normal(size=(50, 3)), discard_fraction=1.0), r"\[0, 1\)"),
    (lambda: intrinsic.twonn(np.random.default_rng(0).normal(size=(50, 3)), discard_fraction=-0.1), r"\[0, 1\)"),
    (lambda: intrinsic.twonn(np.random.default_rng(0).normal(size=(50, 3)), discard_fraction=float("nan")), r"\[0, 1\)"),
    (lambda: intrinsic.twonn(np.random.default_rng(0).normal(size=(50, 3)), discard_fraction=0.99), "fewer than 2"),
    (lambda: intrinsic.twonn(np.ones((10, 3))), "every point was dropped"),
])
def test_bad_input(call, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UserError, match=message):
            call()


@pytest.mark.slow
def test_sample_metrics_logs_and_degenerate_layers(capsys):
    """extract --sample-states: a layer keeping fewer than half its points once duplicates are
    dropped (the embedding: a few token types repeated) gets null, and a log line names it; drops
    in the other layers are log lines naming their layer, not Python warnings; one batch of 4096
    says why anisotropy_batch_std is null."""
    import jax.numpy as jnp

    from isojax.stats.sample_readout import sample_metrics

    rng = np.random.default_rng(5)
    n = 4096
    embed = rng.normal(size=(4000, 16))[rng.integers(0, 4000, n)]  # ~36% of the rows drawn once
    block = rng.normal(size=(n, 16))
    block[:30] = block[30:60]  # 60 points with a duplicate
    states = [embed, block]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sample_metrics(lambda s: jnp.asarray(states[s], jnp.float32), n, ["embed", "block_1"], True)
    err = capsys.readouterr().err
    assert got[0]["intrinsic_dimension"] == {"twonn": None, "mle": None, "mom": None}
    assert "isojax: intrinsic dimension of embed: null (only" in err and "fewer than 50%" in err
    assert all(v is not None for v in got[1]["intrinsic_dimension"].values())
    assert ("isojax: intrinsic dimension of block_1: twonn and mle left out 60 of 4,096 points with a duplicate"
            in err)
    assert got[1]["anisotropy_batch_std"] is None and got[1]["anisotropy_batch_mean"] is not None
    assert err.count("anisotropy_batch_std is null: the sample of 4,096 tokens makes 1 batch") == 1
    # the rule is sample_metrics' own: intrinsic_dimensions alone keeps skdim's behaviour
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its drops warn, as skdim's do
        assert intrinsic.intrinsic_dimensions(embed, k=20)["twonn"] > 0
