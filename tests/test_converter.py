"""Hugging Face -> Orbax converter: round trip, sharded inputs, bad checkpoints, hub path stand-in."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import build_hf_checkpoint, hf_states, max_rel_error
from converters.__main__ import main as convert_main
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
    proc = subprocess.run([sys.executable, "-m", "converters", str(tmp_path / "missing"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error:")


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
