"""OPT: learned positions from row 2, LayerNorms (with or without parameters), ReLU MLP
`fc1`/`fc2`, q/k/v from three tensors, tied embeddings by default. OPT-350m (norms after each
sublayer, 512-wide embeddings projected) is refused."""

from __future__ import annotations

from isojax.hf.family.base import (Family, Fields, Layout, WeightNames, as_is, finish, linear, norm_params,
                                   qkv_bias, qkv_kernel)
from isojax.model.config import ModelConfig


def read(raw: dict) -> dict:
    c = Fields(raw, "opt", {"dropout", "activation_dropout", "layerdrop", "init_std"})
    hidden = int(c.need("hidden_size"))
    # OPT-350m normalizes after each sublayer and projects embeddings from 512 wide: not implemented
    c.only("do_layer_norm_before", (True,), True)
    c.only("_remove_final_layer_norm", (False,), False)
    c.only("word_embed_proj_dim", (hidden,), hidden)
    bias = bool(c.get("enable_bias", True))
    affine = bool(c.get("layer_norm_elementwise_affine", True))
    return c.finish(
        vocab_size=int(c.need("vocab_size")), hidden_size=hidden, num_layers=int(c.need("num_hidden_layers")),
        num_heads=int(c.need("num_attention_heads")), intermediate_size=int(c.need("ffn_dim")),
        hidden_act=c.only("activation_function", ("relu", "gelu", "gelu_new", "silu"), "relu"), rotary_pct=0.0,
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)), layer_norm_eps=1e-5,
        use_parallel_residual=False, norm="layer" if affine else "layer_no_affine",
        qkv_bias=bias, out_bias=bias, mlp_bias=bias, learned_positions=True, position_offset=2,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


def layout(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    top = "model.decoder."
    shapes = {top + "embed_tokens.weight": (v, d), top + "embed_positions.weight": (cfg.position_table_rows(), d)}
    params = [(("embed_in",), [top + "embed_tokens.weight"], as_is),
              (("position_embeddings",), [top + "embed_positions.weight"], as_is)]
    layer = {f"self_attn.{x}_proj.weight": (d, d) for x in ("q", "k", "v", "out")}
    layer.update({"fc1.weight": (f, d), "fc2.weight": (d, f)})
    params += [(("attention", "qkv", "kernel"), [f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_kernel),
               (("attention", "dense", "kernel"), ["self_attn.out_proj.weight"], linear),
               (("mlp", "up", "kernel"), ["fc1.weight"], linear), (("mlp", "down", "kernel"), ["fc2.weight"], linear)]
    if cfg.qkv_bias:  # enable_bias: every linear
        layer.update({f"self_attn.{x}_proj.bias": (d,) for x in ("q", "k", "v", "out")})
        layer.update({"fc1.bias": (f,), "fc2.bias": (d,)})
        params += [(("attention", "qkv", "bias"), [f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_bias),
                   (("attention", "dense", "bias"), ["self_attn.out_proj.bias"], as_is),
                   (("mlp", "up", "bias"), ["fc1.bias"], as_is), (("mlp", "down", "bias"), ["fc2.bias"], as_is)]
    if cfg.norm == "layer":  # layer_norm_elementwise_affine
        norm_params(layer, params, d, (("input_layernorm", "self_attn_layer_norm"),
                                       ("post_attention_layernorm", "final_layer_norm")))
        shapes.update({top + "final_layer_norm.weight": (d,), top + "final_layer_norm.bias": (d,)})
        params += [(("final_layer_norm", "scale"), [top + "final_layer_norm.weight"], as_is),
                   (("final_layer_norm", "bias"), [top + "final_layer_norm.bias"], as_is)]
    return finish(cfg, Layout("model.", top + "layers.", shapes, params), layer)


def final_norm(cfg: dict) -> str:
    """The final norm `weights` finds (transformers' OPTDecoder): none without do_layer_norm_before
    (OPT-350m), no parameters without layer_norm_elementwise_affine."""
    if not cfg.get("do_layer_norm_before", True) or cfg.get("_remove_final_layer_norm", False):
        return "none"
    if cfg.get("layer_norm_elementwise_affine", True) is False:
        return "layernorm_no_affine"
    return "layernorm"


FAMILIES = {"opt": Family(read, layout, WeightNames("model.", "decoder.embed_tokens.weight", ("lm_head.weight",),
                                                    "layernorm", "decoder.final_layer_norm.weight",
                                                    "decoder.final_layer_norm.bias", tied=True, norm_of=final_norm))}
