"""Llama (Llama, Llama-2), Mistral and Qwen2: RMSNorm, SwiGLU, rotary over whole heads,
grouped-query attention, `model.layers.N.{self_attn,mlp}` tensors. `fields` and `layout` are
also the Llama-like trunk of OLMo, OLMo-2 and Gemma (their files). Semantics: transformers'
modeling_<family>.py (5.x); README "Model families".
"""

from __future__ import annotations

from isojax.errors import UserError
from isojax.hf.family.base import (Family, Fields, Layout, WeightNames, as_is, finish, linear, qkv_bias,
                                   qkv_kernel)
from isojax.model.config import ModelConfig


def fields(c: Fields, hidden_act: str) -> dict:
    """The ModelConfig fields every Llama-like config.json gives (the family may override some)."""
    heads = int(c.need("num_attention_heads"))
    hidden = int(c.need("hidden_size"))
    fraction, theta = c.rope()
    c.only("pretraining_tp", (1,), 1)
    bias = bool(c.get("attention_bias", False))
    return dict(
        vocab_size=int(c.need("vocab_size")), hidden_size=hidden, num_layers=int(c.need("num_hidden_layers")),
        num_heads=heads, intermediate_size=int(c.need("intermediate_size")),
        hidden_act=hidden_act, rotary_pct=fraction, rotary_emb_base=theta,
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)), use_parallel_residual=False,
        num_kv_heads=int(c.get("num_key_value_heads", heads)),
        attention_head_dim=int(c.get("head_dim", hidden // heads)), gated_mlp=True,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), qkv_bias=bias, out_bias=bias,
        mlp_bias=bool(c.get("mlp_bias", False)), norm="rms", layer_norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def read(raw: dict) -> dict:
    family = raw["model_type"]
    c = Fields(raw, family)
    out = fields(c, c.only("hidden_act", ("silu",), "silu"))
    if family == "mistral":
        # Within the window a sliding-window attention is the full causal one (HF: key k is seen from
        # query q when q - k < window): isojax's context is capped there, so no sequence outgrows it.
        window = c.get("sliding_window")
        if window is not None:
            out["max_position_embeddings"] = min(out["max_position_embeddings"], int(window))
    if family == "qwen2":
        c.only("use_sliding_window", (False,), False)
        c.only("use_mrope", (False,), False)
        c.get("sliding_window"), c.get("max_window_layers")  # read: used only with use_sliding_window
        layer_types = c.get("layer_types", [])
        if any(t != "full_attention" for t in layer_types):
            raise UserError(f"layer_types {sorted(set(layer_types))} of qwen2: only full_attention is implemented")
        out.update(qkv_bias=True, out_bias=False)
    return c.finish(**out)


def layout(cfg: ModelConfig, norms=("input_layernorm", "post_attention_layernorm")) -> Layout:
    """`model.embed_tokens`, q/k/v/o_proj, gate/up/down_proj, the layer's RMSNorms `norms`,
    q_norm/k_norm with cfg.qk_norm, `model.norm` unless the norm has no parameters."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, d)}
    params = [(("embed_in",), ["model.embed_tokens.weight"], as_is)]
    layer = {"self_attn.q_proj.weight": (h * k, d), "self_attn.k_proj.weight": (g * k, d),
             "self_attn.v_proj.weight": (g * k, d), "self_attn.o_proj.weight": (d, h * k),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    params += [(("attention", "qkv", "kernel"), [f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_kernel),
               (("attention", "dense", "kernel"), ["self_attn.o_proj.weight"], linear)]
    params += [(("mlp", x, "kernel"), [f"mlp.{x}_proj.weight"], linear) for x in ("gate", "up", "down")]
    if cfg.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (h * k,), "self_attn.k_proj.bias": (g * k,),
                      "self_attn.v_proj.bias": (g * k,)})
        params.append((("attention", "qkv", "bias"), [f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_bias))
    if cfg.out_bias:
        layer["self_attn.o_proj.bias"] = (d,)
        params.append((("attention", "dense", "bias"), ["self_attn.o_proj.bias"], as_is))
    if cfg.mlp_bias:
        layer.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
        params += [(("mlp", x, "bias"), [f"mlp.{x}_proj.bias"], as_is) for x in ("gate", "up", "down")]
    for name in norms:
        layer[f"{name}.weight"] = (d,)
        params.append(((name, "scale"), [f"{name}.weight"], as_is))
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (h * k,), "self_attn.k_norm.weight": (g * k,)})
        params += [(("attention", f"{x}_norm", "scale"), [f"self_attn.{x}_norm.weight"], as_is) for x in "qk"]
    if cfg.norm != "layer_no_affine":
        shapes["model.norm.weight"] = (d,)
        params.append((("final_layer_norm", "scale"), ["model.norm.weight"], as_is))
    return finish(cfg, Layout("model.", "model.layers.", shapes, params), layer)


WEIGHTS = WeightNames("model.", "embed_tokens.weight", ("lm_head.weight",), "rmsnorm", "norm.weight")
FAMILIES = {name: Family(read, layout, WEIGHTS) for name in ("llama", "mistral", "qwen2")}
