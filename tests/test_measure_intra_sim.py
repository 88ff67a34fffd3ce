"""IntraSim's per-token sums as a step measure (isojax/stats/measures/intra_sim.py): a checkpoint written before
they were one resumes exactly. (Their values against float64 references: tests/test_stats.py, test_parallel.py.)"""

import numpy as np

MAIN_BEFORE = "9a499c9"  # main before the per-token sums became a step measure (after the sample and centered InterSim did)


def test_a_checkpoint_written_before_the_per_token_sums_were_a_step_measure_resumes_exactly(tmp_path):
    """A checkpoint of main before the per-token sums became a step measure (the accumulators' fields tok_count_SxV
    and tok_sum_SxVxD; the sample at step 0, token_norms' sums at step 1) resumes (loop.resume reads its leaves
    under their older names, Runner.older_leaf) and ends with the per-token counts, IntraSim, unit sums, the sample
    and token_norms' sums of one uninterrupted pass, bit for bit."""
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner
    from test_streamed_measures import _runner_batches, checkpoint_by_older_code

    loaded, mesh, batches = _runner_batches(tmp_path)
    on = (("massive_activations", 1), ("position_bands", 1), ("token_norms", 1))
    kw = dict(token_stats=True, num_groups=1, sample_size=8, skip_positions=1, step_measures=on)
    checkpoint_by_older_code(tmp_path, MAIN_BEFORE, batches, f"**{kw!r}", "runner.acc.tok_count_SxV.shape == (3, 512)")
    resumed, whole = make_runner(loaded, mesh, **kw), make_runner(loaded, mesh, **kw)
    assert resume(resumed, tmp_path / "checkpoint", {"skip_positions": 1}, {})[0] == 2
    for r, part in ((resumed, batches[2:]), (whole, batches)):
        for tokens, seg, pos, seq in part:
            r.step(tokens, seg, pos, 0, seq)
    (count_a, intra_a), (count_b, intra_b) = resumed.token_readout(), whole.token_readout()
    assert count_b.sum() > 0 and np.isfinite(intra_b).any()
    np.testing.assert_array_equal(count_a, count_b)
    np.testing.assert_array_equal(intra_a, intra_b)
    for s in range(loaded.config.num_states):
        np.testing.assert_array_equal(resumed.token_sums(s), whole.token_sums(s))
    np.testing.assert_array_equal(resumed.sample_keys(), whole.sample_keys())
    (k, a), (_, b) = resumed.sample(), whole.sample()
    for s in range(loaded.config.num_states):
        np.testing.assert_array_equal(np.asarray(a(s)), np.asarray(b(s)))
    np.testing.assert_array_equal(resumed.step_sums()["token_norms"], whole.step_sums()["token_norms"])
