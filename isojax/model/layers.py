"""The decoder's layers in Flax (linen): norms, projections, the MLP and attention, each matching
its Hugging Face PyTorch counterpart for every family the config (isojax.model.config.ModelConfig)
names. Axes as in isojax.model.decoder.

`cfg.neox_tree` picks GPT-NeoX's parameter tree (isojax.hf.family.gpt_neox): the fused q, k, v
projection `query_key_value` with its columns grouped per head as (q, k, v), the MLP's two
products in the block itself, nn.Dense's arithmetic. Its traced program is kept as tuned
(bench/jaxpr_neox.py). The other families store q, k, v in one layout whatever the
checkpoint's (isojax.hf.family): N = H + 2G projected heads (H query heads, then G key heads, then
G value heads; each key/value head serves H / G consecutive query heads, as Hugging Face's
repeat_kv), so the model has one fused product per layer.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.model.config import ACTIVATIONS, ModelConfig
from isojax.numerics import apply_rotary, attention_pallas_tpu, attention_xla, gelu
from isojax.model.options import ForwardOptions


class Norm(nn.Module):
    """The block's norms, statistics in float32, output in `dtype`: LayerNorm ("layer": scale
    and bias, two-pass variance), RMSNorm ("rms") or LayerNorm without parameters
    ("layer_no_affine")."""

    kind: str
    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    # RMSNorm: OLMo-2 scales in float32 and rounds once ((w * y).to(dtype)); Llama rounds y
    # first (w * y.to(dtype)). The same in float32, not in bfloat16.
    scale_in_float32: bool = False
    plus_one: bool = False  # Gemma's RMSNorm: y * (1 + w) in float32, rounded once

    @nn.compact
    def __call__(self, x_BxTxD, params_only: bool = False):
        """Norm(x); params_only: LayerNorm's (scale, bias) (layer_norm_pair) or RMSNorm's scale (the
        packed attention kernel's q/k norms) in float32 instead (x: anything with x's shape)."""
        d = x_BxTxD.shape[-1]
        if self.kind == "layer":
            scale = self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
            bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
            if params_only:
                return scale.astype(jnp.float32), bias.astype(jnp.float32)
        if self.kind == "rms":
            init = nn.initializers.zeros if self.plus_one else nn.initializers.ones  # a gain of 1, as HF's init
            scale = self.param("scale", init, (d,), self.param_dtype)
            if params_only:
                return scale.astype(jnp.float32)
        x = x_BxTxD.astype(jnp.float32)
        if self.kind == "rms":
            y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
            if self.plus_one:
                return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
            if self.scale_in_float32:
                return (scale.astype(jnp.float32) * y).astype(self.dtype)
            return scale.astype(self.dtype) * y.astype(self.dtype)
        xc = x - x.mean(-1, keepdims=True)
        y = xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + self.eps)
        if self.kind == "layer":
            y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


def make_norm(cfg: ModelConfig, dtype, param_dtype, name: str) -> Norm:
    return Norm(cfg.norm, cfg.layer_norm_eps, dtype, param_dtype, scale_in_float32=cfg.family == "olmo2",
                plus_one=cfg.norm_plus_one, name=name)


def layer_norm_pair(first: Norm, second: Norm, x_BxTxD, options: ForwardOptions):
    """(first(x), second(x)): for two LayerNorms, one Pallas kernel reading x once
    (isojax.kernels.norm) with options.norm_kernel "pallas" where it applies."""
    if options.norm_kernel == "pallas" and first.kind == "layer":
        from isojax.kernels import norm as norm_kernel
        b, t, d = x_BxTxD.shape
        rows = b * t // options.devices()
        if norm_kernel.applies(d, first.dtype) and rows % norm_kernel.rows_per_block(d) == 0:
            def local(x_BxTxD, s1, b1, s2, b2):
                y1, y2 = norm_kernel.layer_norm_pair(x_BxTxD.reshape(-1, d), s1, b1, s2, b2, eps=first.eps,
                                                     interpret=options.interpret())
                return y1.reshape(x_BxTxD.shape), y2.reshape(x_BxTxD.shape)

            x_BxTxD = x_BxTxD.astype(first.dtype)
            return options.per_device(local, (x_BxTxD,), (*first(x_BxTxD, True), *second(x_BxTxD, True)))
    return first(x_BxTxD), second(x_BxTxD)


def _linear_params(module: nn.Module, x_BxTxD, use_bias: bool):
    """nn.Dense's parameters, "kernel" [D, F] and "bias" [F] (module.features wide; None without
    use_bias), and x, all promoted to module.dtype as nn.Dense promotes them."""
    w_DxF = module.param("kernel", nn.initializers.lecun_normal(), (x_BxTxD.shape[-1], module.features),
                         module.param_dtype)
    bias_F = module.param("bias", nn.initializers.zeros_init(), (module.features,), module.param_dtype) \
        if use_bias else None
    return nn.dtypes.promote_dtype(x_BxTxD, w_DxF, bias_F, dtype=module.dtype)


def _matmul(x_BxTxD, w_DxF, precision):
    """x @ W over the last axis, as nn.Dense computes it."""
    return jax.lax.dot_general(x_BxTxD, w_DxF, (((2,), (0,)), ((), ())), precision=precision)


class Projection(nn.Module):
    """nn.Dense's parameters ("kernel" [D, F], "bias" [F] when use_bias) and arithmetic; with
    split_bias, (x @ W, bias or None) for a kernel that adds the bias itself."""

    features: int
    use_bias: bool
    dtype: Any
    param_dtype: Any
    precision: Any

    @nn.compact
    def __call__(self, x_BxTxD, split_bias: bool = False, weights: bool = False):
        """x @ W + bias; weights: (x, W) promoted, for a kernel that multiplies itself."""
        x_BxTxD, w_DxF, bias_F = _linear_params(self, x_BxTxD, self.use_bias)
        if weights:
            return x_BxTxD, w_DxF
        y_BxTxF = _matmul(x_BxTxD, w_DxF, self.precision)
        if split_bias:
            return y_BxTxF, bias_F
        return y_BxTxF if bias_F is None else y_BxTxF + bias_F


def linear(parent: nn.Module, cfg: ModelConfig, features: int, use_bias: bool, name: str) -> nn.Module:
    """The tree's projection: nn.Dense itself in GPT-NeoX's (always with a bias), else Projection."""
    if cfg.neox_tree:
        return nn.Dense(features, dtype=parent.dtype, param_dtype=parent.param_dtype, precision=parent.precision,
                        name=name, parent=parent)
    return Projection(features, use_bias, parent.dtype, parent.param_dtype, parent.precision, name=name,
                      parent=parent)


class DenseGelu(nn.Module):
    """nn.Dense (the same parameters, "kernel" [D, F] and "bias" [F], and the same arithmetic)
    followed by gelu; with options.mlp_kernel "mosaic", where isojax.kernels.mlp applies, one Hopper
    kernel with the bias and GELU in its epilogue. Under an activation sharding the kernel runs
    per device on its rows (shard_map)."""

    features: int
    dtype: Any
    param_dtype: Any
    precision: Any
    approximate: bool
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD):
        d = x_BxTxD.shape[-1]
        x_BxTxD, w_DxF, bias_F = _linear_params(self, x_BxTxD, True)
        if self.options.mlp_kernel == "mosaic" and not self.approximate:
            from isojax.kernels import mlp as kernels
            b, t, _ = x_BxTxD.shape
            if kernels.applies(b * t // self.options.devices(), d, self.features, x_BxTxD.dtype,
                               hopper=self.options.hopper()):
                def local(x_BxTxD, w_DxF, bias_F):
                    u_NxF = kernels.dense_gelu(x_BxTxD.reshape(-1, d), w_DxF, bias_F)
                    return u_NxF.reshape(*x_BxTxD.shape[:2], self.features)

                return self.options.per_device(local, (x_BxTxD,), (w_DxF, bias_F))
        u_BxTxF = _matmul(x_BxTxD, w_DxF, self.precision) + bias_F
        return gelu(u_BxTxF, self.approximate, self.options.fast_gelu)


def activation(name: str, u, fast_gelu: bool):
    if name in ACTIVATIONS:
        return gelu(u, ACTIVATIONS[name], fast_gelu)
    return jax.nn.relu(u) if name == "relu" else jax.nn.silu(u)


def gated(parent: nn.Module, cfg: ModelConfig, options: ForwardOptions, x_BxTxD, up: str):
    """act(gate x) * up x, its products named in `parent`; with options.mlp_kernel "mosaic", SiLU and
    no biases, where isojax.kernels.mlp applies, one Hopper kernel (dense_swiglu) on each device's
    rows."""
    f, d = cfg.intermediate_size, x_BxTxD.shape[-1]
    gate, up = (linear(parent, cfg, f, cfg.mlp_bias, name) for name in ("gate", up))
    if options.mlp_kernel == "mosaic" and cfg.hidden_act == "silu" and not cfg.mlp_bias:
        from isojax.kernels import mlp as kernels
        b, t, _ = x_BxTxD.shape
        if kernels.applies(b * t // options.devices(), d, f, parent.dtype, gated=True, hopper=options.hopper()):
            (x_BxTxD, wg_DxF), (_, wu_DxF) = gate(x_BxTxD, weights=True), up(x_BxTxD, weights=True)

            def local(x_BxTxD, wg_DxF, wu_DxF):
                return kernels.dense_swiglu(x_BxTxD.reshape(-1, d), wg_DxF, wu_DxF).reshape(*x_BxTxD.shape[:2], f)

            return options.per_device(local, (x_BxTxD,), (wg_DxF, wu_DxF))
    return activation(cfg.hidden_act, gate(x_BxTxD), options.fast_gelu) * up(x_BxTxD)


def feed_forward(parent: nn.Module, cfg: ModelConfig, options: ForwardOptions, x_BxTxD, up: str, down: str):
    """down(act(up x)), or SwiGLU's down(act(gate x) * up x) (gated), its products named in `parent`;
    the exact GELU with a bias through DenseGelu, which runs the fused kernel where options.mlp_kernel
    says."""
    dense = lambda features, name: linear(parent, cfg, features, cfg.mlp_bias, name)
    f, fast = cfg.intermediate_size, options.fast_gelu
    if cfg.gated_mlp:
        u_BxTxF = gated(parent, cfg, options, x_BxTxD, up)
    elif cfg.hidden_act in ACTIVATIONS and cfg.mlp_bias:
        u_BxTxF = DenseGelu(f, parent.dtype, parent.param_dtype, parent.precision, ACTIVATIONS[cfg.hidden_act],
                            options, name=up, parent=parent)(x_BxTxD)
    else:
        u_BxTxF = activation(cfg.hidden_act, dense(f, up)(x_BxTxD), fast)
    return dense(cfg.hidden_size, down)(u_BxTxF)


class Part(nn.Module):
    """A part of the trunk: the config, the compute and parameter dtypes, the products' precision
    and the forward's options."""

    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions


class MLP(Part):
    """The MLP of the families other than GPT-NeoX (whose products sit in the block): "up",
    "down" and SwiGLU's "gate" (feed_forward)."""


    @nn.compact
    def __call__(self, x_BxTxD):
        return feed_forward(self, self.cfg, self.options, x_BxTxD, "up", "down")


class Attention(Part):
    """Causal attention within packed sequences with G key/value heads for H query heads
    (G = H: multi-head; G = 1: multi-query), from one fused q, k, v projection."""


    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        cfg = self.cfg
        b, t, d = x_BxTxD.shape
        h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        n = h + 2 * g
        qkv_name = "query_key_value" if cfg.neox_tree else "qkv"
        out = linear(self, cfg, d, cfg.out_bias, "dense")
        attention = self.options.attention
        if attention == "packed":  # bias, clip, q/k norms, rotary and segments inside one kernel
            # (where: device/kernel_choice.py); without rotary (learned positions) no tables
            from isojax.kernels import packed_attention
            product, bias_N = Projection(n * k, cfg.qkv_bias, self.dtype, self.param_dtype, self.precision,
                                         name=qkv_name)(x_BxTxD, split_bias=True)
            if cfg.neox_tree:
                kernel = functools.partial(packed_attention.attention, interpret=self.options.interpret())
                qkv, extras = product.reshape(b, t, h, 3, k), dict(bias_Hx3xK=bias_N.reshape(h, 3, k))
            else:
                kernel = functools.partial(packed_attention.attention_grouped, num_heads=h, clip=cfg.clip_qkv,
                                           norm_eps=cfg.layer_norm_eps, interpret=self.options.interpret())
                qkv, extras = product.reshape(b, t, n, k), {} if bias_N is None else dict(bias_NxK=bias_N.reshape(n, k))
                if cfg.qk_norm:  # the norms' weights per head (the kernel's call reduces each row's factors)
                    extras["norm_weights"] = tuple(
                        make_norm(cfg, self.dtype, self.param_dtype, name)(
                            jax.ShapeDtypeStruct((b, t, heads * k), self.dtype), params_only=True).reshape(heads, k)
                        for name, heads in (("q_norm", h), ("k_norm", g)))
            tables = () if cos_BxTxR is None else (cos_BxTxR, sin_BxTxR)
            out_BxTxHxK = self.options.per_device(
                lambda qkv, seg, *rest: kernel(qkv, *(rest[:-1] or (None, None)), seg, **rest[-1]),
                (qkv, segment_ids_BxT, *tables), (extras,))
            return out(out_BxTxHxK.reshape(b, t, h * k))
        qkv = linear(self, cfg, n * k, cfg.qkv_bias, qkv_name)
        if cfg.neox_tree:  # multi-head, every head's (q, k, v) side by side
            qkv_BxTxHx3xK = qkv(x_BxTxD).reshape(b, t, h, 3, k)
            rotate = (lambda x: apply_rotary(x, cos_BxTxR, sin_BxTxR)) if cfg.rotary_dims else (lambda x: x)
            q, kk = rotate(qkv_BxTxHx3xK[..., 0, :]), rotate(qkv_BxTxHx3xK[..., 1, :])
            v = qkv_BxTxHx3xK[..., 2, :]
        else:
            qkv_BxTxNxK = qkv(x_BxTxD).reshape(b, t, n, k)
            if cfg.clip_qkv is not None:
                qkv_BxTxNxK = jnp.clip(qkv_BxTxNxK, -cfg.clip_qkv, cfg.clip_qkv)
            q, kk, v = qkv_BxTxNxK[:, :, :h], qkv_BxTxNxK[:, :, h:h + g], qkv_BxTxNxK[:, :, h + g:]
            if cfg.qk_norm:  # over all heads together, as OLMo-2's q_norm / k_norm
                q = make_norm(cfg, self.dtype, self.param_dtype, "q_norm")(q.reshape(b, t, h * k)).reshape(q.shape)
                kk = make_norm(cfg, self.dtype, self.param_dtype, "k_norm")(kk.reshape(b, t, g * k)).reshape(kk.shape)
            if cfg.rotary_dims:
                q, kk = apply_rotary(q, cos_BxTxR, sin_BxTxR), apply_rotary(kk, cos_BxTxR, sin_BxTxR)
        if attention in ("cudnn", "auto"):  # jax's fused attention takes the G heads itself; the mask is
            # causal already, and saying so lets cuDNN skip the blocks above the diagonal
            impl = None if attention == "auto" else attention
            out_BxTxHxK = jax.nn.dot_product_attention(q, kk, v, mask=mask_Bx1xTxT,
                                                       is_causal=self.options.cudnn_causal, implementation=impl)
            return out(out_BxTxHxK.reshape(b, t, h * k))
        if not cfg.neox_tree:
            kk, v = jnp.repeat(kk, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
        if attention == "xla":
            out_BxTxHxK = attention_xla(q, kk, v, mask_Bx1xTxT, self.precision)
        else:
            # a Mosaic kernel XLA cannot partition: one call per device's rows
            out_BxTxHxK = self.options.per_device(attention_pallas_tpu, (q, kk, v, segment_ids_BxT), ())
        return out(out_BxTxHxK.reshape(b, t, h * k))
