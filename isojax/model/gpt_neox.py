"""GPT-NeoX forward pass in Flax (linen), matching Hugging Face's `GPTNeoXModel`.

Axes: B rows, T positions in a row, D hidden, H heads, K head dim, R rotary dims, F MLP width,
L blocks, S = L + 2 hidden states (embed, block_1 .. block_L, final_ln).

Rows may be packed: `segment_ids_BxT` (0 = padding, 1, 2, ... one per sequence) keep attention
inside a sequence, and `positions_BxT` restart at 0 in each sequence, so a packed row gives
exactly the states each sequence gives alone.

The L blocks run under `nn.scan` with their weights stacked on a leading axis, so compile time
does not grow with depth. Every hidden state is handed to an `observe(obs, s, x_BxTxD) -> obs`
function in order (s = 0 .. L+1; state s in the scan step of block s + 1): statistics consume
states inside the scan and no
[S, B, T, D] tensor is ever materialized unless the observer builds one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from isojax.model.config import ACTIVATIONS, ModelConfig
from isojax.model.ops import apply_rotary, attention_pallas_tpu, attention_xla, gelu, rotary_tables, segment_mask
from isojax.model.options import ForwardOptions

Observer = Callable[[Any, Any, jax.Array], Any]



class LayerNorm(nn.Module):
    """LayerNorm with statistics in float32 (two-pass variance), output in `dtype`."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD, params_only: bool = False):
        """LayerNorm(x); params_only: (scale, bias) in float32 instead (layer_norm_pair)."""
        d = x_BxTxD.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        if params_only:
            return scale.astype(jnp.float32), bias.astype(jnp.float32)
        x = x_BxTxD.astype(jnp.float32)
        xc = x - x.mean(-1, keepdims=True)
        var = (xc * xc).mean(-1, keepdims=True)
        y = xc * jax.lax.rsqrt(var + self.eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


def layer_norm_pair(first: LayerNorm, second: LayerNorm, x_BxTxD, options):
    """(first(x), second(x)): one Pallas kernel reading x once (isojax.kernels.norm) with
    options.norm_kernel "pallas" where it applies, else the two LayerNorms."""
    if options.norm_kernel == "pallas":
        from isojax.kernels import norm as norm_kernel
        b, t, d = x_BxTxD.shape
        rows = b * t // options.devices()
        if norm_kernel.applies(d, first.dtype) and rows % norm_kernel.rows_per_block(d) == 0:
            def local(x_BxTxD, s1, b1, s2, b2):
                y1, y2 = norm_kernel.layer_norm_pair(x_BxTxD.reshape(-1, d), s1, b1, s2, b2, eps=first.eps)
                return y1.reshape(x_BxTxD.shape), y2.reshape(x_BxTxD.shape)

            x_BxTxD = x_BxTxD.astype(first.dtype)
            return options.per_device(local, (x_BxTxD,), (*first(x_BxTxD, True), *second(x_BxTxD, True)))
    return first(x_BxTxD), second(x_BxTxD)


def _dense(parent: nn.Module, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=parent.dtype, param_dtype=parent.param_dtype, precision=parent.precision,
                    name=name, parent=parent)


def _dense_params(module: nn.Module, x_BxTxD):
    """nn.Dense's parameters, "kernel" [D, F] and "bias" [F] (module.features wide), and x, all
    promoted to module.dtype as nn.Dense promotes them."""
    d = x_BxTxD.shape[-1]
    w_DxF = module.param("kernel", nn.initializers.lecun_normal(), (d, module.features), module.param_dtype)
    bias_F = module.param("bias", nn.initializers.zeros_init(), (module.features,), module.param_dtype)
    return nn.dtypes.promote_dtype(x_BxTxD, w_DxF, bias_F, dtype=module.dtype)


def _matmul(x_BxTxD, w_DxF, precision):
    """x @ W over the last axis, as nn.Dense computes it."""
    return jax.lax.dot_general(x_BxTxD, w_DxF, (((2,), (0,)), ((), ())), precision=precision)


class Product(nn.Module):
    """nn.Dense's parameters ("kernel" [D, F], "bias" [F]) and product, with the bias returned
    rather than added, for a kernel that adds it as it loads the product: (x @ W, b)."""

    features: int
    dtype: Any
    param_dtype: Any
    precision: Any

    @nn.compact
    def __call__(self, x_BxTxD):
        x_BxTxD, w_DxF, bias_F = _dense_params(self, x_BxTxD)
        return _matmul(x_BxTxD, w_DxF, self.precision), bias_F


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
        x_BxTxD, w_DxF, bias_F = _dense_params(self, x_BxTxD)
        if self.options.mlp_kernel == "mosaic" and not self.approximate:
            from isojax.kernels import mlp as kernels
            b, t, _ = x_BxTxD.shape
            if kernels.applies(b * t // self.options.devices(), d, self.features, x_BxTxD.dtype):
                def local(x_BxTxD, w_DxF, bias_F):
                    u_NxF = kernels.dense_gelu(x_BxTxD.reshape(-1, d), w_DxF, bias_F)
                    return u_NxF.reshape(*x_BxTxD.shape[:2], self.features)

                return self.options.per_device(local, (x_BxTxD,), (w_DxF, bias_F))
        u_BxTxF = _matmul(x_BxTxD, w_DxF, self.precision) + bias_F
        return gelu(u_BxTxF, self.approximate, self.options.fast_gelu)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        b, t, d = x_BxTxD.shape
        h, k = self.cfg.num_heads, self.cfg.head_dim
        dense = functools.partial(_dense, self)
        attention = self.options.attention
        # Hugging Face's fused layout: output columns grouped per head as (q, k, v).
        if attention == "packed":  # bias, rotary, slicing and segments inside one kernel, per device
            from isojax.kernels import packed_attention
            product, bias = Product(3 * d, self.dtype, self.param_dtype, self.precision,
                                    name="query_key_value")(x_BxTxD)
            out_BxTxHxK = self.options.per_device(
                packed_attention.attention, (product.reshape(b, t, h, 3, k), cos_BxTxR, sin_BxTxR, segment_ids_BxT),
                (bias.reshape(h, 3, k),))
            return dense(d, "dense")(out_BxTxHxK.reshape(b, t, d))
        qkv_BxTxHx3xK = dense(3 * d, "query_key_value")(x_BxTxD).reshape(b, t, h, 3, k)
        q = apply_rotary(qkv_BxTxHx3xK[..., 0, :], cos_BxTxR, sin_BxTxR)
        kk = apply_rotary(qkv_BxTxHx3xK[..., 1, :], cos_BxTxR, sin_BxTxR)
        v = qkv_BxTxHx3xK[..., 2, :]
        if attention == "xla":
            out_BxTxHxK = attention_xla(q, kk, v, mask_Bx1xTxT, self.precision)
        elif attention == "pallas":
            # a Mosaic kernel XLA cannot partition: one call per device's rows
            out_BxTxHxK = self.options.per_device(attention_pallas_tpu, (q, kk, v, segment_ids_BxT), ())
        else:  # "cudnn" or "auto": jax's fused attention with the same boolean mask; the mask
            # is causal already, and saying so lets cuDNN skip the blocks above the diagonal
            impl = None if attention == "auto" else attention
            out_BxTxHxK = jax.nn.dot_product_attention(q, kk, v, mask=mask_Bx1xTxT,
                                                       is_causal=self.options.cudnn_causal, implementation=impl)
        return dense(d, "dense")(out_BxTxHxK.reshape(b, t, d))


class Block(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions

    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        cfg = self.cfg
        ln = lambda name: LayerNorm(cfg.layer_norm_eps, self.dtype, self.param_dtype, name=name)
        dense = functools.partial(_dense, self)

        def mlp(h_BxTxD):
            u_BxTxF = DenseGelu(cfg.intermediate_size, self.dtype, self.param_dtype, self.precision,
                                ACTIVATIONS[cfg.hidden_act], self.options, name="dense_h_to_4h")(h_BxTxD)
            return dense(cfg.hidden_size, "dense_4h_to_h")(u_BxTxF)

        if cfg.use_parallel_residual:  # both LayerNorms read x
            h_attn, h_mlp = layer_norm_pair(ln("input_layernorm"), ln("post_attention_layernorm"), x_BxTxD,
                                            self.options)
            attn = Attention(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                             name="attention")(h_attn, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
            return mlp(h_mlp) + attn + x_BxTxD
        attn = Attention(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                         name="attention")(ln("input_layernorm")(x_BxTxD), cos_BxTxR, sin_BxTxR, mask_Bx1xTxT,
                                           segment_ids_BxT)
        h = attn + x_BxTxD
        return mlp(ln("post_attention_layernorm")(h)) + h


BARRIER_FROM_WIDTH = 1024


class ObservedBlock(nn.Module):
    """One scan step: hand the block's input (state s - 1) to the observer, run block s. The
    observer's work does not feed the block, so XLA may overlap the two (the statistics'
    collectives with the block's products)."""

    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    precision: Any
    options: ForwardOptions
    observe: Observer
    block_type: Any = Block  # the family's block (isojax.model.decoder.DecoderBlock for the others)

    @nn.compact
    def __call__(self, carry, s, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        x_BxTxD, obs = carry
        # From this width on, the observer reads the state through a barrier: without it XLA copies
        # the scan's carry every layer; at narrow widths the barrier costs more than the copy
        # (measured: bench/RESULTS.md 10e, 10h).
        seen_BxTxD = jax.lax.optimization_barrier(x_BxTxD) if x_BxTxD.shape[-1] >= BARRIER_FROM_WIDTH else x_BxTxD
        obs = self.observe(obs, s - 1, seen_BxTxD)
        x_BxTxD = self.block_type(self.cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                  name="block")(x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        return (self.options.constrain(x_BxTxD), obs), None


class GPTNeoX(nn.Module):
    """GPT-NeoX trunk. `__call__` returns the observer's final state; see module docstring.

    `precision` is HIGHEST for float32 compute (no TF32 on GPUs: exact float32) and DEFAULT
    otherwise. `options`: attention kernel, GELU, activation sharding (options.ForwardOptions).
    """

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
        # The untied unembedding: no metric here needs logits, but the weights belong to the model.
        self.param("embed_out", init, (cfg.hidden_size, cfg.vocab_size), self.param_dtype)

        x_BxTxD = self.options.constrain(jnp.take(embed_VxD, tokens_BxT, axis=0).astype(self.dtype))
        cos_BxTxR, sin_BxTxR = rotary_tables(positions_BxT, cfg)
        # the pallas kernel takes the segment ids themselves: no [B, 1, T, T] mask is built
        mask_Bx1xTxT = None if self.options.attention in ("pallas", "packed") else segment_mask(segment_ids_BxT)
        layers = nn.scan(ObservedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers)
        (x_BxTxD, obs), _ = layers(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                   observe, name="layers")(
            (x_BxTxD, obs), jnp.arange(1, cfg.num_layers + 1), cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        h_BxTxD = LayerNorm(cfg.layer_norm_eps, self.dtype, self.param_dtype, name="final_layer_norm")(x_BxTxD)
        return observe_last_two(observe, obs, x_BxTxD, h_BxTxD, cfg.num_layers)


def observe_last_two(observe: Observer, obs, x_BxTxD, h_BxTxD, num_layers: int):
    """Hand the last block's output x (state L) and the final norm's h (state L + 1) to the observer."""
    # They are observed in a loop too: an update
    # of the scan's output outside any loop makes XLA copy every accumulator it touches (a
    # second copy of every Gram: 13 GB per device at gpt-neox-20b; bench/RESULTS.md 7b).
    # The state is taken out of the stack first (a barrier: a copy of [B, T, D]); fused into the
    # per-token scatter, the dynamic slice makes that scatter many times slower
    # (bench/RESULTS.md 10e).
    last_2xBxTxD = jnp.stack([x_BxTxD, h_BxTxD.astype(x_BxTxD.dtype)])
    return jax.lax.fori_loop(0, 2, lambda i, obs: observe(
        obs, num_layers + i, jax.lax.optimization_barrier(last_2xBxTxD[i])), obs)


def collect_states(buf_SxBxTxD, s, x_BxTxD):
    """Observer that writes every state into a preallocated [S, B, T, D] buffer."""
    return jax.lax.dynamic_update_index_in_dim(buf_SxBxTxD, x_BxTxD.astype(buf_SxBxTxD.dtype), s, 0)


def single_row(token_ids_T):
    """One unpacked sequence as a [1, T] row: segment 1 everywhere, positions 0..T-1."""
    t = len(token_ids_T)
    return (np.asarray(token_ids_T, np.int32)[None], np.ones((1, t), np.int32), np.arange(t, dtype=np.int32)[None])


def param_shapes(cfg: ModelConfig, dtype=jnp.float32):
    """Parameter shapes without allocating (jax.eval_shape)."""
    model = GPTNeoX(cfg, dtype=dtype, param_dtype=dtype)
    tokens, seg, pos = single_row(np.zeros(4, np.int32))
    noop = lambda obs, s, x: obs
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, seg, pos, None, noop))["params"]
