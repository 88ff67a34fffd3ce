"""Presets: the Hugging Face config.json files in `configs/` (plus isojax's `hub_id` and
`_comment`), read by the family registry (isojax.hf.family)."""

from __future__ import annotations

import json
from pathlib import Path

from isojax.errors import UserError
from isojax.hf.family import from_hf_dict
from isojax.model.config import ModelConfig


def _configs_dir() -> Path:
    """configs/ of a source checkout, else the copy installed as package data of isojax.configs."""
    here = Path(__file__).resolve().parents[3] / "configs"
    if here.is_dir():
        return here
    import importlib.resources
    return Path(str(importlib.resources.files("isojax.configs")))


CONFIGS_DIR = _configs_dir()


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def _preset_json(stem: str) -> dict | None:
    """The preset file's dict (a Hugging Face config.json plus isojax's `hub_id` and `_comment`), or None."""
    path = CONFIGS_DIR / f"{stem}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def shape_only(name: str) -> bool:
    """Whether `name` is a preset of shapes with no hub model behind it (no `hub_id` in its file:
    falcon-mqa-1b, mistral-1b): only random:<name> runs it."""
    raw = _preset_json(name) if "/" not in name else None
    return raw is not None and not raw.get("hub_id")


def base_preset(name: str) -> str | None:
    """The preset of a hub model's name: 'pythia-410m-deduped' -> 'pythia-410m' (same shapes; the
    -deduped twins are GPT-NeoX's only), 'qwen2-1.5b' -> 'qwen2-1.5b'; None if the name is no preset
    or a preset of shapes only (shape_only)."""
    if "/" in name:
        return None
    for stem in dict.fromkeys((name, name.removesuffix("-deduped"))):
        raw = _preset_json(stem)
        if raw is not None and raw.get("hub_id") and (stem == name or raw.get("model_type", "gpt_neox") == "gpt_neox"):
            return stem
    return None


def preset(name: str) -> ModelConfig:
    """The config of a preset name (a hub model's, a -deduped twin's, or a shape-only preset's)."""
    base = base_preset(name) or (name if shape_only(name) else None)
    if base is None:
        raise UserError(f"unknown preset {name!r}; presets: {', '.join(preset_names())} (and -deduped variants "
                        "of the Pythia ones)")
    raw = _preset_json(base)
    raw.pop("_comment", None)
    return from_hf_dict(raw, name=name)


def hub_id(name: str) -> str | None:
    """Hub repository of a preset name ('pythia-70m-deduped' -> 'EleutherAI/pythia-70m-deduped',
    'llama-1b' -> its file's hub_id, TinyLlama/TinyLlama_v1.1); None for a shape-only preset (its
    random weights take the bundled tokenizer)."""
    base = base_preset(name)
    if base is None:
        if shape_only(name):
            return None
        raise UserError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    repo = _preset_json(base)["hub_id"]
    return repo if name == base else f"{repo.split('/')[0]}/{name}"
