"""Centered InterSim as the centered pass's step measure (stats/measures/centered_inter_sim.py): a --centered run's
first pass checkpointed by isojax before the move resumes exactly, and its second pass then reads out what one
uninterrupted run does. (Its values against float64: tests/test_stats.py, test_extract.py, test_readouts.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from test_streamed_measures import STREAMED_ON, _runner_batches

BEFORE = "8205f59"  # main before the move: centered InterSim's sums were the accumulators' field centered_sum_GxSxC


def test_a_checkpoint_written_before_the_move_resumes_and_the_centered_pass_reads_out_as_before(tmp_path):
    """The first pass's accumulators checkpointed by BEFORE's code after 2 of 4 batches (its centered_sum_GxSxC empty
    there: the first pass never holds centered sums, and empty leaves are not written; the second pass is not
    checkpointed) resume here under the same leaf names; the first pass's means and the centered pass after it
    (Runner.second_pass: its one step measure) are BEFORE's uninterrupted run's, bit for bit."""
    from isojax.device.runner import CENTERED
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner
    from isojax.stats.measures import centered_inter_sim

    repo = Path(__file__).resolve().parents[1]
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(["git", "archive", BEFORE, "isojax"], cwd=repo, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    loaded, mesh, batches = _runner_batches(tmp_path)
    kw = dict(token_stats=False, num_groups=1, skip_positions=1, step_measures=STREAMED_ON)
    settings = {"skip_positions": 1, "step_measures": dict(STREAMED_ON)}  # as run.measure records them
    np.savez(tmp_path / "batches.npz", *[a for batch in batches for a in batch])
    script = textwrap.dedent(f"""
        import numpy as np
        from isojax.device import checkpoints as checkpointing
        from isojax.device import mesh as parallel
        from isojax.hf.loading import load_model
        from isojax.run.measure import make_runner
        from isojax.stats.finalize import finalize
        mesh = parallel.make_mesh({{"data": 1, "model": 1}})
        runner = make_runner(load_model({str(tmp_path / "ckpt")!r}, dtype="float32", mesh=mesh), mesh, **{kw!r})
        assert runner.acc.centered_sum_GxSxC.hi.size == 0  # the older layout, its field empty in the first pass
        arrays = np.load({str(tmp_path / "batches.npz")!r})
        batches = [[arrays[f"arr_{{k + i}}"] for i in range(4)] for k in range(0, len(arrays.files), 4)]
        feed = lambda r, part: [r.step(*b[:3], 0, b[3]) for b in part]
        feed(runner, batches[:2])
        ckpt = checkpointing.Checkpointer({str(tmp_path / "checkpoint")!r})
        ckpt.save(2, runner.acc, {{"settings": {settings!r}, "cursor": 2, "done": {{"tokens": 0}}}})
        ckpt.close()
        feed(runner, batches[2:])
        means = runner.merged_layers().means()
        second = runner.second_pass(means, 1)
        feed(second, batches)
        names = [str(s) for s in range(len(means))]
        values = [layer["centered_inter_sim"] for layer in finalize(second.merged_layers(), names)["layers"]]
        np.savez({str(tmp_path / "before.npz")!r}, means=means, values=np.array(values))
    """)
    env = {**os.environ, "PYTHONPATH": str(old), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = np.load(tmp_path / "before.npz")

    resumed = make_runner(loaded, mesh, **kw)
    assert resume(resumed, tmp_path / "checkpoint", settings, {})[0] == 2
    for tokens, seg, pos, seq in batches[2:]:
        resumed.step(tokens, seg, pos, 0, seq)
    means = resumed.merged_layers().means()
    np.testing.assert_array_equal(means, before["means"])
    second = resumed.second_pass(means, 1)
    assert [name for name, _ in second.options.step_measures] == [CENTERED]
    for tokens, seg, pos, seq in batches:
        second.step(tokens, seg, pos, 0, seq)
    merged = second.merged_layers()
    values = [layer["centered_inter_sim"] for layer in
              centered_inter_sim.readout(second.step_sums(merged)[CENTERED], merged.layer_count())]
    assert np.isfinite(before["values"]).all() and 0 < np.abs(before["values"]).max() < 1
    np.testing.assert_array_equal(values, before["values"])
