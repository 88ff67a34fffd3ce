"""IntraSim's per-token sums as a step measure (isojax/stats/measures/intra_sim.py): a checkpoint written before
they were one resumes exactly. (Their values against float64 references: tests/test_stats.py, test_parallel.py.)"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

MAIN_BEFORE = "9a499c9"  # main before the per-token sums became a step measure (after the sample and centered InterSim did)


def test_a_checkpoint_written_before_the_per_token_sums_were_a_step_measure_resumes_exactly(tmp_path):
    """A checkpoint of main before the per-token sums became a step measure (the accumulators' fields tok_count_SxV
    and tok_sum_SxVxD; the sample at step 0, token_norms' sums at step 1) resumes (loop.resume reads its leaves
    under their older names, Runner.older_leaf) and ends with the per-token counts, IntraSim, unit sums, the sample
    and token_norms' sums of one uninterrupted pass, bit for bit."""
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner
    from test_streamed_measures import _runner_batches

    repo = Path(__file__).resolve().parents[1]
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(["git", "archive", MAIN_BEFORE, "isojax"], cwd=repo, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    loaded, mesh, batches = _runner_batches(tmp_path)
    on = (("massive_activations", 1), ("position_bands", 1), ("token_norms", 1))
    kw = dict(token_stats=True, num_groups=1, sample_size=8, skip_positions=1, step_measures=on)
    np.savez(tmp_path / "batches.npz", *[a for batch in batches[:2] for a in batch])
    script = textwrap.dedent(f"""
        import numpy as np
        from isojax.device import checkpoints as checkpointing
        from isojax.device import mesh as parallel
        from isojax.hf.loading import load_model
        from isojax.run.measure import make_runner
        mesh = parallel.make_mesh({{"data": 1, "model": 1}})
        runner = make_runner(load_model({str(tmp_path / "ckpt")!r}, dtype="float32", mesh=mesh), mesh, **{kw!r})
        assert runner.acc.tok_count_SxV.shape == (3, 512)  # the older layout
        arrays = np.load({str(tmp_path / "batches.npz")!r})
        batches = [arrays[f"arr_{{i}}"] for i in range(len(arrays.files))]
        for k in range(0, len(batches), 4):
            runner.step(*batches[k:k + 3], 0, batches[k + 3])
        ckpt = checkpointing.Checkpointer({str(tmp_path / "checkpoint")!r})
        ckpt.save(2, runner.acc, {{"settings": {{"skip_positions": 1}}, "cursor": 2, "done": {{"tokens": 0}}}})
        ckpt.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(old), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
