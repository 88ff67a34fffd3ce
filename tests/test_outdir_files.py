"""isojax's record names files, not folders (isojax.run.outdir): a commit moves and deletes only the
files of the record, so a file of the user's inside a folder isojax wrote (OUT/plots/mine.png,
OUT/tokens.zarr/user.txt, a report's figures/my_notes.md) stays, and its folder with it; records
and journals of earlier versions (which named top-level folders) are still read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from isojax.errors import UserError
from isojax.run import outdir


def _commit(out: Path, files: dict[str, str], replace_all: bool = True) -> None:
    """One result set of `files` (relative path -> text) committed into `out` as every command does."""
    with outdir.claim(out, overwrite=True), outdir.staged(out, replace_all=replace_all) as new:
        for rel, text in files.items():
            (new / rel).parent.mkdir(parents=True, exist_ok=True)
            (new / rel).write_text(text)


def _tree(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


def test_user_files_inside_isojax_folders_stay(tmp_path, capsys):
    """Replaced with and without the folder: only recorded files move; a folder that still holds a
    user's file stays (one log line names it and counts the files), an emptied one goes."""
    out = tmp_path / "out"
    _commit(out, {"metrics.json": "1", "plots/a.png": "a1", "tokens.zarr/count/0": "c1", "tokens.zarr/.zarray": "z",
                  "figures/x.svg": "x"})
    (out / "plots" / "mine.png").write_text("user's figure")
    (out / "tokens.zarr" / "user.txt").write_text("user's note")
    (out / "tokens.zarr" / "count" / "mine").write_text("deep")
    capsys.readouterr()
    _commit(out, {"metrics.json": "2", "plots/a.png": "a2", "plots/b.png": "b2"})  # no tokens.zarr, no figures
    record = outdir.read_record(out)
    assert sorted(record["files"]) == ["metrics.json", "plots/a.png", "plots/b.png"]
    assert record["names"] == ["metrics.json", "plots"] and record["version"] == 2
    assert _tree(out) == {outdir.RECORD: (out / outdir.RECORD).read_text(), "metrics.json": "2",
                          "plots/a.png": "a2", "plots/b.png": "b2", "plots/mine.png": "user's figure",
                          "tokens.zarr/user.txt": "user's note", "tokens.zarr/count/mine": "deep"}
    assert not (out / "figures").exists()  # emptied: removed
    err = [line for line in capsys.readouterr().err.splitlines() if "did not write" in line]
    assert err == [f"isojax: {out / 'tokens.zarr'}: left in place, it holds 2 file(s) isojax did not write"]
    outdir.check_results(out)
    # the folder is the user's now: a later result of that name is refused before any work
    with pytest.raises(UserError, match="tokens.zarr exists and isojax did not write it"):
        with outdir.claim(out, overwrite=True, names={"tokens.zarr"}):
            pass


def test_a_result_file_that_is_a_users_file_is_refused(tmp_path):
    """Inside a folder isojax owns, a new result path taken by the user's file is an error naming it,
    the earlier results unchanged; so is a user's file where a result folder goes."""
    out = tmp_path / "out"
    _commit(out, {"report.md": "1", "figures/a.svg": "a1"})
    (out / "figures" / "b.svg").write_text("user's b")
    before = _tree(out)
    with pytest.raises(UserError, match=r"figures/b.svg exists and isojax did not write it"):
        _commit(out, {"report.md": "2", "figures/a.svg": "a2", "figures/b.svg": "b2"})
    (out / "figures" / "sub").write_text("user's file named like a folder")
    with pytest.raises(UserError, match=r"figures/sub exists and is not a folder isojax wrote"):
        _commit(out, {"report.md": "2", "figures/sub/c.svg": "c"})
    assert _tree(out) == {**before, "figures/sub": "user's file named like a folder"}
    assert not [p for p in out.iterdir() if p.name.startswith(".partial")]


def test_what_isojax_would_replace_must_be_what_it_wrote(tmp_path):
    """--overwrite moves away only what the record names, as it wrote it: a user's folder (or link,
    or changed file) at a path the record names as a file, or a link where isojax wrote a folder, is
    refused with one line naming it, before any work, and stays byte for byte."""
    out = tmp_path / "out"
    _commit(out, {"metrics.json": "1", "layers.csv": "a,b", "plots/a.png": "p"})
    (out / "layers.csv").unlink()
    (out / "layers.csv").mkdir()
    (out / "layers.csv" / "mine.txt").write_text("precious")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.png").write_text("the user's figure")
    before = {p: _tree(p) for p in (out, tmp_path / "elsewhere")}
    cases = [("layers.csv", None),
             ("plots", lambda: (shutil.rmtree(out / "layers.csv"), (out / "layers.csv").write_text("a,b"),
                                shutil.rmtree(out / "plots"), (out / "plots").symlink_to(tmp_path / "elsewhere"))),
             ("metrics.json", lambda: ((out / "plots").unlink(), (out / "plots").mkdir(),
                                       (out / "plots" / "a.png").write_text("p"), (out / "metrics.json").write_text("2")))]
    for name, change in cases:
        if change:
            change()
            before = {p: _tree(p) for p in (out, tmp_path / "elsewhere")}
        work = []
        with pytest.raises(UserError) as refused:
            with outdir.claim(out, overwrite=True, names={"metrics.json", "layers.csv", "plots"}):
                work.append("started")
        assert work == [] and str(refused.value).startswith(f"{out / name} is not the ")
        assert "\n" not in str(refused.value)
        assert {p: _tree(p) for p in before} == before
    (out / "metrics.json").write_text("1")
    _commit(out, {"metrics.json": "3"})  # as it wrote them: replaced
    assert _tree(out)["metrics.json"] == "3" and not (out / "layers.csv").exists()


def test_sweep_files_beside_step_folders(tmp_path):
    """replace_all=False (a sweep's sweep.csv, plots beside step folders): files of other names stay."""
    out = tmp_path / "out"
    _commit(out, {"sweep.csv": "1", "sweep_iso.png": "p"}, replace_all=False)
    _commit(out, {"sweep.csv": "2"}, replace_all=False)
    assert {k: v for k, v in _tree(out).items() if k != outdir.RECORD} == {"sweep.csv": "2", "sweep_iso.png": "p"}
    assert sorted(outdir.read_record(out)["files"]) == ["sweep.csv", "sweep_iso.png"]


def test_record_of_an_earlier_version(tmp_path):
    """Version 1 records named top-level folders ("names") and every file under them ("files"):
    read by their files, so a file the user added to a recorded folder stays on --overwrite."""
    out = tmp_path / "out"
    _commit(out, {"metrics.json": "1", "tokens.zarr/count/0": "c", "tokens.zarr/.zarray": "z"})
    record = outdir.read_record(out)
    (out / outdir.RECORD).write_text(json.dumps({"version": 1, "names": ["metrics.json", "tokens.zarr"],
                                                 "files": record["files"]}, indent=1))  # as 0.x wrote it
    (out / "tokens.zarr" / "user.txt").write_text("mine")
    assert outdir.owned(out) == ["metrics.json", "tokens.zarr"]
    _commit(out, {"metrics.json": "2"})
    assert {k: v for k, v in _tree(out).items() if k != outdir.RECORD} == {"metrics.json": "2",
                                                                          "tokens.zarr/user.txt": "mine"}


def test_journal_of_an_earlier_version_is_undone(tmp_path):
    """A commit of an earlier version, killed after it moved a whole folder aside: its journal names
    top-level entries; recovery puts the earlier results back, whole."""
    out = tmp_path / "out"
    _commit(out, {"metrics.json": "1", "tokens.zarr/count/0": "c", "tokens.zarr/.zarray": "z"})
    before = _tree(out)
    stage = out / ".partial-1-dead"
    (stage / "new").mkdir(parents=True)
    (stage / "new" / "metrics.json").write_text("2")
    (stage / "old").mkdir()
    os.replace(out / "tokens.zarr", stage / "old" / "tokens.zarr")
    os.replace(out / "metrics.json", stage / "old" / "metrics.json")
    (out / outdir.JOURNAL).write_text(json.dumps({"stage": stage.name, "new": ["metrics.json", outdir.RECORD],
                                                  "old": ["metrics.json", "tokens.zarr", outdir.RECORD]}))
    os.replace(stage / "new" / "metrics.json", out / "metrics.json")  # killed here
    with outdir.claim(out, overwrite=True):
        pass
    assert _tree(out) == before
    outdir.check_results(out)


def test_report_keeps_the_users_file_in_figures(tmp_path):
    """A report's figures/my_notes.md stays when the report is built again with --overwrite."""
    from test_report import write_weights
    from isojax.report import build
    write_weights(tmp_path / "w" / "step1000", np.random.default_rng(0), "pythia-70m", "step1000")
    out = tmp_path / "report"
    assert build.main([str(tmp_path / "w"), "--out", str(out)]) == 0
    (out / "figures" / "my_notes.md").write_text("notes")
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert build.main([str(tmp_path / "w"), "--out", str(out), "--overwrite"]) == 0
    assert (out / "figures" / "my_notes.md").read_text() == "notes"
    assert sorted(p.name for p in (out / "figures").iterdir()) == figures
    outdir.check_results(out)
