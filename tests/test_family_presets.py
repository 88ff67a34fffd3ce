"""The ~1B presets of the families other than GPT-NeoX (configs/*.json, random:<preset>): each
parses to its family at its nominal size, matches what transformers builds from the same file,
names its hub model (or none, for the shape-only ones), and its random weights get a tokenizer
whose ids fit its vocabulary offline."""

from __future__ import annotations

import json

import pytest

from isojax.errors import UserError
from isojax.hf.family.presets import CONFIGS_DIR, base_preset, hub_id, preset, preset_names, shape_only

# preset -> (family, nominal parameters (the hub model's published size, or the scaled target), hub id)
FAMILY_PRESETS = {
    "gpt2-xl": ("gpt2", 1.558e9, "openai-community/gpt2-xl"),
    "opt-1.3b": ("opt", 1.316e9, "facebook/opt-1.3b"),
    "falcon-mqa-1b": ("falcon", 1.0e9, None),
    "llama-1b": ("llama", 1.1e9, "TinyLlama/TinyLlama_v1.1"),
    "mistral-1b": ("mistral", 1.0e9, None),
    "qwen2-1.5b": ("qwen2", 1.54e9, "Qwen/Qwen2-1.5B"),
    "olmo-1b": ("olmo", 1.18e9, "allenai/OLMo-1B-hf"),
    "olmo2-1b": ("olmo2", 1.48e9, "allenai/OLMo-2-0425-1B"),
    "gemma-2b": ("gemma", 2.51e9, "google/gemma-2b"),
    "phi-2": ("phi", 2.78e9, "microsoft/phi-2"),
}


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_family_preset_parses_at_its_size(name):
    family, nominal, repo = FAMILY_PRESETS[name]
    assert name in preset_names()
    cfg = preset(name)
    assert cfg.family == family and cfg.name == name
    assert abs(cfg.param_count() / nominal - 1) < 0.03, cfg.param_count()
    assert hub_id(name) == repo
    assert shape_only(name) == (repo is None)
    assert base_preset(name) == (name if repo else None)
    assert base_preset(f"{name}-deduped") is None  # the -deduped twins are Pythia's only


def test_pythia_presets_unchanged():
    assert base_preset("pythia-410m-deduped") == "pythia-410m"
    assert hub_id("pythia-410m-deduped") == "EleutherAI/pythia-410m-deduped"
    assert hub_id("pythia-70m") == "EleutherAI/pythia-70m"
    assert preset("pythia-1b").param_count() == 1_011_781_632
    with pytest.raises(UserError, match="unknown preset"):
        hub_id("pythia-3b")


def test_transformers_builds_the_same_parameters():
    """The preset file read by transformers (meta device: nothing allocated) has isojax's count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in FAMILY_PRESETS:
        raw = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
        raw = {k: v for k, v in raw.items() if k not in ("hub_id", "_comment")}
        config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == preset(name).param_count(), name


def test_shape_only_preset_is_refused_without_random():
    from isojax import load_model
    with pytest.raises(UserError, match="random:mistral-1b"):
        load_model("mistral-1b")


@pytest.mark.parametrize("name", ["mistral-1b", "gpt2-xl", "opt-1.3b"])
def test_random_weights_tokenizer_fits_the_vocabulary(name):
    """Offline, the random weights of a preset whose vocabulary is smaller than the bundled
    GPT-NeoX tokenizer's take that tokenizer cut to the vocabulary: ids in range, text round-trips."""
    from isojax.hf.tokenizer import load_tokenizer
    cfg = preset(name)
    tok, desc = load_tokenizer(None, cfg, hub_repo=None)
    assert tok.get_vocab_size() <= cfg.vocab_size and f"first {cfg.vocab_size} ids" in desc
    text = "The quick brown fox, naïve café 日本語 🎉\n\tdef f(x): return x ** 2  # spaces    here"
    ids = tok.encode(text).ids
    assert max(ids) < cfg.vocab_size and tok.decode(ids) == text
    with pytest.raises(UserError, match="larger than the model"):  # a checkpoint folder's ids are never cut
        from isojax.hf.tokenizer import BUNDLED, _checked
        from tokenizers import Tokenizer
        _checked(Tokenizer.from_file(str(BUNDLED)), cfg, "bundled", True)


@pytest.mark.slow  # ~16 s on 2 cores
def test_random_shape_only_preset_measures_offline(tmp_path, monkeypatch):
    """measure("random:<shape-only preset>") end to end, offline: a tiny Mistral-shaped preset
    (vocabulary 320, below the bundled tokenizer's) gets the cut tokenizer and every id in range."""
    import isojax
    from isojax.hf.family import presets
    configs = tmp_path / "configs"
    configs.mkdir()
    raw = json.loads((CONFIGS_DIR / "mistral-1b.json").read_text())
    raw.update(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=224)
    (configs / "tiny-mistral.json").write_text(json.dumps(raw))
    monkeypatch.setattr(presets, "CONFIGS_DIR", configs)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "Naïve café, 日本語. " * 20)
    results = isojax.measure("random:tiny-mistral", [str(text)], seq_len=64, progress=False)
    assert results.manifest["tokenizer"] == "gpt-neox-20b (bundled, first 320 ids)"
    assert results.metrics["tokens"] > 300 and len(results.metrics["layers"]) == 4


def test_help_and_package_description_name_every_family():
    """extract --help and pyproject's description name the eleven families isojax runs, not GPT-NeoX alone."""
    import pathlib
    import tomllib
    from isojax.extract import build_parser
    from isojax.hf.family import FAMILIES
    names = {"gpt_neox": "GPT-NeoX", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "olmo": "OLMo",
             "olmo2": "OLMo-2", "gpt2": "GPT-2", "opt": "OPT", "falcon": "Falcon", "gemma": "Gemma", "phi": "Phi"}
    assert set(names) == set(FAMILIES)
    help_text = " ".join(build_parser().format_help().split())
    root = pathlib.Path(__file__).resolve().parents[1]
    description = tomllib.loads((root / "pyproject.toml").read_text())["project"]["description"]
    for text in (help_text, description):
        assert all(name in text for name in names.values()), text[:400]
