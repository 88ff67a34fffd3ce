"""The decoder-only families other than GPT-NeoX in Flax (linen): GPT-2, OPT, Falcon and the Llama
family (Llama, Mistral, Qwen2, OLMo, OLMo-2), each matching its Hugging Face PyTorch model. The
config's family fields (isojax.model.config.ModelConfig) pick the norm, the positions, the
attention's heads and biases, the MLP and the residual layout; GPTNeoX stays its own module
(isojax.model.gpt_neox), whose traced program these branches leave alone.

Axes as in isojax.model.gpt_neox, plus N = H + 2G projected heads (H query heads, then G key
heads, then G value heads; each key/value head serves H / G consecutive query heads, as Hugging
Face's repeat_kv). Every family's q, k, v projection is stored in that one layout by its reader
(isojax.hf.family), whatever the checkpoint's, so the model has one fused product per layer.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from isojax.model.config import ACTIVATIONS, ModelConfig
from isojax.model.gpt_neox import (DenseGelu, GPTNeoX, LayerNorm, ObservedBlock, Observer, _matmul,
                                   layer_norm_pair, observe_last_two)
from isojax.model.ops import apply_rotary, attention_pallas_tpu, attention_xla, gelu, rotary_tables, segment_mask
from isojax.model.options import ForwardOptions


class Norm(nn.Module):
    """The norms GPT-NeoX's LayerNorm does not cover, statistics in float32: RMSNorm ("rms") and
    LayerNorm without parameters ("layer_no_affine")."""

    kind: str
    eps: float
    dtype: Any
    param_dtype: Any
    # RMSNorm: OLMo-2 scales in float32 and rounds once ((w * y).to(dtype)); Llama rounds y
    # first (w * y.to(dtype)). The same in float32, not in bfloat16.
    scale_in_float32: bool = False
    plus_one: bool = False  # Gemma's RMSNorm: y * (1 + w) in float32, rounded once

    @nn.compact
    def __call__(self, x_BxTxD):
        d = x_BxTxD.shape[-1]
        x = x_BxTxD.astype(jnp.float32)
        if self.kind == "rms":
            init = nn.initializers.zeros if self.plus_one else nn.initializers.ones  # a gain of 1, as HF's init
            scale = self.param("scale", init, (d,), self.param_dtype)
            y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
            if self.plus_one:
                return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
            if self.scale_in_float32:
                return (scale.astype(jnp.float32) * y).astype(self.dtype)
            return scale.astype(self.dtype) * y.astype(self.dtype)
        xc = x - x.mean(-1, keepdims=True)
        return (xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + self.eps)).astype(self.dtype)


def make_norm(cfg: ModelConfig, dtype, param_dtype, name: str) -> nn.Module:
    """The family's norm: GPT-NeoX's LayerNorm (scale and bias), else a Norm."""
    if cfg.norm == "layer":
        return LayerNorm(cfg.layer_norm_eps, dtype, param_dtype, name=name)
    return Norm(cfg.norm, cfg.layer_norm_eps, dtype, param_dtype, scale_in_float32=cfg.family == "olmo2",
                plus_one=cfg.norm_plus_one, name=name)


class Projection(nn.Module):
    """nn.Dense's parameters ("kernel" [D, F], "bias" [F] when use_bias) and arithmetic; with
    split_bias, (x @ W, bias or None) for a kernel that adds the bias itself."""

    features: int
    use_bias: bool
    dtype: Any
    param_dtype: Any
    precision: Any

    @nn.compact
    def __call__(self, x_BxTxD, split_bias: bool = False):
        w_DxF = self.param("kernel", nn.initializers.lecun_normal(), (x_BxTxD.shape[-1], self.features),
                           self.param_dtype)
        bias_F = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype) \
            if self.use_bias else None
        x_BxTxD, w_DxF, bias_F = nn.dtypes.promote_dtype(x_BxTxD, w_DxF, bias_F, dtype=self.dtype)
        y_BxTxF = _matmul(x_BxTxD, w_DxF, self.precision)
        if split_bias:
            return y_BxTxF, bias_F
        return y_BxTxF if bias_F is None else y_BxTxF + bias_F


def activation(name: str, u, fast_gelu: bool):
    if name in ACTIVATIONS:
        return gelu(u, ACTIVATIONS[name], fast_gelu)
    return jax.nn.relu(u) if name == "relu" else jax.nn.silu(u)


class GroupedAttention(nn.Module):
    """Causal attention within packed sequences with G key/value heads for H query heads
    (G = H: multi-head; G = 1: multi-query), from one projection to the N = H + 2G heads."""

    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        cfg = self.cfg
        b, t, d = x_BxTxD.shape
        h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        n = h + 2 * g
        qkv = Projection(n * k, cfg.qkv_bias, self.dtype, self.param_dtype, self.precision, name="qkv")
        out = Projection(d, cfg.out_bias, self.dtype, self.param_dtype, self.precision, name="dense")
        attention = self.options.attention
        if attention == "packed":  # bias, rotary and segments inside one kernel (kernels.select: where it applies)
            from isojax.kernels import packed_attention
            product, bias_N = qkv(x_BxTxD, split_bias=True)
            bias_NxK = None if bias_N is None else bias_N.reshape(n, k)
            out_BxTxHxK = self.options.per_device(
                lambda p, c, s, seg, *bias: packed_attention.attention_grouped(p, c, s, seg, *bias, num_heads=h),
                (product.reshape(b, t, n, k), cos_BxTxR, sin_BxTxR, segment_ids_BxT),
                () if bias_NxK is None else (bias_NxK,))
            return out(out_BxTxHxK.reshape(b, t, h * k))
        qkv_BxTxNxK = qkv(x_BxTxD).reshape(b, t, n, k)
        if cfg.clip_qkv is not None:
            qkv_BxTxNxK = jnp.clip(qkv_BxTxNxK, -cfg.clip_qkv, cfg.clip_qkv)
        q, kk, v = qkv_BxTxNxK[:, :, :h], qkv_BxTxNxK[:, :, h:h + g], qkv_BxTxNxK[:, :, h + g:]
        if cfg.qk_norm:  # over all heads together, as OLMo-2's q_norm / k_norm
            q = make_norm(cfg, self.dtype, self.param_dtype, "q_norm")(q.reshape(b, t, h * k)).reshape(q.shape)
            kk = make_norm(cfg, self.dtype, self.param_dtype, "k_norm")(kk.reshape(b, t, g * k)).reshape(kk.shape)
        if cfg.rotary_dims:
            q, kk = apply_rotary(q, cos_BxTxR, sin_BxTxR), apply_rotary(kk, cos_BxTxR, sin_BxTxR)
        if attention in ("cudnn", "auto"):  # jax's attention takes the G heads itself
            impl = None if attention == "auto" else attention
            out_BxTxHxK = jax.nn.dot_product_attention(q, kk, v, mask=mask_Bx1xTxT,
                                                       is_causal=self.options.cudnn_causal, implementation=impl)
            return out(out_BxTxHxK.reshape(b, t, h * k))
        kk, v = jnp.repeat(kk, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
        if attention == "xla":
            out_BxTxHxK = attention_xla(q, kk, v, mask_Bx1xTxT, self.precision)
        else:
            # a Mosaic kernel XLA cannot partition: one call per device's rows
            out_BxTxHxK = self.options.per_device(attention_pallas_tpu, (q, kk, v, segment_ids_BxT), ())
        return out(out_BxTxHxK.reshape(b, t, h * k))


class MLP(nn.Module):
    """down(act(up x)), or SwiGLU's down(act(gate x) * up x); the exact GELU with a bias through
    DenseGelu, which runs the fused kernel where options.mlp_kernel says."""

    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD):
        cfg = self.cfg
        dense = lambda features, name: Projection(features, cfg.mlp_bias, self.dtype, self.param_dtype,
                                                  self.precision, name=name)
        f, fast = cfg.intermediate_size, self.options.fast_gelu
        if cfg.gated_mlp:
            u_BxTxF = activation(cfg.hidden_act, dense(f, "gate")(x_BxTxD), fast) * dense(f, "up")(x_BxTxD)
        elif cfg.hidden_act in ACTIVATIONS and cfg.mlp_bias:
            u_BxTxF = DenseGelu(f, self.dtype, self.param_dtype, self.precision, ACTIVATIONS[cfg.hidden_act],
                                self.options, name="up")(x_BxTxD)
        else:
            u_BxTxF = activation(cfg.hidden_act, dense(f, "up")(x_BxTxD), fast)
        return dense(cfg.hidden_size, "down")(u_BxTxF)


class DecoderBlock(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        cfg = self.cfg
        norm = lambda name: make_norm(cfg, self.dtype, self.param_dtype, name)
        attn = lambda h: GroupedAttention(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                          name="attention")(h, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        mlp = MLP(cfg, self.dtype, self.param_dtype, self.precision, self.options, name="mlp")
        if cfg.post_sublayer_norms:  # OLMo-2: the norms sit on the sublayers' outputs
            h = norm("post_attention_layernorm")(attn(x_BxTxD)) + x_BxTxD
            return norm("post_feedforward_layernorm")(mlp(h)) + h
        if cfg.use_parallel_residual:
            if cfg.shared_input_norm:  # Falcon-7B: attention and MLP read one norm
                h = norm("input_layernorm")(x_BxTxD)
                return mlp(h) + attn(h) + x_BxTxD
            first, second = norm("input_layernorm"), norm("post_attention_layernorm")
            if isinstance(first, LayerNorm):  # the LayerNorm-pair kernel where options.norm_kernel says
                h_attn, h_mlp = layer_norm_pair(first, second, x_BxTxD, self.options)
            else:
                h_attn, h_mlp = first(x_BxTxD), second(x_BxTxD)
            return mlp(h_mlp) + attn(h_attn) + x_BxTxD
        h = attn(norm("input_layernorm")(x_BxTxD)) + x_BxTxD
        return mlp(norm("post_attention_layernorm")(h)) + h


class Decoder(nn.Module):
    """The trunk of a GPT-2, OPT, Falcon or Llama-family model; the interface and the observed
    states are GPTNeoX's (isojax.model.gpt_neox): embed, block_1 .. block_L, final norm."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    options: ForwardOptions = ForwardOptions()

    @property
    def precision(self):
        return jax.lax.Precision.HIGHEST if jnp.dtype(self.dtype) == jnp.float32 else None

    @nn.compact
    def __call__(self, tokens_BxT, segment_ids_BxT, positions_BxT, obs, observe: Observer):
        cfg = self.cfg
        init = nn.initializers.normal(0.02)
        embed_VxD = self.param("embed_in", init, (cfg.vocab_size, cfg.hidden_size), self.param_dtype)
        if not cfg.tie_word_embeddings:  # no metric needs logits, but the weights belong to the model
            self.param("embed_out", init, (cfg.hidden_size, cfg.vocab_size), self.param_dtype)
        if cfg.unembed_bias:
            self.param("embed_out_bias", nn.initializers.zeros_init(), (cfg.vocab_size,), self.param_dtype)
        x_BxTxD = jnp.take(embed_VxD, tokens_BxT, axis=0)
        if cfg.embed_scale:  # Gemma: the normalizer sqrt(d) in float32, rounded to the weights' dtype, as HF
            x_BxTxD = x_BxTxD * jnp.asarray(np.float32(cfg.hidden_size ** 0.5), self.param_dtype)
        x_BxTxD = x_BxTxD.astype(self.dtype)
        cos_BxTxR = sin_BxTxR = None
        if cfg.learned_positions:  # hidden_states[0] = token + position embedding (GPT-2, OPT)
            table_PxD = self.param("position_embeddings", init, (cfg.position_table_rows(), cfg.hidden_size),
                                   self.param_dtype)
            x_BxTxD = x_BxTxD + jnp.take(table_PxD, positions_BxT + cfg.position_offset, axis=0).astype(self.dtype)
        if cfg.rotary_dims:
            cos_BxTxR, sin_BxTxR = rotary_tables(positions_BxT, cfg)
        x_BxTxD = self.options.constrain(x_BxTxD)
        mask_Bx1xTxT = None if self.options.attention in ("pallas", "packed") else segment_mask(segment_ids_BxT)
        layers = nn.scan(ObservedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers)
        (x_BxTxD, obs), _ = layers(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                   observe, DecoderBlock, name="layers")(
            (x_BxTxD, obs), jnp.arange(1, cfg.num_layers + 1), cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        h_BxTxD = make_norm(cfg, self.dtype, self.param_dtype, "final_layer_norm")(x_BxTxD)
        return observe_last_two(observe, obs, x_BxTxD, h_BxTxD, cfg.num_layers)


def model_class(cfg: ModelConfig):
    """The Flax module of the config's family: GPTNeoX (isojax.model.gpt_neox), or Decoder."""
    return GPTNeoX if cfg.family == "gpt_neox" else Decoder
