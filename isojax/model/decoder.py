"""The decoder trunk in Flax (linen), one for every family: GPT-NeoX, GPT-2, OPT, Falcon, Phi,
Gemma and the Llama family (Llama, Mistral, Qwen2, OLMo, OLMo-2), each matching its Hugging Face
PyTorch model. The config's family fields (isojax.model.config.ModelConfig) pick the norm, the
positions, the attention's heads and biases, the MLP, the residual layout and the parameter tree
(isojax.model.layers).

Axes: B rows, T positions in a row, D hidden, H heads, G key/value heads, K head dim, R rotary
dims, F MLP width, L blocks, S = L + 2 hidden states (embed, block_1 .. block_L, final_ln).

Rows may be packed: `segment_ids_BxT` (0 = padding, 1, 2, ... one per sequence) keep attention
inside a sequence, and `positions_BxT` restart at 0 in each sequence, so a packed row gives
exactly the states each sequence gives alone.

The L blocks run under `nn.scan` with their weights stacked on a leading axis, so compile time
does not grow with depth. Every hidden state is handed to an `observe(obs, s, x_BxTxD) -> obs`
function in order (s = 0 .. L+1; state s in the scan step of block s + 1): statistics consume
states inside the scan and no [S, B, T, D] tensor is ever materialized unless the observer
builds one.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from isojax.model.config import ModelConfig
from isojax.model.layers import MLP, Attention, Part, feed_forward, layer_norm_pair, make_norm
from isojax.numerics import rotary_tables, segment_mask
from isojax.model.options import ForwardOptions

Observer = Callable[[Any, Any, jax.Array], Any]


class DecoderBlock(Part):
    """One block: its norms, attention and MLP in the family's residual layout."""

    @nn.compact
    def __call__(self, x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        cfg = self.cfg
        norm = lambda name: make_norm(cfg, self.dtype, self.param_dtype, name)
        attn = lambda h: Attention(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                   name="attention")(h, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        if cfg.neox_tree:  # GPT-NeoX's MLP products sit in the block
            mlp = lambda h: feed_forward(self, cfg, self.options, h, "dense_h_to_4h", "dense_4h_to_h")
        else:
            mlp = MLP(cfg, self.dtype, self.param_dtype, self.precision, self.options, name="mlp")
        if cfg.post_sublayer_norms:  # OLMo-2: the norms sit on the sublayers' outputs
            h = norm("post_attention_layernorm")(attn(x_BxTxD)) + x_BxTxD
            return norm("post_feedforward_layernorm")(mlp(h)) + h
        if cfg.use_parallel_residual:
            if cfg.shared_input_norm:  # Falcon-7B, Phi: attention and MLP read one norm
                h = norm("input_layernorm")(x_BxTxD)
                return mlp(h) + attn(h) + x_BxTxD
            # both norms read x: one kernel for the two LayerNorms where options.norm_kernel says
            h_attn, h_mlp = layer_norm_pair(norm("input_layernorm"), norm("post_attention_layernorm"), x_BxTxD,
                                            self.options)
            a_BxTxD = attn(h_attn)
            return mlp(h_mlp) + a_BxTxD + x_BxTxD
        h = attn(norm("input_layernorm")(x_BxTxD)) + x_BxTxD
        return mlp(norm("post_attention_layernorm")(h)) + h


BARRIER_FROM_WIDTH = 1024


class ObservedBlock(Part):
    """One scan step: hand the block's input (state s - 1) to the observer, run block s. The
    observer's work does not feed the block, so XLA may overlap the two (the statistics'
    collectives with the block's products)."""

    observe: Observer

    @nn.compact
    def __call__(self, carry, s, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT):
        x_BxTxD, obs = carry
        # From this width on, the observer reads the state through a barrier: without it XLA copies
        # the scan's carry every layer; at narrow widths the barrier costs more than the copy
        # (measured: bench/RESULTS.md 10e, 10h).
        seen_BxTxD = jax.lax.optimization_barrier(x_BxTxD) if x_BxTxD.shape[-1] >= BARRIER_FROM_WIDTH else x_BxTxD
        obs = self.observe(obs, s - 1, seen_BxTxD)
        x_BxTxD = DecoderBlock(self.cfg, self.dtype, self.param_dtype, self.precision, self.options,
                               name="block")(x_BxTxD, cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        return (self.options.constrain(x_BxTxD), obs), None


class Decoder(nn.Module):
    """The trunk of every family. `__call__` returns the observer's final state; see the module
    docstring.

    `precision` is HIGHEST for float32 compute (no TF32 on GPUs: exact float32) and DEFAULT
    otherwise. `options`: attention kernel, GELU, fused kernels, activation sharding
    (options.ForwardOptions).
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
        if not cfg.tie_word_embeddings:  # no metric needs logits, but the weights belong to the model
            self.param("embed_out", init, (cfg.hidden_size, cfg.vocab_size), self.param_dtype)
        if cfg.unembed_bias:
            self.param("embed_out_bias", nn.initializers.zeros_init(), (cfg.vocab_size,), self.param_dtype)
        x_BxTxD = jnp.take(embed_VxD, tokens_BxT, axis=0)
        if cfg.embed_scale:  # Gemma: the normalizer sqrt(d) in float32, rounded to the weights' dtype, as HF
            x_BxTxD = x_BxTxD * jnp.asarray(np.float32(cfg.hidden_size ** 0.5), self.param_dtype)
        x_BxTxD = x_BxTxD.astype(self.dtype)
        if cfg.learned_positions:  # hidden_states[0] = token + position embedding (GPT-2, OPT)
            table_PxD = self.param("position_embeddings", init, (cfg.position_table_rows(), cfg.hidden_size),
                                   self.param_dtype)
            x_BxTxD = x_BxTxD + jnp.take(table_PxD, positions_BxT + cfg.position_offset, axis=0).astype(self.dtype)
        x_BxTxD = self.options.constrain(x_BxTxD)
        cos_BxTxR = sin_BxTxR = None
        if cfg.rotary_dims:
            cos_BxTxR, sin_BxTxR = rotary_tables(positions_BxT, cfg)
        # the pallas and packed kernels take the segment ids themselves: no [B, 1, T, T] mask is built
        mask_Bx1xTxT = None if self.options.attention in ("pallas", "packed") else segment_mask(segment_ids_BxT)
        layers = nn.scan(ObservedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers)
        (x_BxTxD, obs), _ = layers(cfg, self.dtype, self.param_dtype, self.precision, self.options,
                                   observe, name="layers")(
            (x_BxTxD, obs), jnp.arange(1, cfg.num_layers + 1), cos_BxTxR, sin_BxTxR, mask_Bx1xTxT, segment_ids_BxT)
        h_BxTxD = make_norm(cfg, self.dtype, self.param_dtype, "final_layer_norm")(x_BxTxD)
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
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype)
    tokens, seg, pos = single_row(np.zeros(4, np.int32))
    noop = lambda obs, s, x: obs
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, seg, pos, None, noop))["params"]


def model_class(cfg: ModelConfig):
    """The Flax module of every config: the one trunk, Decoder."""
    return Decoder
