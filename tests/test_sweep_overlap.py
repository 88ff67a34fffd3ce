"""A sweep saves each step while the next one is measured (issue 47): the same files as the
sequential path, byte for byte; a kill while a step is saved beside the next one's loop resumes to
an uninterrupted sweep's results; an error in the saving names its step and leaves the steps
committed before it. Events the tests control order the threads (isojax.faults.hook), so no
verdict depends on the machine's speed; a timeout only ends a wait that a sequential sweep never ends."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import build_hf_checkpoint
from isojax import faults
from isojax.errors import UserError
from isojax.extract import main
from isojax.run import sweep
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120  # only a sweep that does not overlap waits this long, and then fails
REVISIONS = ("step0", "step1000", "step2000")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_overlap")
    for seed, rev in enumerate(REVISIONS):
        build_hf_checkpoint(root / "repo" / rev, seed=seed, vocab_size=50304, hidden_size=32, num_layers=1,
                            num_heads=2)
    write_pile_jsonl(root / "pile.jsonl", 40, seed=3)
    return root


def _args(inputs: Path, out: Path, *extra, plots: bool = False) -> list[str]:
    return ["--model", str(inputs / "repo"), "--revisions", ",".join(REVISIONS), "--data", str(inputs / "pile.jsonl"),
            "--seq-len", "64", "--batch-tokens", "512", "--sample-states", "64", "--out", str(out), *extra,
            *([] if plots else ["--no-plots"])]


def _files(out: Path) -> dict[str, bytes]:
    """Every file isojax wrote but those holding timings (manifest.json) or the record of the folder."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", ".isojax-results.json")}


def test_steps_saved_beside_the_next_steps_loop_equal_the_sequential_sweep(tmp_path, monkeypatch, inputs):
    """Each step's files are written while the next step loads and loops (its weights' read begins
    before the step's saving may go on), its figures drawn in a process of their own, and the files
    equal those of a sweep that saves each step before the next, figures drawn on a thread: metrics,
    layers.csv, samples.zarr, cka.json, the PNGs, sweep.csv, sweep_cka.json."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    reads, order, lock = [], [], threading.Lock()
    next_read = [threading.Event() for _ in REVISIONS]

    def weights_read():
        with lock:
            reads.append(len(reads))
            next_read[len(reads) - 1].set()
            order.append(f"read {len(reads)}")

    def saving():
        with lock:
            saved = sum(1 for e in order if e.startswith("saving"))
            order.append(f"saving {saved + 1}")
        if saved + 1 < len(REVISIONS):  # the last step has no next one to wait for
            assert next_read[saved + 1].wait(WAIT_S), "a step's saving waited for the next step's measurement"

    drawn_here = []  # figures drawn on a thread of this process (the sequential path's way)
    with faults.hook("weights_read", weights_read), faults.hook("sweep_saving", saving), \
            faults.hook("plots_drawing", lambda: drawn_here.append(1)):
        assert main(_args(inputs, tmp_path / "overlapped", plots=True)) == 0
    assert not drawn_here  # drawn in the figure process
    assert order[0] == "read 1" and set(order[1:3]) == {"saving 1", "read 2"}, order
    assert order.count("saving 3") == 1

    monkeypatch.setattr(sweep, "run_sweep", functools.partial(sweep.run_sweep, overlap=False))
    saved_sequentially = []
    with faults.hook("sweep_saving", lambda: saved_sequentially.append(1)), \
            faults.hook("plots_drawing", lambda: drawn_here.append(1)):
        assert main(_args(inputs, tmp_path / "sequential", plots=True)) == 0
    assert not saved_sequentially and len(drawn_here) == len(REVISIONS)  # saved and drawn by the main process
    overlapped, sequential = _files(tmp_path / "overlapped"), _files(tmp_path / "sequential")
    assert overlapped.keys() == sequential.keys()
    assert any(k.endswith("samples.zarr/states/0.0.0") or "samples.zarr" in k for k in overlapped)
    assert "sweep_cka.json" in overlapped and "sweep.csv" in overlapped
    assert any(k.startswith("repo/step0/samples.zarr/keys/") for k in overlapped)
    assert sum(k.endswith(".png") for k in overlapped) >= 3 * len(REVISIONS)
    import json
    timeline = json.loads((tmp_path / "overlapped" / "repo" / "step0" / "manifest.json").read_text())["timeline"]
    assert any(span[0] == "plots (beside)" for span in timeline)
    assert [k for k in overlapped if overlapped[k] != sequential[k]] == []

    # a flipped byte in a step's sample (its sha256 no longer the record's) leaves that step out of
    # the CKA across checkpoints, with the reason, rather than changing its numbers silently
    steps = {r: tmp_path / "overlapped" / "repo" / r for r in REVISIONS}
    chunk = next(p for p in sorted((steps["step1000"] / "samples.zarr" / "states").iterdir()) if p.name[0].isdigit())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    from isojax.run.sweep_files import sweep_cka
    doc = sweep_cka({"repo": list(steps.items())})["repo"]["checkpoints"]
    assert doc["step1000"] is None and doc["step0"] is not None


def test_detached_results_hold_nothing_on_the_devices(tmp_path, monkeypatch, inputs):
    """What a step's saving thread reads is on the host: no jax.Array left in the results it saves."""
    import jax

    import isojax
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    results = isojax.measure(str(inputs / "repo" / "step0"), [str(inputs / "pile.jsonl")], seq_len=64,
                             batch_tokens=512, sample_states=64)
    assert results.detach()
    held = []

    def walk(x):
        if isinstance(x, jax.Array):
            held.append(x)
        elif isinstance(x, dict):
            [walk(v) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            [walk(v) for v in x]
    walk(results.final)
    walk(results.metrics)
    walk([results.final["sample"](s) for s in range(len(results.state_names))])
    assert not held
    assert results.final["sample"](0).dtype == np.float32 and results.final["sample"](0).shape[0] == 64
    keys = results.final["sample_keys"]  # which tokens (issue 45): the 64 smallest keys, ascending, distinct
    as64 = keys[:, 0].astype(np.uint64) << np.uint64(32) | keys[:, 1].astype(np.uint64)
    assert keys.dtype == np.uint32 and keys.shape == (64, 2) and (as64[1:] > as64[:-1]).all()


def test_an_error_while_saving_names_its_step_and_keeps_the_steps_before(tmp_path, monkeypatch, inputs):
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    calls = []

    def fail_second():
        calls.append(1)
        if len(calls) == 2:
            raise UserError("disk on fire")

    out = tmp_path / "out"
    with faults.hook("sweep_saving", fail_second), pytest.raises(UserError) as e:
        sweep.run_sweep([str(inputs / "repo")], list(REVISIONS), out, resume=False, overwrite=False, plots=False,
                        config=sweep.MeasureConfig.build(None, [str(inputs / "pile.jsonl")], seq_len=64,
                                                         batch_tokens=512))
    assert "step1000" in str(e.value) and "disk on fire" in str(e.value)
    assert (out / "repo" / "step0" / "metrics.json").is_file()
    assert not (out / "repo" / "step1000" / "metrics.json").exists()
    assert not list((out / "repo" / "step1000").glob(".isojax-stage*"))  # nothing half-written left


@pytest.mark.slow
def test_a_sweep_killed_while_a_step_is_saved_resumes_to_the_uninterrupted_results(tmp_path, inputs):
    """SIGKILL as the second step's files are about to be written (the third step loading beside
    it), then once more with every step's saving held while the next loops, killed in that loop
    at a checkpoint; --resume ends with the files of a sweep never interrupted."""
    env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache")}
    run = lambda out, *extra, fault=None: subprocess.run(
        [sys.executable, "-m", "isojax.extract", *_args(inputs, out, *extra)], cwd=REPO, capture_output=True,
        text=True, env={**env, **({"ISOJAX_FAULT": fault} if fault else {})})
    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = _files(tmp_path / "whole")

    out = tmp_path / "killed"
    killed = run(out, fault="sweep_saving:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "repo" / "step0" / "metrics.json").is_file()
    assert not (out / "repo" / "step1000" / "metrics.json").exists()
    every = ["--checkpoint-every-tokens", "600"]
    held = run(out, "--resume", *every, fault="sweep_saving:hold,checkpoint_written:2")
    assert held.returncode == -9, held.stderr[-2000:]
    assert not (out / "repo" / "step1000" / "metrics.json").exists()  # held, never committed
    assert (out / "repo" / "step2000" / "checkpoint").is_dir()  # killed in the next step's loop (846 tokens a step)
    resumed = run(out, "--resume", *every)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = _files(out)
    assert got.keys() == expected.keys()
    assert [k for k in got if got[k] != expected[k]] == []
