"""The converted checkpoint: `isojax.json` (config, checksum, source) + `params/` (Orbax)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from isojax.model.config import ModelConfig
from isojax.errors import UserError

META = "isojax.json"
FORMAT = 1


def is_converted(path: Path) -> bool:
    return (Path(path) / META).is_file() and (Path(path) / "params").is_dir()


def save_converted(path: Path, cfg: ModelConfig, params: dict, checksum: str, source: dict) -> None:
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
    meta = {"format": FORMAT, "config": cfg.to_dict(), "checksum": checksum, "source": source,
            "param_dtype": str(jax.tree.leaves(params)[0].dtype)}
    (path / META).write_text(json.dumps(meta, indent=2) + "\n")


def load_converted(path: Path, dtype=jnp.float32):
    """-> (config, params on the default device in `dtype`, metadata)."""
    path = Path(path).absolute()
    try:
        meta = json.loads((path / META).read_text())
        cfg = ModelConfig(**meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path / META}: unreadable isojax checkpoint metadata ({e})") from None
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path / "params")
            tree = getattr(stored, "item_metadata", stored)
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), dtype), tree)
            params_np = ckptr.restore(path / "params", abstract)
    except Exception as e:  # Orbax raises many types for a damaged checkpoint
        raise UserError(f"{path}: damaged or incomplete Orbax checkpoint ({type(e).__name__}: {e})") from None
    return cfg, jax.tree.map(jnp.asarray, params_np), meta


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONVERTED_NAMES = (META, "params", *TOKENIZER_FILES)  # every name write_converted may write


def write_converted(src: Path, folder: Path, source: dict | None = None) -> None:
    """Hugging Face dir -> Orbax checkpoint (float32) + isojax.json + tokenizer files, written into
    `folder` (an empty staging folder: python -m isojax.convert commits it into --out)."""
    import shutil

    import numpy as np

    from isojax.hf.checkpoint import read_hf_tensors
    from isojax.hf.family import tensors_to_params
    cfg, tensors, checksum = read_hf_tensors(Path(src))
    params = tensors_to_params({k: np.asarray(v, np.float32) for k, v in tensors.items()}, cfg)
    for fname in TOKENIZER_FILES:
        if (Path(src) / fname).is_file():
            shutil.copy2(Path(src) / fname, Path(folder) / fname)
    save_converted(folder, cfg, params, checksum, source or {"name": str(src), "revision": None})
