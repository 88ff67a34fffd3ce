"""OLMo and OLMo-2: the Llama trunk (isojax.hf.family.llama) with OLMo's LayerNorm without
parameters and q/k/v clipping, or OLMo-2's norms after each sublayer and RMSNorms over all heads
of q and of k."""

from __future__ import annotations

from isojax.hf.family.llama import WEIGHTS, fields
from isojax.hf.family.llama import layout as llama_layout
from isojax.hf.family.base import Family, Fields, WeightNames
from isojax.model.config import ModelConfig


def read(raw: dict) -> dict:
    family = raw["model_type"]
    c = Fields(raw, family)
    out = fields(c, c.only("hidden_act", ("silu",), "silu"))
    if family == "olmo":
        clip = c.get("clip_qkv")
        # HF's OlmoLayerNorm: F.layer_norm without weight or bias, eps fixed at 1e-5
        out.update(norm="layer_no_affine", layer_norm_eps=1e-5, clip_qkv=None if clip is None else float(clip))
    else:
        out.update(post_sublayer_norms=True, qk_norm=True)
    return c.finish(**out)


def layout(cfg: ModelConfig):
    norms = [] if cfg.family == "olmo" else ["post_attention_layernorm", "post_feedforward_layernorm"]
    return llama_layout(cfg, norms)


FAMILIES = {"olmo": Family(read, layout, WeightNames("model.", "embed_tokens.weight", ("lm_head.weight",),
                                                     "layernorm_no_affine")),
            "olmo2": Family(read, layout, WEIGHTS)}
