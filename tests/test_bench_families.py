"""bench/bench_families.py on CPU: every family's preset shrunk by --tiny builds the same model in
isojax and in transformers, and a tiny run of the whole bench writes its table and JSON."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import bench_families  # noqa: E402
from bench.peer_hf import build_family_model, decoder_layers  # noqa: E402


def test_tiny_presets_are_the_same_model_on_both_sides():
    """--tiny keeps each family's options (grouping, ratios, biases, ties): transformers' base model of
    the shrunk config.json has isojax's parameters (less an untied LM head and its bias, which AutoModel leaves out)."""
    for family, name, raw, cfg in bench_families.family_models(list(bench_families.FAMILIES), shrink=True):
        assert cfg.family == family and cfg.hidden_size == 64 and cfg.num_layers == 2
        model = build_family_model(raw, device="cpu", dtype=torch.float32)
        head = (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size) + cfg.unembed_bias * cfg.vocab_size
        assert sum(p.numel() for p in model.parameters()) == cfg.param_count() - head, name
        assert len(decoder_layers(model)) == 2


@pytest.mark.slow  # ~25 s on 2 cores: one family's compile and both sides' runs
def test_tiny_bench_run_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_families.main(["--tiny", "--families", "llama", "--tokens", "3000", "--peer-seconds", "1"]) == 0
    out = json.loads((tmp_path / "bench_families.json").read_text())
    (row,) = out["rows"]
    assert row["family"] == "llama" and row["preset"] == "llama-1b"
    assert "isojax_error" not in row and "peer_error" not in row
    assert row["isojax"]["tokens_per_s"] > 0 and row["peer"]["tokens_per_s"] > 0
    assert row["kernels"] == {"attention": "xla", "mlp_kernel": "xla", "norm_kernel": "xla"}  # CPU, float32
    text = (tmp_path / "bench_families.txt").read_text()
    assert "llama-1b" in text and "xla/xla/xla" in text


@pytest.mark.slow  # ~1 min on 2 cores: two processes, one importing each side
def test_per_process_gathers_both_sides_of_a_row(tmp_path, monkeypatch):
    """--per-process: the family's peer and its isojax each measured in a process of its own, both
    sides' rates gathered into one row of the table and JSON."""
    monkeypatch.setenv("OUT", str(tmp_path))
    args = ["--tiny", "--per-process", "--families", "llama", "--tokens", "3000", "--peer-seconds", "1"]
    assert bench_families.main(args) == 0
    out = json.loads((tmp_path / "bench_families.json").read_text())
    assert out["per_process"] and [row["family"] for row in out["rows"]] == ["llama"]
    row = out["rows"][0]
    assert "isojax_error" not in row and "peer_error" not in row, row
    assert row["isojax"]["tokens_per_s"] > 0 and row["peer"]["tokens_per_s"] > 0
    assert row["isojax"]["mfu"] == pytest.approx(row["isojax"]["tokens_per_s"] * row["isojax"]["flops_per_token"]
                                                 / out["bf16_flops"])
    assert row["kernels"] and out["torch"]
    text = (tmp_path / "bench_families.txt").read_text()
    assert "llama-1b" in text and "nan" not in text
