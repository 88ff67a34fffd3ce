"""What every family file (isojax.hf.family.<family>) is made of: `Fields`, the allowlist reader of a
Hugging Face `config.json`; `Layout`, which tensors of a checkpoint make which parameter of
isojax.model.decoder's tree; `WeightNames`, its embedding, unembedding and final norm for
`isojax.weights`; and `Family`, the three together.

A config.json attribute is read (implemented), checked to have the one value implemented, or
known not to change an inference forward pass (IRRELEVANT_KEYS, and each family's own dropout and
head settings); any other is refused by name, so a checkpoint we would compute wrongly never runs.

A layout lists, per parameter of the tree, the Hugging Face tensors it is made of and how: torch
`nn.Linear` weights [out, in] are transposed to Flax kernels [in, out]; GPT-2's `Conv1D` weights
are [in, out] already; q, k and v go into one projection ordered [q heads | k heads | v heads]
(isojax.model.decoder). Every expected tensor must be present with the expected shape, and
nothing else may be: a mismatch is refused by name. Checkpoints saved from the bare model (GPT-2's
`h.0...`, OPT's `decoder...`) lack the prefix the LM-head class adds; both spellings are read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from isojax.errors import UserError
from isojax.model.config import ModelConfig

# Attributes that do not change the hidden states of an inference forward pass.
IRRELEVANT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "use_cache", "attention_dropout", "hidden_dropout",
    "classifier_dropout", "is_decoder", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tokenizer_class", "task_specific_params", "problem_type",
    "id2label", "label2id", "num_labels", "finetuning_task", "prefix", "add_cross_attention",
    "tie_encoder_decoder", "chunk_size_feed_forward", "is_encoder_decoder", "pruned_heads",
    "hub_id", "tie_word_embeddings", "use_flash_attention", "gradient_checkpointing",
})


class Fields:
    """A config.json dict read attribute by attribute; `finish` refuses every attribute never read
    (but IRRELEVANT_KEYS and the family's own `irrelevant` ones)."""

    def __init__(self, raw: dict, family: str, irrelevant=frozenset()):
        self.raw, self.family, self.irrelevant, self.read = raw, family, set(irrelevant), set()

    def get(self, key: str, default=None):
        """The value (None in the file counts as absent)."""
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str):
        self.read.add(key)
        if self.raw.get(key) is None:
            raise UserError(f"config.json of this {self.family} model lacks {key}")
        return self.raw[key]

    def only(self, key: str, allowed, default=None):
        """Accept the attribute only at the value(s) implemented (absent: `default`)."""
        value = self.get(key, default)
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if value not in allowed:
            raise UserError(f"config attribute {key}={value!r} of {self.family} is not implemented "
                            f"(isojax supports {' or '.join(repr(a) for a in allowed)})")
        return value

    def rope(self, default_theta: float = 10000.0, default_fraction: float = 1.0) -> tuple[float, float]:
        """(rotary fraction, base) from rope_parameters or the older rope_theta / rope_scaling;
        any rope_type but the default (llama3, yarn, linear, dynamic, ...) is refused by name."""
        self.only("rope_scaling", (None,))
        theta = self.get("rope_theta", default_theta)
        fraction = self.get("partial_rotary_factor", default_fraction)
        rope = self.get("rope_parameters")
        if rope is not None:
            kind = rope.get("rope_type", rope.get("type", "default"))
            extra = set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
            if kind != "default" or extra:
                raise UserError(f"rope_parameters {rope!r} of {self.family}: rope_type {kind!r} is not "
                                "implemented (isojax supports the default rotary embedding)")
            theta = rope.get("rope_theta", theta)
            fraction = rope.get("partial_rotary_factor", fraction)
        return float(fraction), float(theta)

    def finish(self, **fields) -> dict:
        """The ModelConfig fields, once every attribute is accounted for."""
        unknown = sorted(set(self.raw) - self.read - IRRELEVANT_KEYS - self.irrelevant
                         - {"auto_map"})  # auto_map names remote code, which isojax never runs
        if unknown:
            raise UserError(f"config attribute(s) {', '.join(unknown)} not implemented by isojax's {self.family}; "
                            "refusing rather than computing something different")
        return dict(family=self.family, **fields)


Combine = Callable  # (list of tensors, xp) -> the parameter


@dataclasses.dataclass
class Layout:
    prefix: str                              # the LM-head class's prefix of the trunk's names
    layers: str                              # the layer list under the prefix ("model.layers.")
    shapes: dict[str, tuple]                 # every tensor, by its full name -> shape
    params: list[tuple[tuple, list[str], Combine]]  # tree path, source tensors, how to combine them
    ignored: str = r"$^"                     # buffers some exporters keep (a regex of whole names)


def linear(arrs, xp):
    return arrs[0].T


def as_is(arrs, xp):
    return arrs[0]


def qkv_kernel(arrs, xp):
    """[q; k; v] weights [out, in] -> one kernel [in, (H + 2G) K]."""
    return xp.concatenate([a.T for a in arrs], axis=1)


def qkv_bias(arrs, xp):
    return xp.concatenate(arrs, axis=0)


def norm_params(layout_layer: dict, params: list, d: int, pairs, bias: bool = True) -> None:
    """Add each (our norm, their norm) pair's weight (and bias) to a layer's tensors and params."""
    for ours, theirs in pairs:
        layout_layer[f"{theirs}.weight"] = (d,)
        params.append(((ours, "scale"), [f"{theirs}.weight"], as_is))
        if bias:
            layout_layer[f"{theirs}.bias"] = (d,)
            params.append(((ours, "bias"), [f"{theirs}.bias"], as_is))


def finish(cfg: ModelConfig, layout: Layout, layer: dict) -> Layout:
    """Add the per-layer tensors (`layer`: suffix -> shape) and the unembedding unless tied."""
    for i in range(cfg.num_layers):
        layout.shapes.update({f"{layout.layers}{i}.{suffix}": shape for suffix, shape in layer.items()})
    if not cfg.tie_word_embeddings:
        layout.shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        layout.params.append((("embed_out",), ["lm_head.weight"], linear))
    if cfg.unembed_bias:
        layout.shapes["lm_head.bias"] = (cfg.vocab_size,)
        layout.params.append((("embed_out_bias",), ["lm_head.bias"], as_is))
    return layout


@dataclasses.dataclass(frozen=True)
class WeightNames:
    """Where `isojax.weights` finds the embedding, unembedding and final norm of the family's
    checkpoints (transformers' `*ForCausalLM` names, checked against `save_pretrained`'s)."""
    prefix: str                # the base model's prefix of embed and norm names
    embed: str                 # under prefix
    unembed: tuple[str, ...]   # untied unembedding, top level; the first is the usual name
    norm: str                  # layernorm | rmsnorm | layernorm_no_affine
    norm_g: str | None = None  # under prefix
    norm_b: str | None = None
    tied: bool = False         # transformers' default of tie_word_embeddings
    norm_offset: float = 0.0   # the gain applied is norm_offset + the stored weight (Gemma: 1)
    # the final norm's kind where config.json changes it (OPT), else `norm`
    norm_of: Callable[[dict], str] | None = None

    def final_norm(self, cfg: dict) -> str:
        return self.norm if self.norm_of is None else self.norm_of(cfg)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its config.json reader (raw dict -> ModelConfig fields), its checkpoint layout
    and its weight names. `hf_tensors` and `tensors_to_params` follow the layout."""
    read: Callable[[dict], dict]
    layout: Callable[[ModelConfig], Layout] | None
    weights: WeightNames

    def hf_tensors(self, read: Callable[[str], np.ndarray], names: list[str], cfg: ModelConfig) -> dict:
        """Every tensor this config needs, under the LM-head class's names, as stored (checked for
        presence and shape; anything else in the checkpoint is refused)."""
        layout = self.layout(cfg)
        stored = {}  # our spelling -> the checkpoint's
        for name in names:
            full = name if name.startswith((layout.prefix, "lm_head.")) else layout.prefix + name
            stored[full] = name
        if cfg.tie_word_embeddings:  # some exporters write the tied copy too; it carries nothing new
            stored.pop("lm_head.weight", None)
        extra = sorted(n for n in set(stored) - set(layout.shapes)
                       if not n.endswith(".inv_freq") and not re.fullmatch(layout.ignored, n))
        missing = [n for n in layout.shapes if n not in stored]
        if missing:
            raise UserError(f"checkpoint lacks {len(missing)} tensor(s) of a {cfg.family} with {cfg.num_layers} "
                            f"layers, e.g. {missing[0]} (truncated or mismatched checkpoint?)")
        if extra:
            raise UserError(f"checkpoint has tensor(s) this {cfg.family} config does not expect, e.g. {extra[0]} "
                            "(config and weights mismatched?)")
        tensors = {}
        for name, shape in layout.shapes.items():
            tensors[name] = arr = read(stored[name])
            if tuple(arr.shape) != shape:
                raise UserError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {shape}")
        return tensors

    def tensors_to_params(self, tensors: dict, cfg: ModelConfig, xp=np) -> dict:
        """Hugging Face tensors -> the parameter tree (layers stacked on axis 0), with `xp` numpy on
        the host or jax.numpy (inside jit: the stacking and transposes run on the device)."""
        layout = self.layout(cfg)
        tree: dict = {}
        for path, sources, combine in layout.params:
            if sources[0] not in tensors:  # a layer's: sources are suffixes of each layer's names
                value = xp.stack([combine([tensors[f"{layout.layers}{i}.{s}"] for s in sources], xp)
                                  for i in range(cfg.num_layers)])
                path = ("layers", "block", *path)
            else:
                value = combine([tensors[s] for s in sources], xp)
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = xp.ascontiguousarray(value) if xp is np else value
        return tree
