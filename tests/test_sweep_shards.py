"""One sweep split over jobs (--shard I/N) into one shared --out: each job measures every N-th step
with its step folder locked, skips a step another live job holds, and rebuilds sweep.csv from every
finished step of the whole sweep, saying how many are missing; the last to finish writes the
complete files, equal to one job's."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import build_hf_checkpoint
from test_extract import write_pile_jsonl
from test_weights import make_neox

from isojax import extract
from isojax.run import outdir
from isojax.run.sweep import parse_shard
from isojax.errors import UserError
from isojax.weights import command as weights

REPO = Path(__file__).resolve().parents[1]


def rows(out: Path) -> list[dict]:
    with open(out / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_bad_shards_are_one_error_line(tmp_path, capsys):
    assert parse_shard(None, False) == (0, 1) and parse_shard("2/3", True) == (2, 3) and parse_shard("0/1", True)
    for bad in ("3/3", "1/0", "-1/3", "1", "a/b", "1/3/4"):
        with pytest.raises(UserError, match=r"--shard .*I from 0 to N-1"):
            parse_shard(bad, True)
    sweep = ["--model", tmp_path / "m", "--revisions", "step0,step1"]
    cases = [(extract.main, [*sweep, "--shard", "3/3"], "I from 0 to N-1"),
             (extract.main, ["--model", "random:pythia-70m", "--shard", "0/2"], "--shard applies to sweeps"),
             (weights.main, [*sweep, "--shard", "2/2"], "I from 0 to N-1"),
             (weights.main, ["--model", tmp_path / "m", "--shard", "0/2"], "--shard applies to sweeps")]
    for main, args, message in cases:
        assert main([*map(str, args), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_shared_lock_waits_for_its_holder(tmp_path, monkeypatch):
    """OUT held by another process: claim(wait=True) says it waits and takes OUT once that one lets go
    (a sweep's jobs rebuild the sweep's files in turn); without wait it is refused."""
    out = tmp_path / "out"
    code = ("import sys; from isojax.run import outdir\n"
            "with outdir.claim(sys.argv[1], overwrite=True):\n    print('ready', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    waiting, took = threading.Event(), []
    monkeypatch.setattr(outdir, "log", lambda m: waiting.set() if f"pid {holder.pid}" in m else None)

    def claim():
        with outdir.claim(out, overwrite=True, wait=True):
            took.append(json.loads((out / outdir.LOCK).read_text())["pid"])
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(outdir.Busy, match=f"pid {holder.pid}"):
            with outdir.claim(out, overwrite=True):
                pass
        thread = threading.Thread(target=claim)
        thread.start()
        assert waiting.wait(60) and not took
        holder.stdin.write("go\n")
        holder.stdin.flush()
        thread.join(60)
    finally:
        holder.kill()
        holder.wait()
    assert took == [os.getpid()]


def test_weights_sweep_in_two_shards_equals_one_job(tmp_path, capsys):
    repo = tmp_path / "tiny"
    for i, rev in enumerate(("step0", "step1000", "step2000")):
        (repo / rev).mkdir(parents=True)
        make_neox(repo / rev, 30 + i, hidden=32, vocab=150)
    common = ["--model", repo, "--revisions", "step0,step1000,step2000", "--no-plots"]
    assert weights.main([*map(str, common), "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    out = str(tmp_path / "sharded")
    assert weights.main([*map(str, common), "--shard", "1/2", "--out", out]) == 0
    err = capsys.readouterr().err
    assert "shard 1/2: 1 of the sweep's 3 steps" in err and "hold 1 of its 3 steps; 2 still missing" in err, err
    assert [r["revision"] for r in rows(Path(out))] == ["step1000"]
    assert weights.main([*map(str, common), "--shard", "0/2", "--out", out]) == 0
    assert "hold all 3 steps" in capsys.readouterr().err
    assert rows(Path(out)) == rows(tmp_path / "one")


def _holds_lock(folder: Path, pid: int) -> bool:
    try:
        return json.loads((folder / outdir.LOCK).read_text())["pid"] == pid
    except (OSError, ValueError, KeyError):
        return False


@pytest.mark.slow
def test_three_shards_one_killed_and_rerun_equal_one_job(tmp_path):
    """3 shards at once into one OUT, shard 1 killed in its step (SIGKILL at its first checkpoint):
    sweep.csv then holds the 3 other steps and says 1 is missing. Shard 1 again (--resume) while a
    copy of it holds that step: the copy's step is skipped, not measured twice. Shard 1 rerun once
    that copy is killed: sweep.csv equals a one-job sweep's."""
    for i, rev in enumerate(("step0", "step1000", "step2000", "step3000")):
        build_hf_checkpoint(tmp_path / "tiny" / rev, seed=i, vocab_size=50304, hidden_size=32, num_layers=1,
                            num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 100, seed=5)
    env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    common = ["-m", "isojax.extract", "--model", tmp_path / "tiny", "--revisions", "step0,step1000,step2000,step3000",
              "--data", tmp_path / "pile.jsonl", "--unit", "document", "--seq-len", "64", "--batch-tokens", "256",
              "--checkpoint-every-tokens", "512", "--no-plots"]

    def start(*args, fault=None):
        return subprocess.Popen([sys.executable, *map(str, common), *args], cwd=REPO, text=True,
                                env={**env, **({"ISOJAX_FAULT": fault} if fault else {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def finish(proc):
        _, err = proc.communicate(timeout=600)
        return proc.returncode, err

    one = finish(start("--out", tmp_path / "one"))
    assert one[0] == 0, one[1][-2000:]
    reference = rows(tmp_path / "one")
    assert len(reference) == 4 * 3

    shards = [start("--shard", f"{i}/3", "--out", out, fault="checkpoint_written:1" if i == 1 else None)
              for i in range(3)]
    (code0, err0), (code1, err1), (code2, err2) = map(finish, shards)
    assert (code0, code1, code2) == (0, -9, 0), (err0[-1500:], err1[-1500:], err2[-1500:])
    assert "hold 3 of its 4 steps; 1 still missing" in err0 + err2
    assert rows(out) == [r for r in reference if r["revision"] != "step1000"]

    step = out / "tiny" / "step1000"
    copy = start("--shard", "1/3", "--resume", "--out", out, fault="checkpoint_written:hold")
    try:
        deadline = time.time() + 300
        while not _holds_lock(step, copy.pid) and copy.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert _holds_lock(step, copy.pid), copy.stderr.read()[-1500:] if copy.poll() is not None else "no lock"
        code, err = finish(start("--shard", "1/3", "--resume", "--out", out))
        assert code == 0, err[-2000:]
        assert f"step1000: skipped, another job is measuring it (pid {copy.pid} " in err, err[-2000:]
        assert "hold 3 of its 4 steps; 1 still missing (skipped here" in err
    finally:
        copy.kill()
        copy.wait()
    assert not (step / "metrics.json").exists()

    code, err = finish(start("--shard", "1/3", "--resume", "--out", out))
    assert code == 0, err[-2000:]
    assert "resuming after" in err and "hold all 4 steps" in err, err[-2000:]
    assert rows(out) == reference
