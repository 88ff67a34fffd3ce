"""Which tensors of a checkpoint are its embedding, unembedding and final norm, per model family.

The family is config.json's `model_type`; each family's names are its file's (isojax.hf.family:
`WeightNames`). They are apart from the family's whole forward layout on purpose: `weights` reads
three tensors of any checkpoint of a family, also of configurations the forward refuses (a
Llama-3 rope scaling, OPT-350m's projections). A name under the base model
(`transformer.wte.weight`) is also found without that prefix (`wte.weight`): the base model saved
alone, and older hub uploads of GPT-2 and OPT, store it so.

Tied embeddings (config.json's `tie_word_embeddings`, else the family's default in
transformers) are one matrix, measured once. Where a tied checkpoint stores an unembedding
anyway, transformers ties the two only if they are equal, and so does `locate`'s caller
(`command.analyze_checkpoint`).

Final norms: `layernorm` (weight g and bias b), `rmsnorm` (Llama, Mistral, Qwen2, OLMo-2, Gemma:
weight only; every statistic of b is null; Gemma's gain g is 1 + its stored weight, `norm_offset`),
`layernorm_no_affine` (OLMo-1, or OPT with
`layer_norm_elementwise_affine` false: no weights at all; every statistic is null) and `none`
(OPT-350m and other OPT with `do_layer_norm_before` false: no final norm).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from isojax.errors import UserError
from isojax.hf.family import FAMILIES as _REGISTRY

FAMILIES = {model_type: family.weights for model_type, family in _REGISTRY.items()}


@dataclasses.dataclass(frozen=True)
class Tensors:
    """The stored names of one checkpoint's tensors (None: it has no such tensor)."""
    family: str
    tied: bool                 # as config.json says; the caller checks a stored unembedding
    embed: str
    unembed: str | None        # None: tied and no unembedding stored
    norm: str                  # layernorm | rmsnorm | layernorm_no_affine | none
    norm_g: str | None
    norm_b: str | None
    norm_offset: float = 0.0   # g = norm_offset + the stored weight


def all_names() -> list[str]:
    """Every name any family's tensors may be stored under (to pick the shards to download)."""
    names = set()
    for f in FAMILIES.values():
        for n in (f.embed, f.norm_g, f.norm_b):
            if n:
                names |= {f.prefix + n, n}
        names |= set(f.unembed)
    return sorted(names)


def read_config(directory: pathlib.Path) -> dict:
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json, which names the model family (model_type); "
                        "use --tensor NAME to measure any 2-D tensor")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: not a JSON object")
    return cfg


def locate(cfg: dict, names, where) -> Tensors:
    """The tensors of the checkpoint at `where` whose config.json is `cfg` and whose tensor
    names are `names`; UserError for an unknown family or a tensor it lacks."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        what = f"model_type {model_type!r}" if model_type else "no model_type"
        raise UserError(f"{where}: config.json has {what}; the weights command knows "
                        f"{', '.join(sorted(FAMILIES))} (use --tensor NAME to measure any 2-D tensor)")
    fam = FAMILIES[model_type]
    names = set(names)

    def find(name: str | None, prefixed: bool = True) -> str | None:
        forms = [fam.prefix + name, name] if prefixed else [name]
        return next((n for n in forms if n in names), None) if name else None

    def need(name: str, prefixed: bool = True) -> str:
        found = find(name, prefixed)
        if found is None:
            raise UserError(f"{where} holds no {fam.prefix if prefixed else ''}{name}, which a {model_type} "
                            "checkpoint has (model_type in config.json); use --tensor NAME to measure any "
                            "2-D tensor")
        return found

    tie = cfg.get("tie_word_embeddings")
    tied = fam.tied if tie is None else bool(tie)
    unembed = next((n for n in fam.unembed if n in names), None)
    if unembed is None and not tied:
        need(fam.unembed[0], prefixed=False)
    norm = fam.final_norm(cfg)
    has = norm in ("layernorm", "rmsnorm")
    return Tensors(model_type, tied, need(fam.embed), unembed, norm, need(fam.norm_g) if has else None,
                   need(fam.norm_b) if norm == "layernorm" else None, fam.norm_offset)
