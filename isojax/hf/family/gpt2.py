"""GPT-2: learned positions, LayerNorms, `Conv1D` weights [in, out] whose fused `c_attn` columns
are [q heads | k heads | v heads] already, tied embeddings by default."""

from __future__ import annotations

from isojax.hf.family.base import Family, Fields, Layout, WeightNames, as_is, finish, norm_params
from isojax.model.config import ModelConfig

# attributes that only matter to training or to other heads
IRRELEVANT = {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj", "summary_activation",
              "summary_proj_to_labels", "summary_first_dropout", "n_ctx"}


def read(raw: dict) -> dict:
    c = Fields(raw, "gpt2", IRRELEVANT)
    hidden = int(c.get("n_embd", 768))
    c.only("scale_attn_weights", (True,), True)
    c.only("scale_attn_by_inverse_layer_idx", (False,), False)
    c.only("reorder_and_upcast_attn", (False,), False)
    c.only("add_cross_attention", (False,), False)
    act = c.only("activation_function", ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh", "relu", "silu"),
                 "gelu_new")
    return c.finish(
        vocab_size=int(c.get("vocab_size", 50257)), hidden_size=hidden, num_layers=int(c.get("n_layer", 12)),
        num_heads=int(c.get("n_head", 12)), intermediate_size=int(c.get("n_inner", 4 * hidden)), hidden_act=act,
        rotary_pct=0.0, max_position_embeddings=int(c.get("n_positions", 1024)),
        layer_norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), use_parallel_residual=False,
        learned_positions=True, tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


def layout(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (cfg.position_table_rows(), d),
              "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    params = [(("embed_in",), ["transformer.wte.weight"], as_is),
              (("position_embeddings",), ["transformer.wpe.weight"], as_is),
              (("final_layer_norm", "scale"), ["transformer.ln_f.weight"], as_is),
              (("final_layer_norm", "bias"), ["transformer.ln_f.bias"], as_is)]
    # Conv1D: weight [in, out]; c_attn's columns are [q heads | k heads | v heads] already
    layer = {"attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,), "attn.c_proj.weight": (d, d),
             "attn.c_proj.bias": (d,), "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,),
             "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,)}
    for ours, theirs in (("attention.qkv", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
                         ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
        params += [((*ours.split("."), leaf), [f"{theirs}.{hf}"], as_is) for leaf, hf in (("kernel", "weight"),
                                                                                           ("bias", "bias"))]
    norm_params(layer, params, d, (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")))
    # the causal-mask buffers older GPT-2 checkpoints keep
    return finish(cfg, Layout("transformer.", "transformer.h.", shapes, params,
                              ignored=r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"), layer)


FAMILIES = {"gpt2": Family(read, layout, WeightNames("transformer.", "wte.weight", ("lm_head.weight",), "layernorm",
                                                     "ln_f.weight", "ln_f.bias", tied=True))}
