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
from isojax.stats import measures

SAMPLE = "sample_states"  # the sample's step measure (isojax/stats/measures/sample_states.py)


def _keys(seq_N, pos_N, valid_N):
    return np.asarray(jax.jit(sample.token_keys)(jnp.asarray(seq_N), jnp.asarray(pos_N), jnp.asarray(valid_N)))


def _init(s, d, k, dtype="float32"):
    """Accumulators without token stats keeping a sample of k tokens (its step measure, sample_states) of the
    forward's dtype."""
    acc = stats.init_accumulators(s, d)
    return acc.replace(step=measures.init_sums(((SAMPLE, k),), 1, s, 0, d, dtype)[1])


def _feed(acc, x_SxNxD, seq_N, pos_N, valid_N, batch):
    k = acc.step[0].keys_Kx2.shape[0]
    update = jax.jit(functools.partial(stats.update, observe=measures.observer(((SAMPLE, k),)),
                                       plan=measures.batch_planner(((SAMPLE, k),))))
    for start in range(0, len(seq_N), batch):
        sl = slice(start, start + batch)
        acc = update(acc, x_SxNxD[:, sl], np.zeros(batch, np.int32), valid_N[sl], 0, None,
                     positions_N=pos_N[sl], sequences_N=seq_N[sl])
    return acc


def _sampled(acc):
    """The sample's states [S, K', D] in key order (empty slots dropped)."""
    sums = acc.step[0]
    part, slot = sample.merge_host(np.asarray(sums.keys_Kx2)[None])
    return np.asarray(sums.states_SxKxD)[:, slot]


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
    init = lambda: _init(s, d, k)
    for batch in (500, 1200, 6000):  # the first batch alone fills the sample at 1200 and 6000
        got = _sampled(_feed(init(), x, seq, pos, valid, batch))
        np.testing.assert_array_equal(got, want)
    # two halves seen separately, then merged: the same sample
    h = 3000
    first = _feed(init(), x[:, :h], seq[:h], pos[:h], valid[:h], 500)
    second = _feed(init(), x[:, h:], seq[h:], pos[h:], valid[h:], 500)
    merged = first.replace(step=(jax.jit(type(first.step[0]).merge)(first.step[0], second.step[0]),))
    np.testing.assert_array_equal(_sampled(merged), want)


def test_fewer_tokens_than_slots_keeps_them_all():
    rng = np.random.default_rng(1)
    n, d, k = 300, 4, 512
    seq, pos, valid = np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, bool)
    x = rng.normal(size=(1, n, d)).astype(np.float32)
    got = _sampled(_feed(_init(1, d, k), x, seq, pos, valid, 100))
    assert got.shape == (1, n, d)
    np.testing.assert_array_equal(np.sort(got[0, :, 0]), np.sort(x[0, :, 0]))


def test_the_sample_keeps_the_states_as_the_forward_made_them():
    """bfloat16 states (a bf16 forward's) are kept in bfloat16, bit for bit, whatever the statistics' float32
    copy holds (skipped positions: their rows never enter)."""
    rng = np.random.default_rng(3)
    n, d, k = 400, 8, 64
    seq, pos = np.repeat(np.arange(20), 20).astype(np.int32), np.tile(np.arange(20), 20).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(2, n, d)) * 1e3, jnp.bfloat16)
    valid = pos >= 1  # as skip_positions 1 leaves them out
    keys = _keys(seq, pos, valid)
    want = np.asarray(x)[:, np.lexsort((keys[:, 1], keys[:, 0]))[:k]]
    got = _sampled(_feed(_init(2, d, k, jnp.bfloat16), x, seq, pos, valid, 100))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


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


def test_a_checkpoint_written_before_the_sample_was_a_step_measure_resumes_exactly(tmp_path):
    """A checkpoint of main before the sample became a step measure (b4b826b: the accumulators' fields
    sample_keys_Kx2 and sample_SxKxD, token_norms' sums at step 0) resumes (loop.resume reads its leaves
    under their older names, Runner.older_leaf) and ends with the sample, its keys and token_norms' sums
    of one uninterrupted pass, bit for bit."""
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner
    from test_streamed_measures import _runner_batches, checkpoint_by_older_code

    loaded, mesh, batches = _runner_batches(tmp_path)
    on = (("massive_activations", 1), ("position_bands", 1), ("token_norms", 1))
    kw = dict(token_stats=True, num_groups=1, sample_size=8, skip_positions=1, step_measures=on)
    checkpoint_by_older_code(tmp_path, "b4b826b", batches, f"**{kw!r}", "runner.acc.sample_keys_Kx2.shape == (1, 8, 2)")
    resumed, whole = make_runner(loaded, mesh, **kw), make_runner(loaded, mesh, **kw)
    assert resume(resumed, tmp_path / "checkpoint", {"skip_positions": 1}, {})[0] == 2
    for r, part in ((resumed, batches[2:]), (whole, batches)):
        for tokens, seg, pos, seq in part:
            r.step(tokens, seg, pos, 0, seq)
    np.testing.assert_array_equal(resumed.sample_keys(), whole.sample_keys())
    (k, a), (_, b) = resumed.sample(), whole.sample()
    assert k == 8
    for s in range(loaded.config.num_states):
        np.testing.assert_array_equal(np.asarray(a(s)), np.asarray(b(s)))
    np.testing.assert_array_equal(resumed.step_sums()["token_norms"], whole.step_sums()["token_norms"])
