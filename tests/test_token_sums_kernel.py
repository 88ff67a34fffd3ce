"""bench/token_sums_kernel.py (issue 13's per-token kernel, slower than the XLA path on an H100
and so not in the step: bench/RESULTS.md 10k) against float64 and against stats' XLA path. On CPU
the kernel runs in Pallas' interpret mode; the GPU test compiles it (Triton)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax import stats
from isojax.options import StatsOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import token_sums_kernel as token_kernel  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def _batch(rng, n, d, v, dtype):
    """Ids with a few hot tokens (runs longer than a chunk and than a block of sorted rows), rare
    ones, ids past the vocabulary of the accumulators (another device's: skipped), zero rows, and
    invalid rows holding NaN and inf (never read)."""
    ids = np.where(rng.random(n) < 0.4, rng.integers(0, 3, n), rng.integers(0, v + 5, n)).astype(np.int32)
    x = (rng.normal(size=(n, d)) + 0.3).astype(np.float32)
    x[rng.random(n) < 0.02] = 0.0
    valid = rng.random(n) > 0.1
    x[~valid] = np.where(rng.random((int((~valid).sum()), d)) < 0.5, np.nan, np.inf)
    return jnp.asarray(x, dtype), ids, valid


def _expected(hi0, lo0, s, x, ids, valid):
    """Float64: the accumulators plus each token's sum of unit vectors (ids < V, valid rows)."""
    want = np.asarray(hi0, np.float64) + np.asarray(lo0, np.float64)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    v = want.shape[1]
    for i in np.flatnonzero(valid & (ids < v)):
        norm = np.linalg.norm(x64[i])
        if norm > 0:
            want[s, ids[i]] += x64[i] / norm
    return want


def _norms(x, valid):
    xf = jnp.where(jnp.asarray(valid)[:, None], jnp.asarray(x, jnp.float32), 0.0)
    return jnp.sqrt(jnp.sum(xf * xf, axis=1))


@pytest.mark.parametrize("n,d,rows,cols,dtype", [(1000, 64, 64, 256, jnp.bfloat16), (777, 48, 32, 16, jnp.float32),
                                                 (512, 256, 16, 64, jnp.bfloat16)])
def test_kernel_adds_each_tokens_unit_sum_in_place(n, d, rows, cols, dtype):
    """Against float64, on accumulators far larger than what is added (2^20: float32 alone would drop
    the sums' low bits; the TwoSum keeps them in lo), state 1 of 3; the other states untouched."""
    rng = np.random.default_rng(n)
    s, v = 1, 61
    x, ids, valid = _batch(rng, n, d, v, dtype)
    index = stats.index_tokens(jnp.asarray(ids), jnp.asarray(valid), v)
    hi0 = jnp.asarray(2.0 ** 20 + rng.integers(0, 8, (3, v, d)), jnp.float32)
    lo0 = jnp.asarray(rng.normal(size=(3, v, d)) * 1e-3, jnp.float32)
    p = token_kernel.plan(index.starts_N, index.rank_N, index.uniq_U, rows)
    assert int(p.used_P.sum()) > 2  # segments cross blocks: the merge is exercised
    hi, lo = token_kernel.add_token_sums(hi0, lo0, s, x, _norms(x, valid), index.order_N, index.rank_N,
                                         index.uniq_U, p, rows=rows, cols=cols)
    got = np.asarray(hi, np.float64) + np.asarray(lo, np.float64)
    want = _expected(hi0, lo0, s, x, ids, valid)
    # float32 sums of at most n unit-vector components: n * 2^-24 absolute; float32 alone: 2^-4
    np.testing.assert_allclose(got, want, rtol=0, atol=n * 2.0 ** -24)
    np.testing.assert_array_equal(np.asarray(hi)[[0, 2]], np.asarray(hi0)[[0, 2]])
    np.testing.assert_array_equal(np.asarray(lo)[[0, 2]], np.asarray(lo0)[[0, 2]])
    assert np.abs(np.asarray(hi) - np.asarray(hi0)).max() > 0  # something was added


def test_plan():
    ids = jnp.asarray([5, 3, 5, 9, 3, 3, 1], jnp.int32)
    index = stats.index_tokens(ids, jnp.ones(7, bool), 10)
    # sorted: 1 | 3 3 3 | 5 5 | 9 in blocks of 2: [1 3] [3 3] [5 5] [9]; past the last segment: 7
    p = token_kernel.plan(index.starts_N, index.rank_N, index.uniq_U, rows=2)
    np.testing.assert_array_equal(p.starts_U1, [0, 1, 4, 6, 7, 7, 7, 7])
    # token 3's run crosses blocks 0 and 1 (block 0's last, block 1's first); the rest lie inside a block
    np.testing.assert_array_equal(p.used_P, [False, True, True, False, False, False, False, False])
    np.testing.assert_array_equal(p.merged_P[1:3], [0, 0])
    assert p.token_P[0] == 3 and (p.token_P[1:] >= 10).all()


def test_columns_and_applies():
    assert token_kernel.columns(2048) == 256 and token_kernel.columns(768) == 256 and token_kernel.columns(48) == 16
    assert token_kernel.applies(16) and not token_kernel.applies(40)


def test_kernel_equals_the_xla_path():
    """The same batch through stats._update_tokens (XLA's path) and the kernel: equal within float32
    rounding of the sums; both within it of float64."""
    rng = np.random.default_rng(3)
    n, d, v = 4096, 32, 50
    x, ids, valid = _batch(rng, n, d, v, jnp.bfloat16)
    ids = np.minimum(ids, v - 1)
    index = stats.index_tokens(jnp.asarray(ids), jnp.asarray(valid), v)
    norm = _norms(x, valid)
    xf = jnp.where(jnp.asarray(valid)[:, None], x.astype(jnp.float32), 0.0)
    unit = xf / jnp.where(norm > 0, norm, 1.0)[:, None]
    acc = stats._update_tokens(stats.init_accumulators(2, d, v), 1, unit, index, StatsOptions(segment_sum="scatter"))
    p = token_kernel.plan(index.starts_N, index.rank_N, index.uniq_U)
    zeros = jnp.zeros((2, v, d), jnp.float32)
    hi, lo = token_kernel.add_token_sums(zeros, zeros, 1, x, norm, index.order_N, index.rank_N, index.uniq_U, p)
    got = np.asarray(hi, np.float64) + np.asarray(lo, np.float64)
    xla = np.asarray(acc.tok_sum_SxVxD.hi, np.float64) + np.asarray(acc.tok_sum_SxVxD.lo, np.float64)
    want = _expected(zeros, zeros, 1, x, ids, valid)
    np.testing.assert_allclose(got, xla, rtol=0, atol=n * 2.0 ** -24)
    np.testing.assert_allclose(got, want, rtol=0, atol=n * 2.0 ** -24)
    np.testing.assert_allclose(xla, want, rtol=0, atol=n * 2.0 ** -24)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiles the Triton kernel: needs a GPU")
def test_compiled_kernel_at_pythia_1_4b_width():
    rng = np.random.default_rng(7)
    n, d, v = 8192, 2048, 1000
    x, ids, valid = _batch(rng, n, d, v, jnp.bfloat16)
    index = stats.index_tokens(jnp.asarray(ids), jnp.asarray(valid), v)
    hi0 = jnp.asarray(rng.normal(size=(2, v, d)), jnp.float32)
    lo0 = jnp.zeros_like(hi0)
    p = token_kernel.plan(index.starts_N, index.rank_N, index.uniq_U)
    hi, lo = token_kernel.add_token_sums(hi0, lo0, 0, x, _norms(x, valid), index.order_N, index.rank_N,
                                         index.uniq_U, p)
    got = np.asarray(hi, np.float64) + np.asarray(lo, np.float64)
    np.testing.assert_allclose(got, _expected(hi0, lo0, 0, x, ids, valid), rtol=0, atol=n * 2.0 ** -24)
