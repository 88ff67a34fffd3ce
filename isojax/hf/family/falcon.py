"""Falcon: multi-query or grouped attention from one fused projection, rotary, parallel attention
and MLP through one norm (Falcon-7B) or two (new_decoder_architecture), tied embeddings by
default. ALiBi is refused."""

from __future__ import annotations

from isojax.errors import UserError
from isojax.hf.family.base import Family, Fields, Layout, WeightNames, as_is, finish, linear, norm_params
from isojax.model.config import ModelConfig


def read(raw: dict) -> dict:
    c = Fields(raw, "falcon")
    hidden, heads = int(c.need("hidden_size")), int(c.need("num_attention_heads"))
    c.only("alibi", (False,), False)
    c.only("apply_residual_connection_post_layernorm", (False,), False)
    new_arch = bool(c.get("new_decoder_architecture", False))
    multi_query = bool(c.get("multi_query", True))
    parallel = bool(c.get("parallel_attn", True))
    kv = c.get("num_kv_heads", heads)
    lns = c.get("num_ln_in_parallel_attn", 2 if new_arch else None)
    if new_arch:
        # HF's new architecture always adds attention and MLP in parallel, and builds the norms
        # it reads only with parallel_attn
        c.only("parallel_attn", (True,), True)
        c.only("num_ln_in_parallel_attn", (1, 2), 2)
        kv_heads, shared = int(kv), lns == 1
    else:
        if not multi_query and int(kv) != heads:  # a per-head (q, k, v) projection has num_heads k, v heads
            raise UserError(f"falcon with multi_query=false and num_kv_heads={kv} != num_attention_heads={heads} "
                            "is not implemented")
        kv_heads, shared = (1 if multi_query else heads), parallel
    fraction, theta = c.rope()
    bias = bool(c.get("bias", False))
    return c.finish(
        vocab_size=int(c.need("vocab_size")), hidden_size=hidden, num_layers=int(c.need("num_hidden_layers")),
        num_heads=heads, intermediate_size=int(c.get("ffn_hidden_size", 4 * hidden)),
        hidden_act=c.only("activation", ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"), "gelu"),
        rotary_pct=fraction, rotary_emb_base=theta,
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        layer_norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), use_parallel_residual=new_arch or parallel,
        num_kv_heads=kv_heads, shared_input_norm=shared, qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


def _reorder(cfg: ModelConfig):
    """Falcon's fused rows [N K, in] (or bias [N K]) -> [q heads | k heads | v heads] rows. Falcon
    groups them per key/value head: [G, H / G + 2, K], a group's queries then its k and its v
    (new_decoder_architecture); without it the same layout holds with G = H (per head q, k, v)
    and with G = 1 (multi_query: [q heads | k | v])."""
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim

    def reorder(a, xp):
        rest = a.shape[1:]
        a = a.reshape(g, h // g + 2, k, *rest)
        return xp.concatenate([x.reshape(-1, *rest) for x in (a[:, :-2], a[:, -2], a[:, -1])], axis=0)

    return reorder


def layout(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n = (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes = {"transformer.word_embeddings.weight": (v, d), "transformer.ln_f.weight": (d,),
              "transformer.ln_f.bias": (d,)}
    params = [(("embed_in",), ["transformer.word_embeddings.weight"], as_is),
              (("final_layer_norm", "scale"), ["transformer.ln_f.weight"], as_is),
              (("final_layer_norm", "bias"), ["transformer.ln_f.bias"], as_is)]
    reorder = _reorder(cfg)
    qkv = "self_attention.query_key_value"
    layer = {f"{qkv}.weight": (n, d), "self_attention.dense.weight": (d, d), "mlp.dense_h_to_4h.weight": (f, d),
             "mlp.dense_4h_to_h.weight": (d, f)}
    params += [(("attention", "qkv", "kernel"), [f"{qkv}.weight"], lambda a, xp: reorder(a[0], xp).T),
               (("attention", "dense", "kernel"), ["self_attention.dense.weight"], linear),
               (("mlp", "up", "kernel"), ["mlp.dense_h_to_4h.weight"], linear),
               (("mlp", "down", "kernel"), ["mlp.dense_4h_to_h.weight"], linear)]
    if cfg.qkv_bias:  # Falcon's `bias`: every linear
        layer.update({f"{qkv}.bias": (n,), "self_attention.dense.bias": (d,), "mlp.dense_h_to_4h.bias": (f,),
                      "mlp.dense_4h_to_h.bias": (d,)})
        params += [(("attention", "qkv", "bias"), [f"{qkv}.bias"], lambda a, xp: reorder(a[0], xp)),
                   (("attention", "dense", "bias"), ["self_attention.dense.bias"], as_is),
                   (("mlp", "up", "bias"), ["mlp.dense_h_to_4h.bias"], as_is),
                   (("mlp", "down", "bias"), ["mlp.dense_4h_to_h.bias"], as_is)]
    if cfg.shared_input_norm:
        norms = [("input_layernorm", "input_layernorm")]
    elif cfg.use_parallel_residual:
        norms = [("input_layernorm", "ln_attn"), ("post_attention_layernorm", "ln_mlp")]
    else:
        norms = [("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm")]
    norm_params(layer, params, d, norms)
    return finish(cfg, Layout("transformer.", "transformer.h.", shapes, params), layer)


FAMILIES = {"falcon": Family(read, layout, WeightNames("transformer.", "word_embeddings.weight", ("lm_head.weight",),
                                                       "layernorm", "ln_f.weight", "ln_f.bias", tied=True))}
