"""The uniform sample (isojax.stats.sample) against a numpy reference: the K tokens of smallest key,
whatever the batching; merging halves; uniform over the corpus; and batch anisotropy against
numpy's SVD."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.stats import finalize as fz
from isojax.stats import sample_readout as sr
from isojax.stats import sample
from isojax.stats import accumulators as stats


def _keys(seq_N, pos_N, valid_N):
    return np.asarray(jax.jit(sample.token_keys)(jnp.asarray(seq_N), jnp.asarray(pos_N), jnp.asarray(valid_N)))


def _feed(acc, x_SxNxD, seq_N, pos_N, valid_N, batch):
    update = jax.jit(functools.partial(stats.update))
    for start in range(0, len(seq_N), batch):
        sl = slice(start, start + batch)
        acc = update(acc, x_SxNxD[:, sl], np.zeros(batch, np.int32), valid_N[sl], 0, None,
                     token_keys_Nx2=_keys(seq_N[sl], pos_N[sl], valid_N[sl]))
    return acc


def _sampled(acc):
    """The sample's states [S, K', D] in key order (empty slots dropped)."""
    part, slot = sample.merge_host(np.asarray(acc.sample_keys_Kx2)[None])
    return np.asarray(acc.sample_SxKxD)[:, slot]


def test_bottom_k_whatever_the_batching():
    rng = np.random.default_rng(0)
    s, n, d, k = 2, 6000, 8, 700
    seq = np.repeat(np.arange(200), 30).astype(np.int32)
    pos = np.tile(np.arange(30), 200).astype(np.int32)
    valid = rng.random(n) < 0.9
    x = rng.normal(size=(s, n, d)).astype(np.float32)
    x[:, ~valid] = np.nan  # padding never enters
    keys = _keys(seq, pos, valid)
    chosen = np.lexsort((keys[:, 1], keys[:, 0]))[:k]  # the reference: k smallest (hi, lo) keys
    assert valid[chosen].all()
    want = x[:, chosen]
    init = lambda: stats.init_accumulators(s, d, 0, token_stats=False, sample_size=k)
    for batch in (500, 1200, 6000):  # the first batch alone fills the sample at 1200 and 6000
        got = _sampled(_feed(init(), x, seq, pos, valid, batch))
        np.testing.assert_array_equal(got, want)
    # two halves seen separately, then merged: the same sample
    h = 3000
    first = _feed(init(), x[:, :h], seq[:h], pos[:h], valid[:h], 500)
    second = _feed(init(), x[:, h:], seq[h:], pos[h:], valid[h:], 500)
    np.testing.assert_array_equal(_sampled(jax.jit(stats.merge)(first, second)), want)


def test_fewer_tokens_than_slots_keeps_them_all():
    rng = np.random.default_rng(1)
    n, d, k = 300, 4, 512
    seq, pos, valid = np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, bool)
    x = rng.normal(size=(1, n, d)).astype(np.float32)
    got = _sampled(_feed(stats.init_accumulators(1, d, 0, token_stats=False, sample_size=k), x, seq, pos, valid, 100))
    assert got.shape == (1, n, d)
    np.testing.assert_array_equal(np.sort(got[0, :, 0]), np.sort(x[0, :, 0]))


def test_keys_are_uniform():
    """Positions of the sampled tokens in a 200k-token corpus: uniform (Kolmogorov-Smirnov
    distance to the uniform law well under its 1% critical value 1.63/sqrt(k))."""
    n, k = 200_000, 5000
    seq = (np.arange(n) // 512).astype(np.int32)
    pos = (np.arange(n) % 512).astype(np.int32)
    keys = _keys(seq, pos, np.ones(n, bool))
    chosen = np.sort(np.lexsort((keys[:, 1], keys[:, 0]))[:k]) / n
    ks = np.abs(chosen - (np.arange(1, k + 1) - 0.5) / k).max()
    assert ks < 1.63 / np.sqrt(k), ks
    assert len(np.unique(keys, axis=0)) == n  # no two tokens share a key


@pytest.mark.slow
def test_batch_anisotropy_against_svd():
    rng = np.random.default_rng(2)
    # anisotropic; near-isotropic with D > 64 Lanczos steps; wider than the batch (X X^T)
    for d, scale in ((48, np.logspace(0, -3, 48)), (700, np.ones(700)), (4500, np.logspace(0, -1, 4500))):
        x = (rng.normal(size=(2, 4096, d)) * scale + rng.normal(size=d)).astype(np.float32)
        with jax.enable_x64(True):
            got = np.asarray(sr._batch_anisotropy(x))
        for b in range(2):
            xb = x[b].astype(np.float64)
            for j, y in enumerate((xb - xb.mean(0), xb)):
                sv = np.linalg.svd(y, compute_uv=False)
                assert abs(got[b, j] - sv[0] ** 2 / (sv ** 2).sum()) < 1e-7 * got[b, j], (d, b, j)
