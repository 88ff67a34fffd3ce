"""A sweep reads its next checkpoint while the current one loops (issue 47, isojax/run/load_ahead.py):
the parameters read ahead, on the devices or in host memory, are a load's bit for bit; a sweep that
reads ahead writes the files of one that does not; a damaged next checkpoint fails its own step
with the error it gives unread ahead; a sweep killed while it reads ahead resumes to the
uninterrupted results. The reads ahead are seen by their fault point and log lines, never by clocks."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import build_hf_checkpoint
from isojax import faults
from isojax.device.mesh import make_mesh
from isojax.extract import main
from isojax.hf.loading import HostCheckpoint, LoadedModel, load_model
from isojax.run import sweep
from isojax.run.inputs import peek_config, tokenizer_without_weights
from isojax.run.load_ahead import LoadAhead
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]
REVISIONS = ("step0", "step1000", "step2000")
ON_DEVICES = "weights read and placed on the devices ahead"
IN_HOST_MEMORY = "weights read into host memory ahead"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_ahead")
    for seed, rev in enumerate(REVISIONS):
        build_hf_checkpoint(root / "repo" / rev, seed=seed, vocab_size=50304, hidden_size=32, num_layers=1,
                            num_heads=2)
    write_pile_jsonl(root / "pile.jsonl", 30, seed=3)
    return root


def _args(repo: Path, inputs: Path, out: Path, revisions=REVISIONS) -> list[str]:
    return ["--model", str(repo), "--revisions", ",".join(revisions), "--data", str(inputs / "pile.jsonl"),
            "--seq-len", "64", "--batch-tokens", "512", "--no-plots", "--out", str(out)]


def _files(out: Path) -> dict[str, bytes]:
    """Every file isojax wrote but those holding timings (manifest.json) or the record of the folder."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", ".isojax-results.json")}


def _bits(params) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(params)]


def test_weights_read_ahead_are_a_loads_bit_for_bit(inputs):
    """On the devices (room for them) and in host memory (none), the tokenizer and parameters read
    ahead are those the step's own load gives; another dtype's step takes nothing, nor a step
    whose read ahead failed (it reads its weights itself)."""
    folder, mesh = str(inputs / "repo" / "step1000"), make_mesh()
    own = load_model(folder, None, "float32", mesh)
    early = peek_config(folder)
    for room, kind in ((1 << 50, LoadedModel), (0, HostCheckpoint)):
        ahead = LoadAhead()
        ahead.expect(folder)
        ahead.start("float32", mesh, room)
        tok, description, bos = ahead.tokenizer(folder, early)
        assert (description, bos) == tokenizer_without_weights(folder, early)[1:]
        assert tok.to_str() == own.tokenizer.to_str()
        got = ahead.take(folder, None, "float32", mesh)
        assert isinstance(got, kind)
        loaded = got if kind is LoadedModel else load_model(folder, None, "float32", mesh, read=got)
        assert loaded.source == {k: v for k, v in own.source.items() if k != "tokenizer"}
        assert loaded.config == own.config and loaded.weights == own.weights
        assert jax.tree.structure(loaded.params) == jax.tree.structure(own.params)
        assert _bits(loaded.params) == _bits(own.params)
        assert ahead.take(folder, None, "float32", mesh) is None  # taken once

    other = LoadAhead()
    other.expect(folder)
    other.start("bfloat16", mesh, 1 << 50)
    assert other.take(folder, None, "float32", mesh) is None

    def fail():
        raise RuntimeError("read ahead failed")
    failed = LoadAhead()
    with faults.hook("weights_ahead", fail):
        failed.expect(folder)
        failed.start("float32", mesh, 1 << 50)
        assert failed.take(folder, None, "float32", mesh) is None


def test_a_sweep_reading_ahead_writes_the_files_of_one_that_does_not(tmp_path, monkeypatch, inputs, capsys):
    """Each later step's weights are read on the thread reading ahead, while the step before loops,
    placed on the devices (or, with no room there, in host memory), and taken by that step: the
    sweep's files (metrics.json, layers.csv, sweep.csv, ...) equal, byte for byte, those of a sweep
    that reads each checkpoint when it comes to it."""
    import isojax.run.measure as measure
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    reads = []
    hook = lambda: reads.append(threading.current_thread().name)
    repo = inputs / "repo"
    with faults.hook("weights_ahead", hook):
        assert main(_args(repo, inputs, tmp_path / "ahead")) == 0
    taken = [line for line in capsys.readouterr().err.splitlines() if ON_DEVICES in line]
    assert reads == ["isojax-load-ahead"] * 2
    assert [Path(line.split()[1].rstrip(":")).name for line in taken] == ["step1000", "step2000"], taken

    monkeypatch.setattr(measure, "room_beside", lambda *a, **k: 0)  # no room on the devices: host memory
    with faults.hook("weights_ahead", hook):
        assert main(_args(repo, inputs, tmp_path / "host")) == 0
    assert sum(line.count(IN_HOST_MEMORY) for line in capsys.readouterr().err.splitlines()) == 2
    assert len(reads) == 4

    monkeypatch.setattr(sweep, "run_sweep", functools.partial(sweep.run_sweep, load_ahead=False))
    with faults.hook("weights_ahead", hook):
        assert main(_args(repo, inputs, tmp_path / "plain")) == 0
    assert len(reads) == 4  # nothing read ahead
    plain = _files(tmp_path / "plain")
    assert any(k.endswith("step2000/metrics.json") for k in plain) and "sweep.csv" in plain
    for name in ("ahead", "host"):
        got = _files(tmp_path / name)
        assert got.keys() == plain.keys()
        assert [k for k in got if got[k] != plain[k]] == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_next_checkpoint_fails_its_own_step_as_unread_ahead(tmp_path, monkeypatch, inputs, capsys, damage):
    """The next checkpoint's weights file truncated, or gone: the read ahead fails beside the step
    before, which is measured and committed; the damaged step then fails with the one `error:` line
    a sweep that does not read ahead gives."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    for rev in REVISIONS[:2]:
        shutil.copytree(inputs / "repo" / rev, repo / rev)
    weights = repo / "step1000" / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    else:
        weights.unlink()
    reads, lines = [], {}
    for name, ahead in (("ahead", True), ("plain", False)):
        monkeypatch.setattr(sweep, "run_sweep", functools.partial(sweep.run_sweep, load_ahead=ahead))
        with faults.hook("weights_ahead", lambda: reads.append(name)):
            assert main(_args(repo, inputs, tmp_path / name, REVISIONS[:2])) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("error: ") and str(repo / "step1000") in err[-1], err[-3:]
        assert [line for line in err if not line.startswith("isojax: ")] == err[-1:]
        assert any(line.endswith("@ step1000") for line in err)  # its own step's
        lines[name] = err[-1]
        assert (tmp_path / name / "repo" / "step0" / "metrics.json").is_file()
        assert not (tmp_path / name / "repo" / "step1000" / "metrics.json").exists()
    assert reads == ["ahead"]
    assert lines["ahead"] == lines["plain"]


@pytest.mark.slow
def test_a_sweep_killed_while_it_reads_ahead_resumes_to_the_uninterrupted_results(tmp_path, inputs):
    """SIGKILL as the thread reading ahead begins on the second checkpoint's weights (the first in
    its loop); --resume ends with the files of a sweep never interrupted."""
    env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache")}
    run = lambda out, *extra, fault=None: subprocess.run(
        [sys.executable, "-m", "isojax.extract", *_args(inputs / "repo", inputs, out), *extra], cwd=REPO,
        capture_output=True, text=True, env={**env, **({"ISOJAX_FAULT": fault} if fault else {})})
    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "killed"
    killed = run(out, fault="weights_ahead:1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "repo" / "step0" / "metrics.json").exists()
    resumed = run(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ON_DEVICES in resumed.stderr
    got, expected = _files(out), _files(tmp_path / "whole")
    assert got.keys() == expected.keys()
    assert [k for k in got if got[k] != expected[k]] == []
