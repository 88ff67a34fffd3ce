"""GPT-NeoX (Pythia, GPT-NeoX-20B): its strict config.json reader, its checkpoint's tensors
(isojax.model.decoder's GPT-NeoX parameter tree, layer weights stacked on axis 0) and its weight names.

torch `nn.Linear` stores weight [out, in]; Flax `Dense` stores kernel [in, out]. The fused
`query_key_value` keeps Hugging Face's column order (per head: q, k, v), which the model's
reshape to [.., H, 3, K] relies on. Every expected tensor must be present with the expected
shape; anything else is refused with a message naming the tensor.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from isojax.errors import UserError
from isojax.hf.family.base import IRRELEVANT_KEYS, Family, WeightNames
from isojax.model.config import ModelConfig

LAYER_LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def read(raw: dict) -> dict:
    cfg = dict(raw)

    def check(key, ok, expected):
        if key in cfg and cfg[key] is not None and not ok(cfg[key]):
            raise UserError(f"config attribute {key}={cfg[key]!r} is not implemented (isojax supports {expected})")

    check("attention_bias", lambda v: v is True, "attention_bias=true")
    check("rope_scaling", lambda v: False, "no rope_scaling")
    check("sliding_window", lambda v: False, "no sliding_window")
    num_heads = cfg.get("num_attention_heads")
    if "head_dim" in cfg and cfg["head_dim"] is not None and num_heads:
        check("head_dim", lambda v: v * num_heads == cfg.get("hidden_size"), "head_dim = hidden_size / heads")

    rotary_pct = cfg.get("rotary_pct", 0.25)
    rotary_base = cfg.get("rotary_emb_base", 10000.0)
    rope = cfg.get("rope_parameters")
    if rope is not None:
        extra = set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor"}
        if rope.get("rope_type", "default") != "default" or extra:
            raise UserError(f"rope_parameters {rope!r} not implemented (isojax supports the default rotary embedding)")
        rotary_pct = rope.get("partial_rotary_factor", rotary_pct)
        rotary_base = rope.get("rope_theta", rotary_base)

    handled = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "rotary_pct", "rotary_emb_base", "rope_parameters", "max_position_embeddings",
               "layer_norm_eps", "use_parallel_residual", "attention_bias", "rope_scaling", "head_dim",
               "sliding_window"}
    unknown = sorted(set(cfg) - handled - IRRELEVANT_KEYS)
    if unknown:
        raise UserError(f"config attribute(s) {', '.join(unknown)} not implemented by isojax's GPT-NeoX; "
                        "refusing rather than computing something different")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)}")
    return dict(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]), hidden_act=cfg.get("hidden_act", "gelu"),
        rotary_pct=float(rotary_pct), rotary_emb_base=float(rotary_base),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        use_parallel_residual=bool(cfg.get("use_parallel_residual", True)))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Hugging Face tensor name -> shape for a GPTNeoXForCausalLM checkpoint."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    linear_out_in = {"attention.query_key_value": (3 * d, d), "attention.dense": (d, d),
                     "mlp.dense_h_to_4h": (f, d), "mlp.dense_4h_to_h": (d, f)}
    shapes = {"gpt_neox.embed_in.weight": (v, d), "embed_out.weight": (v, d),
              "gpt_neox.final_layer_norm.weight": (d,), "gpt_neox.final_layer_norm.bias": (d,)}
    for i in range(cfg.num_layers):
        p = f"gpt_neox.layers.{i}."
        for name, (o, n) in linear_out_in.items():
            shapes[p + name + ".weight"] = (o, n)
            shapes[p + name + ".bias"] = (o,)
        for name in LAYER_NORMS:
            shapes[p + name + ".weight"] = (d,)
            shapes[p + name + ".bias"] = (d,)
    return shapes


class GPTNeoXFamily(Family):
    """GPT-NeoX's tensors go to the model's GPT-NeoX tree (cfg.neox_tree) by hand, not through a Layout."""

    def hf_tensors(self, read: Callable[[str], np.ndarray], names: list[str], cfg: ModelConfig) -> dict:
        """Every tensor a GPT-NeoX of this config needs, as stored (checked for presence and shape)."""
        shapes = expected_shapes(cfg)
        have = set(names)
        if "embed_out.weight" not in have and "lm_head.weight" in have:  # the in-memory name in transformers 5
            read = (lambda r: lambda n: r("lm_head.weight" if n == "embed_out.weight" else n))(read)
            have = (have - {"lm_head.weight"}) | {"embed_out.weight"}
        # Buffers some exporters keep (rotary inv_freq, attention masks) carry no weights.
        extra = sorted(n for n in have - set(shapes)
                       if not n.endswith((".inv_freq", ".masked_bias", ".attention.bias")))
        missing = [n for n in shapes if n not in have]
        if missing:
            raise UserError(f"checkpoint lacks {len(missing)} tensor(s) of a GPT-NeoX with {cfg.num_layers} "
                            f"layers, e.g. {missing[0]} (truncated or mismatched checkpoint?)")
        if extra:
            raise UserError(f"checkpoint has tensor(s) this GPT-NeoX config does not expect, e.g. {extra[0]} "
                            "(config and weights mismatched?)")
        tensors = {}
        for name, shape in shapes.items():
            tensors[name] = arr = read(name)
            if tuple(arr.shape) != shape:
                raise UserError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {shape}")
        return tensors

    def tensors_to_params(self, tensors: dict, cfg: ModelConfig, xp=np) -> dict:
        """Hugging Face tensors -> the parameter tree (layers stacked, kernels [in, out]), with
        `xp` = numpy on the host or jax.numpy (inside jit: the stacking and transposes run on the
        device, where they cost nothing next to the host's strided copies)."""

        def stacked(suffix, transpose=False):
            arrs = [tensors[f"gpt_neox.layers.{i}.{suffix}"] for i in range(cfg.num_layers)]
            return xp.stack([a.T if transpose else a for a in arrs])

        attention, block = {}, {}
        for name in LAYER_LINEARS:
            group, leaf = name.split(".")
            dest = attention if group == "attention" else block
            dest[leaf] = {"kernel": stacked(name + ".weight", transpose=True), "bias": stacked(name + ".bias")}
        block["attention"] = attention
        for name in LAYER_NORMS:
            block[name] = {"scale": stacked(name + ".weight"), "bias": stacked(name + ".bias")}
        embed_out = tensors["embed_out.weight"].T
        return {
            "embed_in": tensors["gpt_neox.embed_in.weight"],
            "embed_out": xp.ascontiguousarray(embed_out) if xp is np else embed_out,
            "final_layer_norm": {"scale": tensors["gpt_neox.final_layer_norm.weight"],
                                 "bias": tensors["gpt_neox.final_layer_norm.bias"]},
            "layers": {"block": block},
        }


FAMILIES = {"gpt_neox": GPTNeoXFamily(read, None, WeightNames(
    "gpt_neox.", "embed_in.weight", ("embed_out.weight", "lm_head.weight"), "layernorm",
    "final_layer_norm.weight", "final_layer_norm.bias"))}
