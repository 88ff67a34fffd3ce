"""Numerics shared by the Flax model (isojax.model) and the kernels (isojax.kernels), below both:
erf and GELU as Hugging Face computes them, rotary embeddings, the packed-row segment mask and the
reference attentions. JAX only: it imports nothing of isojax, so the kernels import only JAX and it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # the compute dtypes a run may name

# Rational approximation of erf on [-4, 4] (odd degree-13 numerator, even degree-8
# denominator; Eigen's generic_fast_erf_float): |error| <= 4.5e-7 against float64 erf.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def fast_erf(x):
    """erf in float32 from 12 multiply-adds and one division (erf(4) == 1 in float32); written with
    the ops Mosaic GPU lowers, as isojax.kernels.mlp applies it inside a kernel too."""
    x = jnp.minimum(jnp.maximum(x.astype(jnp.float32), -4.0), 4.0)
    x2 = x * x
    p = jnp.full_like(x, _ERF_P[0])
    for c in _ERF_P[1:]:
        p = p * x2 + c
    q = jnp.full_like(x, _ERF_Q[0])
    for c in _ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


def gelu(u, approximate: bool, fast: bool = True):
    """GELU as Hugging Face computes it. The exact (erf) GELU of a bfloat16 input is computed
    in float32 with fast_erf and rounded once, as PyTorch's bf16 GELU (float32 inside) is: it
    differs from the float64 GELU by at most half a bf16 ulp + 2e-6 (a one-ulp difference on
    7.7% of normal(0, 3) inputs, almost all where u < 0 and |GELU| is small; jax.nn.gelu in bf16
    arithmetic misses on 41%: tests/test_model.py). XLA's own erf made this elementwise pass
    the slowest in the layer (bench/RESULTS.md). Float32 forwards, and fast=False, use jax's
    erf."""
    if u.dtype == jnp.float32 or (not approximate and not fast):
        return jax.nn.gelu(u, approximate=approximate)
    uf = u.astype(jnp.float32)
    if approximate:  # tanh GELU, likewise in float32 and rounded once
        return jax.nn.gelu(uf, approximate=True).astype(u.dtype)
    return (uf * (0.5 + 0.5 * fast_erf(uf * np.float32(np.sqrt(0.5))))).astype(u.dtype)


def rotary_tables(positions_BxT, cfg):
    """cos, sin [B, T, R] in float32, as Hugging Face: freqs = pos * inv_freq, emb = [freqs, freqs]
    (cfg: a ModelConfig, read for rotary_dims and rotary_emb_base)."""
    r = cfg.rotary_dims
    inv_freq_R2 = (1.0 / cfg.rotary_emb_base ** (np.arange(0, r, 2, dtype=np.float64) / r)).astype(np.float32)
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_R2
    emb_BxTxR = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb_BxTxR), jnp.sin(emb_BxTxR)


def apply_rotary(x_BxTxHxK, cos_BxTxR, sin_BxTxR):
    """Rotate-half rotary embedding on the first R dims of each head; the rest pass through."""
    r = cos_BxTxR.shape[-1]
    cos = cos_BxTxR[:, :, None, :].astype(x_BxTxHxK.dtype)
    sin = sin_BxTxR[:, :, None, :].astype(x_BxTxHxK.dtype)
    x_rot, x_pass = x_BxTxHxK[..., :r], x_BxTxHxK[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = x_rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, x_pass], axis=-1)


def segment_mask(segment_ids_BxT):
    """[B, 1, T, T] True where query q may attend key k: same segment and k <= q."""
    t = segment_ids_BxT.shape[1]
    same = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return (same & causal)[:, None]


def attention_xla(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask_Bx1xTxT, precision):
    """Plain attention: scores in the compute dtype, softmax in float32 (as Hugging Face's eager path)."""
    scale = q_BxTxHxK.shape[-1] ** -0.5
    scores = jnp.einsum("bqhk,bshk->bhqs", q_BxTxHxK, k_BxTxHxK, precision=precision)
    scores = jnp.where(mask_Bx1xTxT, scores.astype(jnp.float32) * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxTxHxK.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v_BxTxHxK, precision=precision)


def attention_pallas_tpu(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, segment_ids_BxT):
    """Pallas flash attention for TPUs (jax.experimental.pallas.ops.tpu) with segment ids:
    causal within each packed sequence, no [B, H, T, T] scores in memory; T a multiple of 128.
    Tested on CPU in Pallas' TPU interpret mode against attention_xla (tests/test_model.py)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    seg = fa.SegmentIds(q=segment_ids_BxT, kv=segment_ids_BxT)
    t = q_BxTxHxK.shape[1]
    blocks = fa.BlockSizes(block_q=min(512, t), block_k_major=min(512, t), block_k=min(512, t), block_b=1)
    out_BxHxTxK = fa.flash_attention(*(x.transpose(0, 2, 1, 3) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)),
                                     segment_ids=seg, causal=True, sm_scale=q_BxTxHxK.shape[-1] ** -0.5,
                                     block_sizes=blocks)
    return out_BxHxTxK.transpose(0, 2, 1, 3)
