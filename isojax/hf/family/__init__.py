"""The model families isojax runs, one file each (README "Model families"): model_type ->
`Family` (isojax.hf.family.base): its config.json reader, its checkpoint's tensor layout and its
weight names for `isojax.weights`. The presets (configs/*.json, Hugging Face config.json files)
are read through it by isojax.hf.family.presets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from isojax.errors import UserError
from isojax.hf.family import falcon, gemma, gpt2, gpt_neox, llama, olmo, opt, phi
from isojax.hf.family.base import Family
from isojax.model.config import ModelConfig

FAMILIES: dict[str, Family] = {**gpt_neox.FAMILIES, **llama.FAMILIES, **olmo.FAMILIES, **gpt2.FAMILIES,
                               **opt.FAMILIES, **falcon.FAMILIES, **gemma.FAMILIES,
                               **phi.FAMILIES}


def from_hf_dict(raw: dict, name: str = "") -> ModelConfig:
    """Build a config from a Hugging Face `config.json` dict of a supported family, refusing what
    we don't implement."""
    model_type = raw.get("model_type", "gpt_neox")
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported; isojax runs {', '.join(FAMILIES)}")
    return ModelConfig(name=name, **FAMILIES[model_type].read(dict(raw)))


def read_hf_config(path: str | Path, name: str = "") -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable config.json ({e})") from None
    return from_hf_dict(raw, name=name)


def hf_tensors(read: Callable[[str], np.ndarray], names: list[str], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every tensor this config needs, as stored (checked for presence and shape)."""
    return FAMILIES[cfg.family].hf_tensors(read, names, cfg)


def tensors_to_params(tensors: dict, cfg: ModelConfig, xp=np) -> dict:
    """Hugging Face tensors -> the model's parameter tree (layers stacked), with `xp` numpy or
    jax.numpy."""
    return FAMILIES[cfg.family].tensors_to_params(tensors, cfg, xp)
