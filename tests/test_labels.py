"""What results say their weights are (random, initialization (step 0), trained), `--revision` on a
local folder of revisions, weights holding NaN or inf, and an unusable ISOJAX_CACHE (issue 36)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import build_hf_checkpoint
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]
INITIAL = "initialization (step 0)"


def _checkpoint(path: Path, seed: int = 0) -> Path:
    build_hf_checkpoint(path, seed=seed, vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    return path


def _spoil(path: Path, name: str, index) -> None:
    """Put NaN at `index` of tensor `name` in the checkpoint's model.safetensors."""
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensors[name].copy()
    tensors[name][index] = np.nan
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A local folder of revisions standing in for a hub repository: repo/step0, repo/step1000."""
    repo = tmp_path_factory.mktemp("stand-in") / "repo"
    for seed, rev in enumerate(("step0", "step1000")):
        _checkpoint(repo / rev, seed)
    return repo


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_checkpoint_weights_and_older_results():
    from isojax.steps import checkpoint_weights, weights_read
    assert checkpoint_weights("step0") == checkpoint_weights("stage1-step0-tokens0B") == INITIAL
    assert checkpoint_weights(None, "/ckpts/pythia-70m/step0/") == checkpoint_weights("main", Path("x/step0")) == INITIAL
    assert checkpoint_weights("step1000", "/ckpts/x/step0") == "trained"  # the revision says, where it names a step
    assert checkpoint_weights(None, "/ckpts/pythia-70m") == checkpoint_weights("0123abc", None) == "trained"
    # older results said "pretrained" for every checkpoint
    assert weights_read("pretrained", "step143000") == weights_read("pretrained", None) == "trained"
    assert weights_read("pretrained", "step0") == INITIAL
    assert [weights_read(w) for w in ("random", INITIAL, "trained", None)] == ["random", INITIAL, "trained", None]


def test_report_and_plots_read_every_label():
    from isojax.plots.run import title_for
    from isojax.report import build
    from isojax.report.collect import Results, Run
    runs = [Run("extract", Path(f"/r/{i}"), {"weights": w}, {}, model, rev, f"m{i}")
            for i, (w, model, rev) in enumerate([("pretrained", "EleutherAI/pythia-70m", "main"),
                                                 ("pretrained", "EleutherAI/pythia-70m", "step0"),
                                                 (INITIAL, "tiny", "step0"), ("trained", "tiny", "step1000"),
                                                 ("random", "random:pythia-70m", "main")])]
    assert [r.weights_label for r in runs] == ["trained", INITIAL, INITIAL, "trained", "random"]
    section = build._inputs(Results(runs, [], []))
    table = section.items[0].table
    column = table.columns.index("weights")
    assert sorted(row[column] for row in table.rows) == sorted(["trained", INITIAL, INITIAL, "trained", "random"])
    assert "RANDOM WEIGHTS" in section.text and INITIAL in section.text
    assert title_for({"model": "tiny", "revision": "step0", "weights": INITIAL}, "x").startswith(
        "x — tiny @ step0 — INITIALIZATION (STEP 0)")
    assert "RANDOM WEIGHTS" in title_for({"model": "random:pythia-70m", "weights": "random"}, "x")
    for old in ({"revision": "step1000", "weights": "pretrained"}, {"weights": "trained"}):
        assert title_for({"model": "m", **old}, "x").split("\n")[0].endswith(old.get("revision", "m"))


def test_weights_revision_of_a_local_folder_of_revisions(stand_in, tmp_path, capsys):
    from isojax.weights.command import main
    for rev, label in (("step0", INITIAL), ("step1000", "trained")):
        assert main(["--model", str(stand_in), "--revision", rev, "--no-plots", "--out", str(tmp_path / rev)]) == 0
        doc = json.loads((tmp_path / rev / "weights.json").read_text())
        assert (doc["model"], doc["revision"], doc["weights"]) == ("repo", rev, label)
        assert doc["checkpoint"] == str(stand_in / rev)
    # --revisions measures the same folders, named alike
    assert main(["--model", str(stand_in), "--revisions", "step0,step1000", "--no-plots",
                 "--out", str(tmp_path / "sweep")]) == 0
    for rev in ("step0", "step1000"):
        assert json.loads((tmp_path / "sweep" / "repo" / rev / "weights.json").read_text()) == \
            json.loads((tmp_path / rev / "weights.json").read_text())
    # the folder itself, named by its step
    assert main(["--model", str(stand_in / "step0"), "--no-plots", "--out", str(tmp_path / "direct")]) == 0
    assert json.loads((tmp_path / "direct" / "weights.json").read_text())["weights"] == INITIAL
    capsys.readouterr()
    assert main(["--model", str(stand_in), "--revision", "step7", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: revision 'step7' not found: {stand_in} has no subfolder step7\n"
    assert not (tmp_path / "bad").exists()


def test_a_folder_of_revisions_as_a_model_names_revision_and_revisions(stand_in, tmp_path, capsys):
    """--model DIR where DIR/step0/, DIR/step1000/ hold checkpoints: extract, its dry run and weights
    say it looks like a folder of revisions and show --revision/--revisions (not 'no config.json')."""
    from isojax.extract import main as extract
    from isojax.weights.command import main as weights
    (tmp_path / "c.txt").write_text("some text\n")
    want = (f"error: {stand_in} looks like a folder of revisions (step0, step1000), not one checkpoint: pick one "
            "with --revision step0, or measure them all with --revisions step0,step1000\n")
    for main, extra in ((extract, ["--data", str(tmp_path / "c.txt")]), (extract, ["--data", str(tmp_path / "c.txt"),
                                                                                     "--dry-run"]), (weights, [])):
        capsys.readouterr()
        assert main(["--model", str(stand_in), *extra, "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == want
        assert not (tmp_path / "out").exists()


def test_extract_revision_of_a_local_folder_of_revisions(stand_in, tmp_path, monkeypatch):
    from isojax.extract import main
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    write_pile_jsonl(tmp_path / "pile.jsonl", 12, seed=4)
    common = ["--data", str(tmp_path / "pile.jsonl"), "--seq-len", "64", "--batch-tokens", "512", "--no-plots"]
    assert main(["--model", str(stand_in), "--revision", "step0", *common, "--out", str(tmp_path / "one")]) == 0
    metrics = json.loads((tmp_path / "one" / "metrics.json").read_text())
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert (metrics["model"], metrics["revision"], metrics["weights"]) == ("repo", "step0", INITIAL)
    assert (manifest["model"], manifest["revision"], manifest["weights"]) == ("repo", "step0", INITIAL)
    assert manifest["model_path"] == str(stand_in / "step0")
    assert main(["--model", str(stand_in), "--revisions", "step0", *common, "--out", str(tmp_path / "sweep")]) == 0
    swept = json.loads((tmp_path / "sweep" / "repo" / "step0" / "metrics.json").read_text())
    assert swept == metrics
    assert main(["--model", str(stand_in / "step1000"), *common, "--out", str(tmp_path / "trained")]) == 0
    trained = json.loads((tmp_path / "trained" / "metrics.json").read_text())
    assert (trained["model"], trained["revision"], trained["weights"]) == ("repo", "step1000", "trained")


def test_nan_in_the_weights_is_one_error_line_before_measuring(tmp_path):
    ckpt = _checkpoint(tmp_path / "nan")
    name = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    _spoil(ckpt, name, (3, 5))
    write_pile_jsonl(tmp_path / "pile.jsonl", 8, seed=5)
    p = _cli("isojax.extract", "--model", ckpt, "--data", tmp_path / "pile.jsonl", "--seq-len", "64",
             "--batch-tokens", "512", "--no-plots", "--out", tmp_path / "out", env={"ISOJAX_CACHE": str(tmp_path / "c")})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1] == f"error: tensor {name} in {ckpt} holds NaN or infinite values: " \
                                        "the checkpoint is damaged or diverged"
    assert not list((tmp_path / "out").rglob("metrics.json")) if (tmp_path / "out").exists() else True


def test_nan_in_a_measured_matrix_names_tensor_and_row(tmp_path, capsys):
    from isojax.weights.command import main
    ckpt = _checkpoint(tmp_path / "nan")
    _spoil(ckpt, "embed_out.weight", (7, 5))
    capsys.readouterr()
    assert main(["--model", str(ckpt), "--no-plots", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: tensor 'embed_out.weight' in {ckpt}: the matrix holds NaN or infinite values " \
                  "(the first in row 7)\n"
    assert not (tmp_path / "out").exists()


def test_nan_in_a_converted_checkpoint_names_the_parameter(tmp_path):
    from isojax.errors import UserError
    from isojax.hf.loading import load_model
    from isojax.convert import convert_dir
    ckpt = _checkpoint(tmp_path / "nan")
    _spoil(ckpt, "gpt_neox.final_layer_norm.bias", 4)
    convert_dir(ckpt, tmp_path / "converted")
    with pytest.raises(UserError, match=r"^tensor \S*final\S* in .*converted holds NaN or infinite values"):
        load_model(str(tmp_path / "converted"))


def test_isojax_cache_that_is_no_directory(tmp_path, monkeypatch):
    from isojax.errors import UserError
    from isojax.hf.loading import cache_root
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    monkeypatch.setenv("ISOJAX_CACHE", str(afile))
    with pytest.raises(UserError, match="is not a directory: set ISOJAX_CACHE to a directory you can write"):
        cache_root()
    monkeypatch.setenv("ISOJAX_CACHE", str(afile / "sub"))
    with pytest.raises(UserError, match=r"sub: cannot create it \(Not a directory\)"):
        cache_root()
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "new" / "cache"))
    assert cache_root() == tmp_path / "new" / "cache" and cache_root().is_dir()
    monkeypatch.setenv("ISOJAX_CACHE", "")  # empty: unset, not the current directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "isojax"
    assert afile.read_text() == "mine\n"

    p = _cli("isojax.extract", "--model", "random:pythia-70m", "--max-tokens", "64", "--no-plots",
             "--out", tmp_path / "out", env={"ISOJAX_CACHE": str(afile)})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1] == f"error: ISOJAX_CACHE={afile} is not a directory: set ISOJAX_CACHE " \
                                        "to a directory you can write"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_isojax_cache_not_writable(tmp_path, monkeypatch):
    from isojax.errors import UserError
    from isojax.hf.loading import cache_root
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setenv("ISOJAX_CACHE", str(locked))
    try:
        with pytest.raises(UserError, match="is not writable"):
            cache_root()
    finally:
        locked.chmod(0o700)
