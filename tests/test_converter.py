"""Hugging Face -> Orbax converter: round trip, sharded inputs, bad checkpoints, hub path stand-in."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import build_hf_checkpoint, hf_states, max_rel_error
from isojax.convert import main as convert_main
from isojax import load_model
from isojax.errors import UserError


@pytest.mark.slow
def test_round_trip_through_orbax(tiny_checkpoint, tmp_path):
    src, model = tiny_checkpoint
    out = tmp_path / "converted"
    assert convert_main([str(src), "--out", str(out)]) == 0
    assert (out / "isojax.json").is_file() and (out / "tokenizer.json").is_file()
    ids = np.random.default_rng(5).integers(0, 512, size=33)
    converted = load_model(out)
    np.testing.assert_array_equal(converted.hidden_states(ids), load_model(src).hidden_states(ids))
    assert max_rel_error(converted.hidden_states(ids), hf_states(model, ids)) < 1e-5
    assert converted.source["checksum"] == load_model(src).source["checksum"]
    # bf16 restore of the same checkpoint casts on load
    assert str(load_model(out, dtype="bfloat16").params["embed_in"].dtype) == "bfloat16"
    # never overwrite without --overwrite
    assert convert_main([str(src), "--out", str(out)]) == 2


def test_sharded_safetensors(tmp_path):
    model = build_hf_checkpoint(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = np.arange(20) * 7 % 512
    assert max_rel_error(load_model(tmp_path / "sharded").hidden_states(ids), hf_states(model, ids)) < 1e-5


def test_truncated_checkpoint_is_refused(tiny_checkpoint):
    src, _ = tiny_checkpoint
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UserError):
        load_model(src)


def test_mismatched_config_is_refused(tiny_checkpoint):
    src, _ = tiny_checkpoint
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="lacks"):
        load_model(src)
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 2, 100
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="shape"):
        load_model(src)


@pytest.mark.slow
def test_converter_cli_bad_input_exits_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "isojax.convert", str(tmp_path / "missing"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error:")
    # the old command still works, with one line saying it goes
    old = subprocess.run([sys.executable, "-m", "converters", str(tmp_path / "missing"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert old.returncode == 2 and old.stderr.splitlines() == [
        "warning: python -m converters is deprecated and will be removed; use python -m isojax.convert",
        *proc.stderr.splitlines()]
    assert not (tmp_path / "o").exists()


def _sha256s(folder) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_converter_keeps_its_input_and_the_users_files(tiny_checkpoint, tmp_path, capsys):
    """The converter's --out follows every command's rules (isojax.run.outdir): an --out that is,
    lies in or holds the source is refused before anything is written; --overwrite replaces only
    the checkpoint isojax converted there before, never a user's file (sha256 before and after)."""
    src, _ = tiny_checkpoint
    (src / "my_notes.txt").write_text("the user's notes")
    before = _sha256s(src)
    for out, why in [(src, "is or holds an input"), (src / "converted", "is inside"),
                     (src.parent, "is or holds an input")]:
        assert convert_main([str(src), "--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {out} ") and why in err[0], err
        assert _sha256s(src) == before and not (src / "converted").exists()
        assert [p.name for p in src.parent.iterdir()] == ["tiny"]  # nothing written beside it either
    out = tmp_path / "converted"
    out.mkdir()
    (out / "notes.txt").write_text("the user's file beside the checkpoint")
    assert convert_main([str(src), "--out", str(out)]) == 0
    first = _sha256s(out)
    assert first["notes.txt"] == hashlib.sha256(b"the user's file beside the checkpoint").hexdigest()
    assert {"isojax.json", "tokenizer.json"} <= set(first) and (out / "params").is_dir()
    assert convert_main([str(src), "--out", str(out)]) == 2  # an earlier conversion: only with --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
    assert convert_main([str(src), "--out", str(out), "--overwrite"]) == 0
    again = _sha256s(out)  # Orbax's files differ from one save to the next; the user's file keeps its bytes
    names = [".isojax-results.json", "isojax.json", "notes.txt", "params", "tokenizer.json", "tokenizer_config.json"]
    assert again["notes.txt"] == first["notes.txt"] and sorted(p.name for p in out.iterdir()) == names
    assert load_model(out).source["checksum"] == load_model(src).source["checksum"]
    assert _sha256s(src) == before
    # a conversion that fails (truncated weights) leaves the earlier one whole, and nothing of its own
    import shutil
    shutil.copytree(src, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert convert_main([str(tmp_path / "cut"), "--out", str(out), "--overwrite"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert _sha256s(out) == again and sorted(p.name for p in out.iterdir()) == sorted(names)
    # a user's file where the converter writes one: refused before any work, the file unchanged
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("the user's tokenizer")
    assert convert_main([str(src), "--out", str(other), "--overwrite"]) == 2
    assert "tokenizer.json exists and isojax did not write it" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["tokenizer.json"]
    assert (other / "tokenizer.json").read_text() == "the user's tokenizer"


@pytest.mark.slow
def test_hub_names_resolve_through_cache(tiny_checkpoint, tmp_path, monkeypatch):
    """A preset name + revision goes to huggingface_hub (stand-in here) and its snapshot is read
    directly: no converted copy is written."""
    src, model = tiny_checkpoint
    calls = []

    def fake_resolve(repo, revision=None, **kw):
        calls.append((repo, revision))
        return src

    import isojax.hf.files
    monkeypatch.setattr(isojax.hf.files, "resolve_checkpoint", fake_resolve)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    ids = np.arange(15)
    first = load_model("pythia-70m-deduped", revision="step1000")
    # the JSON files first, then one copy of the weights (what the real client downloads: test_hub.py)
    assert calls and set(calls) == {("EleutherAI/pythia-70m-deduped", "step1000")}
    assert first.source["name"] == "EleutherAI/pythia-70m-deduped"
    assert first.source["revision"] == "step1000" and first.weights == "trained"
    assert max_rel_error(first.hidden_states(ids), hf_states(model, ids)) < 1e-5
    assert not (tmp_path / "cache").exists()


def test_checksum_reads_samples_of_the_files(tiny_checkpoint, tmp_path):
    """The checkpoint checksum changes with any weight file's contents (here one byte in the
    middle of the data), not only with its size or header."""
    import shutil

    src, _ = tiny_checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    first = load_model(copy).source["checksum"]
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert load_model(copy).source["checksum"] != first
    assert load_model(src).source["checksum"] == first  # same files, same checksum
