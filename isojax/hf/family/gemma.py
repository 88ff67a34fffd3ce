"""Gemma (v1: gemma-2b, gemma-7b): the Llama trunk and tensor names (isojax.hf.family.llama) with
RMSNorm's gain 1 + w applied in float32, GeGLU (tanh GELU), embeddings times sqrt(hidden_size)
(the normalizer rounded to the weights' dtype, as transformers' GemmaTextScaledWordEmbedding),
tied embeddings, head_dim given explicitly (gemma-2b: 8 query heads of 256 and one key/value head).

transformers maps the legacy hidden_act "gelu" of the released config.json files to the tanh
GELU (and older versions read hidden_activation, else took the tanh GELU): both mean tanh here.
"""

from __future__ import annotations

from isojax.hf.family.llama import fields, layout
from isojax.hf.family.base import Family, Fields, WeightNames


def read(raw: dict) -> dict:
    c = Fields(raw, "gemma")
    c.only("hidden_act", ("gelu", "gelu_pytorch_tanh"), "gelu_pytorch_tanh")
    c.only("hidden_activation", (None, "gelu_pytorch_tanh"))
    c.only("use_bidirectional_attention", (None, False))
    c.only("mlp_bias", (False,), False)  # GemmaMLP has no biases whatever the file says
    out = fields(c, "gelu_pytorch_tanh")
    # GemmaConfig's defaults differ from Llama's (8192 positions, head_dim 256, 16 key/value heads):
    # the shapes are taken only from the file
    out.update(num_kv_heads=int(c.need("num_key_value_heads")), attention_head_dim=int(c.need("head_dim")),
               max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
               tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), norm_plus_one=True, embed_scale=True)
    return c.finish(**out)


FAMILIES = {"gemma": Family(read, layout, WeightNames("model.", "embed_tokens.weight", ("lm_head.weight",),
                                                            "rmsnorm", "norm.weight", tied=True, norm_offset=1.0))}
