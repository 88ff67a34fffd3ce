"""isojax.stats.intrinsic's certified neighbour search against a float64 brute force (no skdim
needed): the same k distances on fresh random inputs, ties, duplicates, and inputs where the
certificate must fail and the re-search or the exhaustive search must run."""

from __future__ import annotations

import numpy as np
import pytest

from isojax.stats import intrinsic


def _reference(x32, k):
    """The k smallest ||x_i - x_j|| (j != i) of the float32 points, in float64, ascending."""
    x = x32.astype(np.float64)
    d2 = np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=2)
    np.fill_diagonal(d2, np.inf)
    return np.sqrt(np.sort(d2, axis=1)[:, :k])


def _search(x32, k, **blocks):
    fallback: list = []
    got = intrinsic.knn_distances(x32, k, fallback=fallback, **blocks)
    np.testing.assert_allclose(got, _reference(x32, k), rtol=1e-5, atol=0)
    return fallback[0]


def _orthonormal(rng, d, big_d):
    q, _ = np.linalg.qr(rng.normal(size=(big_d, d)))
    return q.T


@pytest.mark.parametrize("n, d, k, query_block, point_block", [
    pytest.param(1000, 64, 20, 256, 300, marks=pytest.mark.slow),  # many blocks, N a multiple of neither
    (777, 33, 5, 128, 200),
    (301, 3, 2, 2048, 16384),  # one block of each, padded
    (50, 8, 49, 2048, 16384),  # k = N - 1: every other point is a candidate
])
def test_random_points(n, d, k, query_block, point_block):
    rng = np.random.default_rng(n + d)
    x32 = (rng.normal(size=(n, d)) * np.logspace(0, -1, d) + 5.0).astype(np.float32)
    assert _search(x32, k, query_block=query_block, point_block=point_block) == (0, 0)


@pytest.mark.slow
def test_duplicates_and_ties():
    rng = np.random.default_rng(1)
    # a 10 x 10 x 10 integer grid turned into 32 dims: each point has up to 6 neighbours at
    # distance 1 and 12 at sqrt(2), equal up to the rounding of the rotation
    grid = np.stack(np.meshgrid(*[np.arange(10)] * 3), axis=-1).reshape(-1, 3)
    x32 = (grid @ _orthonormal(rng, 3, 32)).astype(np.float32)
    x32[:40] = x32[40:80]  # 40 pairs of identical points
    x32[100:110] = x32[99]  # 11 copies of one point
    _search(x32, 20, query_block=256, point_block=384)
    got = intrinsic.knn_distances(x32, 20)
    assert np.all(got[:80, 0] == 0) and np.all(got[99:110, :10] == 0)


@pytest.mark.slow
def test_tight_group_is_searched_again():
    """60 near-copies (1e-4 apart) inside a Gaussian cloud: their k + SPARE candidates are all
    in the group, closer together than the certificate can resolve; k + 4 SPARE reach outside."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2000, 8))
    x[:60] = x[0] + 1e-4 * rng.normal(size=(60, 8))
    again, exhaustive = _search(x.astype(np.float32), 5, query_block=512, point_block=640)
    assert again >= 60 and exhaustive == 0


@pytest.mark.slow
def test_far_tight_clusters_are_searched_exhaustively():
    """Two clusters 2,000 apart, each 1e-3 wide: after centring every norm is ~1e3 and every
    neighbour distance ~1e-3, past any float32 Gram product; every row takes the exhaustive
    path, and the distances are still the exact ones."""
    rng = np.random.default_rng(3)
    x = 1e-3 * rng.normal(size=(301, 16))
    x[:151, 0] += 1e3
    x[151:, 0] -= 1e3
    assert _search(x.astype(np.float32), 10) == (301, 301)
    assert _search(x.astype(np.float32), 2, query_block=64, point_block=128) == (301, 301)
