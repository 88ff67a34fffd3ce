"""Hugging Face `config.json` readers of the families other than GPT-NeoX (isojax.model.config
reads GPT-NeoX's and builds the ModelConfig): each turns one family's attributes into ModelConfig
fields with the same allowlist strictness. An attribute is read (implemented), checked to have
the one value implemented, or known not to change an inference forward pass (IRRELEVANT_KEYS,
shared with the GPT-NeoX reader, and each family's own dropout and head settings); any other is
refused by name.

The semantics are transformers' modeling_<family>.py (5.x): README "Model families" lists what
each field does and what is refused.
"""

from __future__ import annotations

from isojax.errors import UserError

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

# Per family: attributes that only matter to training, generation or other heads.
_FAMILY_IRRELEVANT = {
    "gpt2": {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj", "summary_activation",
             "summary_proj_to_labels", "summary_first_dropout", "n_ctx"},
    "opt": {"dropout", "activation_dropout", "layerdrop", "init_std"},
    "falcon": set(),
    "llama": set(), "mistral": set(), "qwen2": set(), "olmo": set(), "olmo2": set(),
}


class _Fields:
    """A config.json dict read attribute by attribute; `finish` refuses every attribute never read."""

    def __init__(self, raw: dict, family: str):
        self.raw, self.family, self.read = raw, family, set()

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

    def rope(self, default_theta: float = 10000.0) -> tuple[float, float]:
        """(rotary fraction, base) from rope_parameters or the older rope_theta / rope_scaling;
        any rope_type but the default (llama3, yarn, linear, dynamic, ...) is refused by name."""
        self.only("rope_scaling", (None,))
        theta, fraction = self.get("rope_theta", default_theta), self.get("partial_rotary_factor", 1.0)
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
        unknown = sorted(set(self.raw) - self.read - IRRELEVANT_KEYS - _FAMILY_IRRELEVANT[self.family]
                                          - {"auto_map"})  # auto_map names remote code, which isojax never runs
        if unknown:
            raise UserError(f"config attribute(s) {', '.join(unknown)} not implemented by isojax's {self.family}; "
                            "refusing rather than computing something different")
        return dict(family=self.family, **fields)


def _llama_like(raw: dict) -> dict:
    """Llama, Mistral, Qwen2, OLMo, OLMo-2: RMSNorm (OLMo: LayerNorm without parameters), SwiGLU,
    rotary over whole heads, grouped-query attention."""
    family = raw["model_type"]
    c = _Fields(raw, family)
    heads = int(c.need("num_attention_heads"))
    hidden = int(c.need("hidden_size"))
    fraction, theta = c.rope()
    context = int(c.get("max_position_embeddings", 2048))
    c.only("pretraining_tp", (1,), 1)
    fields = dict(qkv_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
                  norm="rms", layer_norm_eps=float(c.get("rms_norm_eps", 1e-6)))
    fields["out_bias"] = fields["qkv_bias"]
    if family == "mistral":
        # Within the window a sliding-window attention is the full causal one (HF: key k is seen from
        # query q when q - k < window): isojax's context is capped there, so no sequence outgrows it.
        window = c.get("sliding_window")
        context = min(context, int(window)) if window is not None else context
    if family == "qwen2":
        c.only("use_sliding_window", (False,), False)
        c.only("use_mrope", (False,), False)
        c.get("sliding_window"), c.get("max_window_layers")  # read: used only with use_sliding_window
        layer_types = c.get("layer_types", [])
        if any(t != "full_attention" for t in layer_types):
            raise UserError(f"layer_types {sorted(set(layer_types))} of qwen2: only full_attention is implemented")
        fields.update(qkv_bias=True, out_bias=False)
    if family == "olmo":
        clip = c.get("clip_qkv")
        # HF's OlmoLayerNorm: F.layer_norm without weight or bias, eps fixed at 1e-5
        fields.update(norm="layer_no_affine", layer_norm_eps=1e-5,
                      clip_qkv=None if clip is None else float(clip))
    if family == "olmo2":
        fields.update(post_sublayer_norms=True, qk_norm=True)
    return c.finish(
        vocab_size=int(c.need("vocab_size")), hidden_size=hidden, num_layers=int(c.need("num_hidden_layers")),
        num_heads=heads, intermediate_size=int(c.need("intermediate_size")),
        hidden_act=c.only("hidden_act", ("silu",), "silu"), rotary_pct=fraction, rotary_emb_base=theta,
        max_position_embeddings=context, use_parallel_residual=False,
        num_kv_heads=int(c.get("num_key_value_heads", heads)),
        attention_head_dim=int(c.get("head_dim", hidden // heads)), gated_mlp=True,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), **fields)


def _gpt2(raw: dict) -> dict:
    c = _Fields(raw, "gpt2")
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


def _opt(raw: dict) -> dict:
    c = _Fields(raw, "opt")
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


def _falcon(raw: dict) -> dict:
    c = _Fields(raw, "falcon")
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


READERS = {"llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "olmo": _llama_like,
           "olmo2": _llama_like, "gpt2": _gpt2, "opt": _opt, "falcon": _falcon}
