"""extract checks --out before any work and a refused run leaves nothing behind: every name a run
writes is checked before the model loads (a single run's and a sweep's step folders), a dry run's
--out is checked against its inputs as a run's is, and a refusal creates no folder."""

from __future__ import annotations

import hashlib

import pytest

from conftest import build_hf_checkpoint
from isojax.extract import main
from isojax.run import outdir

SMALL = dict(vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)  # the bundled tokenizer's ids
TEXT = "The cat sat on the mat. A dog ran in the park. Birds sing at dawn. " * 8


def _sha256s(folder) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _stand_in(monkeypatch) -> list:
    """start_measure replaced by a stand-in that records its calls and stops the run: a refusal
    made before it never loaded the model."""
    import isojax.run.measure
    calls = []

    def stand_in(config):
        calls.append(config)
        raise RuntimeError("the model was loaded")
    monkeypatch.setattr(isojax.run.measure, "start_measure", stand_in)
    return calls


@pytest.fixture
def measured(monkeypatch):
    return _stand_in(monkeypatch)


def _users(folder, name: str) -> None:
    """A file of the user's at `name`, or a folder holding one where the name is a folder's (or ends
    with /)."""
    if "." in name and not name.endswith((".zarr", "/")):
        (folder / name).write_text("the user's own file")
    else:
        (folder / name).mkdir()
        (folder / name / "mine.txt").write_text("the user's own file")


def test_every_name_a_run_writes_is_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The names a run wrote (its record), each taken in a fresh --out by a file or folder of the
    user's: refused with one line naming it before the model loads, the user's bytes unchanged; so
    is, with --overwrite, a folder of the user's where the run wrote a file."""
    build_hf_checkpoint(tmp_path / "ckpt", **SMALL)
    (tmp_path / "c.txt").write_text(TEXT)
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "c.txt"), "--seq-len", "32",
            "--batch-tokens", "128", "--sample-states", "40", "--format", "parquet"]
    assert main(args + ["--out", str(tmp_path / "run")]) == 0
    written = set(outdir.owned(tmp_path / "run"))
    assert {"tokens.zarr", "samples.zarr", "cka.json", "plots", "layers.parquet"} <= written
    calls = _stand_in(monkeypatch)
    capsys.readouterr()
    for name in sorted(written):
        out = tmp_path / f"fresh-{name}"
        out.mkdir()
        _users(out, name)
        before = _sha256s(out)
        assert main(args + ["--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {out / name} exists and isojax did not write it (it is not in "
                       f"{out / outdir.RECORD}); move it away or choose another --out"]
        assert calls == [] and _sha256s(out) == before and sorted(p.name for p in out.iterdir()) == [name]
    # a folder of the user's where the run wrote layers.csv: --overwrite refuses it before the model loads
    run = tmp_path / "run"
    (run / "layers.csv").unlink()
    _users(run, "layers.csv/")
    before = _sha256s(run)
    assert main(args + ["--out", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {run / 'layers.csv'} is not the file isojax wrote there")
    assert calls == [] and _sha256s(run) == before


def test_a_sweep_checks_every_step_folder_first(tmp_path, capsys, measured):
    """A user's tokens.zarr in the second step's folder: refused before the first step loads."""
    for step in ("step1", "step2"):
        build_hf_checkpoint(tmp_path / "revs" / step, **SMALL)
    (tmp_path / "c.txt").write_text(TEXT)
    from isojax.run.names import step_folder
    sweep = tmp_path / "sweep"
    step2 = step_folder(sweep, str(tmp_path / "revs"), "step2")
    step2.mkdir(parents=True)
    _users(step2, "tokens.zarr")
    before = _sha256s(sweep)
    capsys.readouterr()
    assert main(["--model", str(tmp_path / "revs"), "--revisions", "step1,step2", "--data", str(tmp_path / "c.txt"),
                 "--out", str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {step2 / 'tokens.zarr'} exists and isojax did not write it (it is not in "
                   f"{step2 / outdir.RECORD}); move it away or choose another --out"]
    assert measured == [] and _sha256s(sweep) == before
    assert [p for p in sweep.rglob("*") if p.is_dir() and p not in {*step2.parents, step2, step2 / "tokens.zarr"}] == []


def test_a_dry_run_checks_its_inputs_as_a_run(tmp_path, capsys, measured):
    """--dry-run --out at the model's folder, the corpus's folder or inside one: refused as a run
    is, nothing written there."""
    build_hf_checkpoint(tmp_path / "ckpt", **SMALL)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    before = {d: _sha256s(tmp_path / d) for d in ("ckpt", "corpus")}
    capsys.readouterr()
    args = ["--dry-run", "--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "corpus")]
    for out, why in [("ckpt", "is or holds an input"), ("corpus", "is or holds an input"),
                     ("corpus/plan", "an input folder of this command")]:
        assert main(args + ["--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {tmp_path / out} ") and why in err[0], err
        assert {d: _sha256s(tmp_path / d) for d in before} == before
    assert not (tmp_path / "corpus" / "plan").exists()


@pytest.mark.parametrize("case", ["out-inside-data", "missing-data", "sweep-missing-data"])
def test_a_refused_run_creates_nothing(tmp_path, capsys, case):
    """--out inside the corpus's folder, a missing --data under new folders, a sweep with missing
    data: one error line, and no folder made (--out's parents included)."""
    build_hf_checkpoint(tmp_path / "revs" / "step1", **SMALL)
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "a.txt").write_text(TEXT)
    (tmp_path / "o").mkdir()
    model, missing = ["--model", str(tmp_path / "revs" / "step1")], ["--data", str(tmp_path / "missing.txt")]
    args = {"out-inside-data": [*model, "--data", str(tmp_path / "dd"), "--out", str(tmp_path / "dd" / "sub" / "out")],
            "missing-data": [*model, *missing, "--out", str(tmp_path / "o" / "new" / "deeper" / "x")],
            "sweep-missing-data": ["--model", str(tmp_path / "revs"), "--revisions", "step1", *missing,
                                   "--out", str(tmp_path / "o" / "sweep")]}[case]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()  # a sweep logs its step first
    assert [line for line in err if not line.startswith("isojax: ")] == err[-1:] and err[-1].startswith("error: ")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "dd").rglob("*")) == ["dd/a.txt"]
    assert list((tmp_path / "o").iterdir()) == []
