"""Phi (phi-1, phi-1.5, phi-2; transformers' PhiForCausalLM, model_type "phi"): partial rotary
(partial_rotary_factor, 0.5 by default), attention and a dense GELU MLP (gelu_new) in parallel
reading one input LayerNorm, biases on every linear, a final LayerNorm, and an untied lm_head with
a bias. q/k LayerNorms (qk_layernorm) are refused.
"""

from __future__ import annotations

from isojax.hf.family.base import (Family, Fields, Layout, WeightNames, as_is, finish, linear, norm_params,
                                   qkv_bias, qkv_kernel)
from isojax.model.config import ModelConfig


def read(raw: dict) -> dict:
    c = Fields(raw, "phi", {"resid_pdrop", "embd_pdrop"})
    c.only("qk_layernorm", (False,), False)
    heads, hidden = int(c.need("num_attention_heads")), int(c.need("hidden_size"))
    fraction, theta = c.rope(default_fraction=0.5)
    return c.finish(
        vocab_size=int(c.need("vocab_size")), hidden_size=hidden, num_layers=int(c.need("num_hidden_layers")),
        num_heads=heads, intermediate_size=int(c.need("intermediate_size")),
        hidden_act=c.only("hidden_act", ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh", "relu", "silu"),
                          "gelu_new"),
        rotary_pct=fraction, rotary_emb_base=theta, max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        layer_norm_eps=float(c.get("layer_norm_eps", 1e-5)), use_parallel_residual=True, shared_input_norm=True,
        num_kv_heads=int(c.get("num_key_value_heads", heads)), attention_head_dim=int(c.get("head_dim", hidden // heads)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), unembed_bias=True)


def layout(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, d), "model.final_layernorm.weight": (d,),
              "model.final_layernorm.bias": (d,)}
    params = [(("embed_in",), ["model.embed_tokens.weight"], as_is),
              (("final_layer_norm", "scale"), ["model.final_layernorm.weight"], as_is),
              (("final_layer_norm", "bias"), ["model.final_layernorm.bias"], as_is)]
    layer = {"self_attn.q_proj.weight": (h * k, d), "self_attn.k_proj.weight": (g * k, d),
             "self_attn.v_proj.weight": (g * k, d), "self_attn.q_proj.bias": (h * k,),
             "self_attn.k_proj.bias": (g * k,), "self_attn.v_proj.bias": (g * k,),
             "self_attn.dense.weight": (d, h * k), "self_attn.dense.bias": (d,),
             "mlp.fc1.weight": (f, d), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (d, f), "mlp.fc2.bias": (d,)}
    params += [(("attention", "qkv", "kernel"), [f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_kernel),
               (("attention", "qkv", "bias"), [f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_bias),
               (("attention", "dense", "kernel"), ["self_attn.dense.weight"], linear),
               (("attention", "dense", "bias"), ["self_attn.dense.bias"], as_is),
               (("mlp", "up", "kernel"), ["mlp.fc1.weight"], linear), (("mlp", "up", "bias"), ["mlp.fc1.bias"], as_is),
               (("mlp", "down", "kernel"), ["mlp.fc2.weight"], linear),
               (("mlp", "down", "bias"), ["mlp.fc2.bias"], as_is)]
    norm_params(layer, params, d, [("input_layernorm", "input_layernorm")])
    return finish(cfg, Layout("model.", "model.layers.", shapes, params), layer)


FAMILIES = {"phi": Family(read, layout, WeightNames("model.", "embed_tokens.weight", ("lm_head.weight",), "layernorm",
                                                    "final_layernorm.weight", "final_layernorm.bias"))}
