"""Result folders (isojax.run.outdir): results commit in one step (a kill injected at every rename and
delete leaves the earlier results or the new ones, whole), isojax touches only what it wrote, a
lock refuses a second run, and output-path failures end in one `error:` line."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from isojax.run import outdir
from isojax.errors import UserError
from isojax.run.results import write_results

REPO = Path(__file__).resolve().parents[1]


def _results(tokens: int, token_stats: bool = True):
    """write_results' arguments for a tiny fake run, `tokens` telling the runs apart."""
    metrics = {"model": "m", "revision": None, "tokens": tokens, "layers": [{"name": "embed", "inter_sim": 0.5}]}
    final = {"spectra": {"centered": np.full((1, 3), float(tokens))}}
    if token_stats:
        final["token"] = {"count_V": np.arange(5) + tokens, "intra_sim_SxV": np.ones((1, 5))}
    return metrics, {"model": "m"}, final, ["embed"]


def _write(out: Path, tokens: int, token_stats: bool = True):
    return write_results(out, *_results(tokens, token_stats), plots=False)


def _user_files(out: Path) -> None:
    (out / "plots").mkdir(parents=True)
    (out / "plots" / "mine.png").write_bytes(b"user's figure")
    (out / "notes.txt").write_text("mine")


USER_FILES = {"plots/mine.png", "notes.txt", "tokens.zarr/user.txt"}


def _whole(out: Path) -> int:
    """The tokens of the results in `out`, after checking every recorded file's sha256; every other
    file is the user's, and no folder is left empty."""
    outdir.check_results(out)
    record = outdir.read_record(out)
    for rel, (size, sha) in record["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == sha, rel
    entries = [p for p in out.rglob("*") if not any(_staging(q) for q in [p, *p.relative_to(out).parents])]
    found = {p.relative_to(out).as_posix() for p in entries if not p.is_dir()}
    assert found - USER_FILES == set(record["files"]) | {outdir.RECORD}  # nothing stale
    assert not [p for p in entries if p.is_dir() and not any(p.iterdir())]
    tokens = json.loads((out / "metrics.json").read_text())["tokens"]
    assert np.load(out / "spectra.npz")["centered"][0, 0] == tokens
    return tokens


def _staging(p: Path) -> bool:
    """Left by a killed run, not results; the next run removes them."""
    return p.name.startswith((".partial-", f".{outdir.JOURNAL}.tmp-"))


class Killed(BaseException):
    """A kill -9: nothing after it runs, no except or cleanup of ours."""


def _kill_at(monkeypatch, k: int) -> list:
    """Every rename and delete counts; the k-th and all after it (the process is gone) raise."""
    calls = []
    for name in ("replace", "rename", "unlink", "rmdir"):
        real = getattr(os, name)

        def fake(*a, _real=real, **kw):
            calls.append(a)
            if len(calls) > k:
                raise Killed
            return _real(*a, **kw)
        monkeypatch.setattr(os, name, fake)
    return calls


def test_commit_killed_at_every_rename_and_delete(tmp_path, monkeypatch):
    """Earlier results (with tokens.zarr) replaced by new ones (without): a kill at the k-th
    rename/delete, for every k, leaves the earlier results whole, the new ones whole, or a journal
    that readers refuse and the next run undoes, giving the earlier results back whole. The
    user's plots/, notes.txt and the file the user put into isojax's tokens.zarr/ are never touched."""
    template = tmp_path / "template"
    _user_files(template)
    _write(template, 100)
    (template / "tokens.zarr" / "user.txt").write_text("user's note in isojax's folder")
    seen, k = set(), 0
    while True:
        out = tmp_path / f"out{k}"
        shutil.copytree(template, out)
        with monkeypatch.context() as m:
            calls = _kill_at(m, k)
            try:
                _write(out, 200, token_stats=False)
                finished = True
            except Killed:
                finished = False
        if (out / outdir.JOURNAL).exists():
            with pytest.raises(UserError, match="incomplete"):
                outdir.check_results(out)
            seen.add("journal")
            if len(seen) == 1:  # once: a kill during the recovery too, at each of its steps
                for j in range(100):
                    again = tmp_path / f"again{j}"
                    shutil.copytree(out, again, symlinks=True)
                    with monkeypatch.context() as m:
                        _kill_at(m, j)
                        try:
                            outdir._recover(again)
                            break
                        except Killed:
                            pass
                    with outdir.claim(again, overwrite=True):
                        pass
                    assert _whole(again) == 100
            with outdir.claim(out, overwrite=True):  # the next run
                pass
        tokens = _whole(out)
        seen.add(tokens)
        assert (out / "plots" / "mine.png").read_bytes() == b"user's figure"
        assert (out / "tokens.zarr" / "user.txt").read_text() == "user's note in isojax's folder"
        assert [p.name for p in (out / "tokens.zarr").iterdir()] == ["user.txt"] or tokens == 100
        with outdir.claim(out, overwrite=True):  # stale staging folders of the killed run go
            pass
        assert not [p for p in out.iterdir() if _staging(p)]
        if finished:
            assert tokens == 200 and len(calls) == k
            break
        k += 1
    assert seen == {100, 200, "journal"} and k > 8


def test_commit_failure_in_process_rolls_back(tmp_path, monkeypatch):
    """An exception (not a kill) at any rename of the commit: the earlier results are back at once."""
    out = tmp_path / "out"
    _write(out, 100)
    for k in range(30):
        with monkeypatch.context() as m:
            real, calls = os.replace, []

            def fake(*a, **kw):
                calls.append(a)
                if len(calls) == k + 1:
                    raise OSError(errno.EIO, "injected")
                return real(*a, **kw)
            m.setattr(os, "replace", fake)
            try:
                _write(out, 200 + k, token_stats=False)
                assert _whole(out) == 200 + k
                break
            except OSError:
                pass
        assert not (out / outdir.JOURNAL).exists() and _whole(out) == 100
    assert not [p for p in out.iterdir() if p.name.startswith(".partial")]


def test_only_what_isojax_wrote(tmp_path):
    """The user's files stay with and without overwrite; a result name that is the user's file is
    an error naming it; --overwrite replaces isojax's earlier results, the stale ones included."""
    out = tmp_path / "out"
    _user_files(out)
    (out / "manifest.json").write_text("user's manifest")
    with pytest.raises(UserError, match=r"manifest.json exists and isojax did not write it"):
        _write(out, 1)
    assert (out / "manifest.json").read_text() == "user's manifest" and not (out / "metrics.json").exists()
    with pytest.raises(UserError, match="manifest.json exists and isojax did not write it"):
        with outdir.claim(out, overwrite=True, names={"manifest.json"}):
            pass
    (out / "manifest.json").unlink()
    _write(out, 1)
    with pytest.raises(UserError, match="already holds results .*pass --overwrite"):
        with outdir.claim(out, overwrite=False):
            pass
    _write(out, 2, token_stats=False)
    assert _whole(out) == 2 and not (out / "tokens.zarr").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".partial")]


def test_out_checked_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        outdir.check_path(tmp_path / "file")
    with pytest.raises(UserError, match="is a file, not a folder"):
        outdir.check_path(tmp_path / "file" / "out")
    data = tmp_path / "d" / "corpus.txt"
    data.parent.mkdir()
    data.write_text("text")
    for out in (tmp_path / "d", tmp_path):
        with pytest.raises(UserError, match="is or holds an input"):
            outdir.check_path(out, [str(data)])
    with pytest.raises(UserError, match="is or holds an input"):  # a file --out (correlate's)
        outdir.check_path(data, [str(data)], folder=False)
    outdir.check_path(tmp_path / "d" / "out", [str(data)])  # beside an input file: fine
    for out, folder in ((tmp_path / "d" / "out", True), (tmp_path / "d" / "a" / "b.json", False)):
        with pytest.raises(UserError, match=r"is inside .*, an input folder of this command"):
            outdir.check_path(out, [str(tmp_path / "d")], folder=folder)
    monkeypatch.setattr(os, "access", lambda *a, **kw: False)  # as root, chmod cannot make it read-only
    with pytest.raises(UserError, match="is not writable"):
        outdir.check_path(tmp_path / "new")


def test_lock_refuses_a_second_run_and_a_dead_ones_is_taken_over(tmp_path):
    out = tmp_path / "out"
    (out / ".partial-99999-dead").mkdir(parents=True)  # a killed run's staging folder
    code = ("import sys, time; from isojax.run import outdir\n"
            "with outdir.claim(sys.argv[1], overwrite=True):\n    print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(UserError, match=rf"in use by another isojax run \(pid {p.pid} on \S+\)"):
            with outdir.claim(out, overwrite=True):
                pass
    finally:
        p.kill()
        p.wait()
    assert (out / outdir.LOCK).exists()  # left by the killed run: stale, taken over
    with outdir.claim(out, overwrite=True):
        assert json.loads((out / outdir.LOCK).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in out.iterdir()) == []


def test_disk_full_is_an_error_and_leaves_earlier_results(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _write(out, 1)

    def full(file, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(UserError, match=rf"^disk full writing {out / 'spectra.npz'}"):
        _write(out, 2)
    assert _whole(out) == 1
    assert not [p for p in out.iterdir() if p.name.startswith(".partial")]


def test_readers_refuse_results_cut_short_or_changed(tmp_path):
    from isojax.report import collect
    out = tmp_path / "run"
    _write(out, 1)
    collect.load([tmp_path])
    (out / "metrics.json").write_text((out / "metrics.json").read_text().replace('"tokens": 1', '"tokens": 7'))
    with pytest.raises(UserError, match="differs from what isojax wrote"):
        collect.load([tmp_path])
    (out / outdir.RECORD).unlink()  # the user takes the folder as it is
    assert collect.load([tmp_path]).extract[0].data["tokens"] == 7
    (out / outdir.JOURNAL).write_text("{}")
    (out / "metrics.json").unlink()  # moved aside by the commit that was cut short
    with pytest.raises(UserError, match="incomplete"):
        collect.load([tmp_path])


def test_commands_refuse_out_paths(tmp_path, capsys):
    """report OUT --out OUT, weights --matrix DIR/m.npy --out DIR, correlate --out DIR: one error
    line, nothing touched; correlate writes NaN as null."""
    from isojax.report import correlate
    from isojax.weights import command as weights
    from isojax.report import build
    _write(tmp_path / "run", 1)
    np.save(tmp_path / "m.npy", np.ones((4, 3)))
    scores = tmp_path / "scores.csv"
    scores.write_text("model,revision,task,score\n")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    for main, args, message in [
            (build.main, [tmp_path / "run", "--out", tmp_path / "run", "--overwrite"], "is or holds an input"),
            (weights.main, ["--matrix", tmp_path / "m.npy", "--out", tmp_path, "--overwrite"], "is or holds an input"),
            (correlate.main, [tmp_path / "run", "--scores", scores, "--out", tmp_path / "run", "--overwrite"],
             "is a folder; give a file name"),
            (correlate.main, [tmp_path / "run", "--scores", scores, "--out", scores, "--overwrite"],
             "is or holds an input")]:
        assert main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before and (tmp_path / "m.npy").exists()
    assert _whole(tmp_path / "run") == 1


def test_no_out_inside_an_input_folder(tmp_path, capsys):
    """correlate RUNS --out RUNS/step1/metrics.json --overwrite replaced a measured run's metrics;
    now every command refuses an --out anywhere inside a folder it reads, before any work."""
    from isojax.extract import main as extract_main
    from isojax.report import build, correlate
    from isojax.weights import command as weights
    runs = tmp_path / "runs"
    _write(runs / "step1", 1)
    scores = tmp_path / "scores.csv"
    scores.write_text("model,revision,task,score\nm,main,t,0.5\n")
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for main, args in [
            (correlate.main, [runs, "--scores", scores, "--out", runs / "step1" / "metrics.json", "--overwrite"]),
            (correlate.main, [runs, "--scores", scores, "--out", runs / "correlation.json"]),
            (build.main, [runs, "--out", runs / "step1" / "report", "--overwrite"]),
            (weights.main, ["--model", model, "--out", model / "w", "--overwrite"]),
            (extract_main, ["--model", model, "--data", scores, "--out", model / "x", "--overwrite"])]:
        assert main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "an input folder of this command" in err, err
        assert len(err.strip().splitlines()) == 1
    assert _whole(runs / "step1") == 1 and sorted(p.name for p in runs.iterdir()) == ["step1"]
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    correlate.write_json(tmp_path / "c.json", [{"pearson": {"r": float("nan"), "p": float("inf")}}], False)
    assert json.loads((tmp_path / "c.json").read_text()) == [{"pearson": {"r": None, "p": None}}]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_sweep_resume_refuses_another_corpus_or_budget(tmp_path):
    from isojax.run import sweep
    jobs = [sweep.Step("m", r, tmp_path / "m" / r) for r in ("step1", "step2")]
    done = tmp_path / "m" / "step1"
    done.mkdir(parents=True)
    (done / "manifest.json").write_text(json.dumps({"corpus": "a.txt", "corpus_fingerprint": "aa",
                                                    "settings": {"max_tokens": 1000}}))
    (done / "metrics.json").write_text(json.dumps({"model": "m", "tokens": 1000, "layers": [{"name": "embed"}]}))
    step2 = jobs[1]
    same = {"corpus": "a.txt", "corpus_fingerprint": "aa", "settings": {"max_tokens": 1000}}
    sweep.check_same_corpus(same, jobs, step2)
    with pytest.raises(UserError, match="another corpus"):
        sweep.check_same_corpus({**same, "corpus_fingerprint": "bb"}, jobs, step2)
    with pytest.raises(UserError, match="--max-tokens 1000, this run with 2000"):
        sweep.check_same_corpus({**same, "settings": {"max_tokens": 2000}}, jobs, step2)
    (tmp_path / "notes.txt").write_text("mine")
    sweep.write_sweep_csv(tmp_path, jobs)
    sweep.write_sweep_csv(tmp_path, jobs)  # again (a resumed sweep): replaces its own sweep.csv
    assert outdir.read_record(tmp_path)["names"] == ["sweep.csv"] and (tmp_path / "notes.txt").exists()
    assert (tmp_path / "sweep.csv").read_text().startswith("model,revision,step,tokens,name")


@pytest.mark.slow
def test_cli_run_stays_beside_user_files(tmp_path, monkeypatch, capsys):
    """One real extract into a folder holding the user's plots/ and notes: refused without
    --overwrite the second time, replaced with it; the user's files and checkpoint rules kept."""
    from conftest import build_hf_checkpoint
    from isojax.extract import main
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    (tmp_path / "c.txt").write_text("A sentence of text. Another one here.\n" * 20)
    out = tmp_path / "out"
    _user_files(out)
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "c.txt"), "--seq-len", "32",
            "--batch-tokens", "128", "--out", str(out), "--no-plots"]
    assert main(args) == 0
    first = (out / "metrics.json").read_text()
    assert main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0
    assert (out / "plots" / "mine.png").exists() and (out / "notes.txt").read_text() == "mine"
    assert json.loads(first)["tokens"] == json.loads((out / "metrics.json").read_text())["tokens"]
    assert main(args[:-3] + ["--out", str(tmp_path), "--overwrite"]) == 2  # --out holds --data
    assert "is or holds an input" in capsys.readouterr().err
    assert not [p for p in out.iterdir() if p.name.startswith(".partial") or p.name == outdir.LOCK]


def test_one_refusal_of_earlier_results(tmp_path, capsys):
    """correlate's file, the converter's folder and a result folder are refused by one rule in one
    words (outdir.refuse_earlier), the converter's before it reads or downloads its source."""
    from isojax.convert import main as convert_main
    from isojax.report import correlate
    f = tmp_path / "c.json"
    f.write_text("[]")
    with pytest.raises(UserError) as refused:
        correlate.write_json(f, [], False)
    assert str(refused.value) == f"{f} exists; pass --overwrite to replace it"
    converted = tmp_path / "converted"
    with outdir.claim(converted, overwrite=False), outdir.staged(converted) as stage:  # an earlier conversion
        (stage / "isojax.json").write_text("{}")
    assert convert_main([str(tmp_path / "no-such-checkpoint"), "--out", str(converted)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {converted} already holds results (isojax.json); pass --overwrite to replace them"
    _write(tmp_path / "run", 1)
    with pytest.raises(UserError, match=r"run already holds results \(.*\); pass --overwrite to replace them"):
        with outdir.claim(tmp_path / "run", overwrite=False):
            pass
