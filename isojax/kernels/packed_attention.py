"""Attention over packed rows for GPUs, one Pallas (Triton) kernel: rotary embedding in the
prologue and only the key blocks a query block's sequences reach.

cuDNN's fused attention (the default on GPUs) takes the rotated q and k and a dense v, so XLA
first slices the fused [B, T, H, 3, K] projection and rotates q and k: three passes over the
activations (bench/RESULTS.md 10c). It then visits every key
block on and below the diagonal, although in a packed row a query sees only its own sequence.
This kernel reads q, k and v straight from the fused projection (before its bias, which XLA
would otherwise add in a pass of its own), adds the bias and applies Hugging Face's rotate-half
rotary to the first R dims of q and k as it loads them, and starts each query block's loop at
the key block that holds the start of its first query's sequence. Grouped- and multi-query
attention (`attention_grouped`: H query heads, G key/value heads) reads the same way from a
[B, T, H + 2G, K] projection, each query head's program loading its group's k and v: no head is
copied. Without rotary (R = 0: learned positions, GPT-2 and OPT) no tables are read. The grouped
kernel also takes the rest of the families' attention, in isojax.model.layers' order: OLMo's
clip of q, k and v to [-c, c] after the bias, and OLMo-2's RMSNorms over all heads of q and of k
before the rotary. A head's program sees one head, so each row's two norm factors
rsqrt(mean(x^2) + eps) (over the H*K query and the G*K key columns) are reduced by XLA before the
kernel, which applies round(w * (x * factor)) in float32 with the head's weights as it loads q
and k (layers.Norm with scale_in_float32).

Numbers: the rotation rounds as PyTorch's bf16 rotary does (q*cos, rotate_half(q)*sin and
their sum, each to bf16; rotate_half is a product with a signed permutation, exact); scores and
the softmax are float32 (base-2 exponentials, as jax's Pallas attention), the probabilities are
rounded to bf16 for the product with v, as flash attention kernels do. Scores are two products,
[q_R, k_R] over the rotary dims and [q_pass, k] over the rest (q's rotary columns zeroed), so
every block shape stays a power of two.

Assumes what isojax's packing gives: each segment id (0 = padding) occupies one contiguous run
of a row. Applies where the head dim K is a power of two >= 16, the rotary dims R are 0 or one
too, and the row length is a multiple of the blocks (`applies`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

_MASKED = -0.7 * float(np.finfo(np.float32).max)
_F32 = jnp.float32


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def applies(row_len: int, head_dim: int, rotary_dims: int, dtype, block_q: int = 64, block_k: int = 64) -> bool:
    """Whether the kernel takes these shapes: bf16, K a power of two >= 16, R 0 or one too, R <= K,
    rows a multiple of the blocks."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and _pow2(head_dim) and (rotary_dims == 0 or _pow2(rotary_dims))
            and rotary_dims <= head_dim and row_len % block_q == 0 and row_len % block_k == 0)


def segment_starts(segment_ids_BxT):
    """[B, T] int32: the position where each position's run of equal segment ids begins."""
    t = segment_ids_BxT.shape[1]
    new_run = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                               segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    return lax.cummax(jnp.where(new_run, jnp.arange(t, dtype=jnp.int32), 0), axis=1)


def rotate_half_matrix(r: int) -> np.ndarray:
    """[R, R] signed permutation P with x @ P = rotate_half(x) = [-x2, x1]."""
    p = np.zeros((r, r), np.float32)
    h = r // 2
    p[np.arange(h) + h, np.arange(h)] = -1.0
    p[np.arange(h), np.arange(h) + h] = 1.0
    return p


def _rotate(x_NxR, cos_NxR, sin_NxR, p_RxR):
    """Hugging Face's bf16 rotary of x's first R dims: round(round(x cos) + round(rh(x) sin))."""
    bf = x_NxR.dtype
    half = jnp.dot(x_NxR, p_RxR, preferred_element_type=_F32)  # exact: one +-x per output
    a = (x_NxR.astype(_F32) * cos_NxR.astype(_F32)).astype(bf)
    b = (half * sin_NxR.astype(_F32)).astype(bf)
    return (a.astype(_F32) + b.astype(_F32)).astype(bf)


def _rotate_halves(x1, x2, cos1, cos2, sin1, sin2):
    """_rotate by halves, x = [x1, x2] and rotate_half(x) = [-x2, x1], each [N, R/2]: the same
    roundings (round(round(x1 cos1) - round(x2 sin1)), round(round(x2 cos2) + round(x1 sin2))),
    without _rotate's [R, R] product, which costs more than the scores where R = K >= 64."""
    bf = x1.dtype
    rounded = lambda x, t: (x.astype(_F32) * t.astype(_F32)).astype(bf).astype(_F32)
    return (rounded(x1, cos1) - rounded(x2, sin1)).astype(bf), (rounded(x2, cos2) + rounded(x1, sin2)).astype(bf)


def _add(x, bias, clip=None):
    """x + bias rounded to x's dtype, as XLA adds a bf16 bias to a bf16 product; clipped to
    [-clip, clip] (a bf16 number: the same as clipping the rounded sum) where clip is given."""
    y = x.astype(_F32) + bias.astype(_F32)[None, :]
    if clip is not None:
        y = jnp.clip(y, -clip, clip)
    return y.astype(x.dtype)


def _norm(x, w, factor):
    """RMSNorm of rows x [N, C] with weights w [C] and the rows' factors rsqrt(mean(x^2) + eps) [N]:
    round(w * (x * factor)) in float32, as layers.Norm with scale_in_float32; x where w is None."""
    if w is None:
        return x
    return (w.astype(_F32)[None, :] * (x.astype(_F32) * factor[:, None])).astype(x.dtype)


def _kernel(*refs, block_q: int, block_k: int, rot: int, scale: float, clip: float | None, qk_norm: bool):
    """One (query block, row, head): q_ref [block_q, K]; k_ref, v_ref [T, K]; their biases [K];
    with rot > 0, cos/sin [T, R] and P [R, R]; with qk_norm, the head's norm weights wq, wk [K] and
    the row's factors fq, fk [T]; seg_ref, start_ref [T] -> o_ref [block_q, K]."""
    q_ref, k_ref, v_ref, bq_ref, bk_ref, bv_ref, *rest = refs
    cos_ref, sin_ref, p_ref, *rest = rest if rot else [None] * 3 + rest
    wq_ref, wk_ref, fq_ref, fk_ref, *rest = rest if qk_norm else [None] * 4 + rest
    seg_ref, start_ref, o_ref = rest
    i = pl.program_id(0)
    head_dim = q_ref.shape[-1]
    qs, rs = pl.ds(i * block_q, block_q), pl.ds(0, rot)
    cols = lambda ref, c: None if ref is None else ref[c]  # a norm weight's columns, where there is one
    p_RxR = p_ref[...] if rot else None
    fq = fq_ref[qs] if qk_norm else None
    q_QxK = _norm(_add(q_ref[...], bq_ref[...], clip), cols(wq_ref, ...), fq)
    q_pass = q_QxK
    # rotary dims of 64 and more by halves (_rotate_halves); where they are all of K, no product of
    # the other columns
    halves, full = rot >= 64, rot == head_dim
    if rot:
        q_pass = jnp.where(jnp.arange(head_dim)[None, :] < rot, 0.0, q_QxK.astype(_F32)).astype(q_QxK.dtype)
        if halves:
            h1, h2 = pl.ds(0, rot // 2), pl.ds(rot // 2, rot // 2)
            q_h = [_norm(_add(q_ref[:, c], bq_ref[c], clip), cols(wq_ref, c), fq) for c in (h1, h2)]
            q_rot = _rotate_halves(*q_h, cos_ref[qs, h1], cos_ref[qs, h2], sin_ref[qs, h1], sin_ref[qs, h2])
            bias_kh, w_kh = [bk_ref[c] for c in (h1, h2)], [cols(wk_ref, c) for c in (h1, h2)]
        else:
            q_rot = _rotate(_norm(_add(q_ref[:, rs], bq_ref[rs], clip), cols(wq_ref, rs), fq), cos_ref[qs, :],
                            sin_ref[qs, :], p_RxR)
    bias_k, bias_kr, bias_v = bk_ref[...], bk_ref[rs] if rot else None, bv_ref[...]
    w_k, w_kr = cols(wk_ref, ...), cols(wk_ref, rs) if rot else None
    seg_q = seg_ref[qs]
    pos_q = i * block_q + jnp.arange(block_q)

    def body(j, carry):
        o, m_prev, l_prev = carry
        ks = pl.ds(j * block_k, block_k)
        fk = fk_ref[ks] if qk_norm else None
        if halves:
            k_h = [_norm(_add(k_ref[ks, c], bias, clip), w, fk) for c, bias, w in zip((h1, h2), bias_kh, w_kh)]
            k_rot = _rotate_halves(*k_h, cos_ref[ks, h1], cos_ref[ks, h2], sin_ref[ks, h1], sin_ref[ks, h2])
            qk = jnp.dot(q_rot[0], k_rot[0].T, preferred_element_type=_F32) \
                + jnp.dot(q_rot[1], k_rot[1].T, preferred_element_type=_F32)
            if not full:
                qk = qk + jnp.dot(q_pass, _norm(_add(k_ref[ks, :], bias_k, clip), w_k, fk).T,
                                  preferred_element_type=_F32)
        else:
            if rot:
                k_rot = _rotate(_norm(_add(k_ref[ks, rs], bias_kr, clip), w_kr, fk), cos_ref[ks, :], sin_ref[ks, :],
                                p_RxR)
            qk = jnp.dot(q_pass, _norm(_add(k_ref[ks, :], bias_k, clip), w_k, fk).T, preferred_element_type=_F32)
            if rot:  # the rotary dims' product (q_pass holds zeros there)
                qk = qk + jnp.dot(q_rot, k_rot.T, preferred_element_type=_F32)
        qk = qk * scale
        pos_k = j * block_k + jnp.arange(block_k)
        keep = (seg_q[:, None] == seg_ref[ks][None, :]) & (pos_q[:, None] >= pos_k[None, :])
        qk = jnp.where(keep, qk, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(qk, axis=1))
        corr = jnp.exp2(m_prev - m_next)
        s = jnp.exp2(qk - m_next[:, None])
        v = _add(v_ref[ks, :], bias_v, clip)
        o = corr[:, None] * o + jnp.dot(s.astype(v.dtype), v, preferred_element_type=_F32)
        return o, m_next, corr * l_prev + jnp.sum(s, axis=1)

    first = lax.div(jnp.min(start_ref[qs]), block_k)  # the key block of the first query's sequence start
    last = lax.div(block_q * (i + 1) + block_k - 1, block_k)
    init = (jnp.zeros((block_q, head_dim), _F32), jnp.full((block_q,), -jnp.inf, _F32), jnp.zeros((block_q,), _F32))
    o, _, l = lax.fori_loop(first, last, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "num_warps", "num_stages", "interpret"))
def attention(qkv_BxTxHx3xK, cos_BxTxR, sin_BxTxR, segment_ids_BxT, bias_Hx3xK=None, *, block_q: int = 64,
              block_k: int = 64, num_warps: int = 4, num_stages: int | None = None, interpret: bool | None = None):
    """Causal attention within segments from Hugging Face's fused projection [B, T, H, 3, K]
    (per head q, k, v) before bias and rotary, and its bias [H, 3, K], added as the kernel loads
    q, k and v (None: zero); cos/sin [B, T, R] float32 (isojax.numerics.rotary_tables), or None
    without rotary. Returns [B, T, H, K].
    The defaults are the fastest of bench/bench_attention.py's sweep at pythia-70m, 410m and 1.4b
    (stages None: 3 for K <= 64, else 2; bench/RESULTS.md 10c). interpret None: Pallas' interpret mode
    unless the backend is a GPU."""
    b, t, h, _, k = qkv_BxTxHx3xK.shape
    specs = [pl.BlockSpec((None, block_q, None, None, k), lambda i, bi, hi: (bi, i, hi, 0, 0)),
             pl.BlockSpec((None, t, None, None, k), lambda i, bi, hi: (bi, 0, hi, 1, 0)),
             pl.BlockSpec((None, t, None, None, k), lambda i, bi, hi: (bi, 0, hi, 2, 0)),
             pl.BlockSpec((None, None, k), lambda i, bi, hi: (hi, 0, 0)),
             pl.BlockSpec((None, None, k), lambda i, bi, hi: (hi, 1, 0)),
             pl.BlockSpec((None, None, k), lambda i, bi, hi: (hi, 2, 0))]
    return _call(qkv_BxTxHx3xK, bias_Hx3xK, (h, 3, k), specs, h, cos_BxTxR, sin_BxTxR, segment_ids_BxT, block_q,
                 block_k, num_warps, num_stages, interpret)


@functools.partial(jax.jit, static_argnames=("num_heads", "clip", "norm_eps", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def attention_grouped(qkv_BxTxNxK, cos_BxTxR, sin_BxTxR, segment_ids_BxT, bias_NxK=None, norm_weights=None, *,
                      num_heads: int, clip: float | None = None, norm_eps: float = 1e-6, block_q: int = 64,
                      block_k: int = 64, num_warps: int = 4, num_stages: int | None = None,
                      interpret: bool | None = None):
    """`attention` for grouped- and multi-query heads: the projection [B, T, N, K] holds the
    H = num_heads query heads, then G key heads, then G value heads (N = H + 2G; isojax.model.layers'
    layout), each key/value head serving H / G consecutive query heads. No head is copied: query
    head j's program reads key and value head j // (H / G) where they lie. clip: q, k and v
    clipped to [-clip, clip] after the bias (OLMo); norm_weights: (q's [H, K], k's [G, K]) of
    RMSNorms over all heads of q and of k (OLMo-2), with norm_eps, before the rotary."""
    b, t, n, k = qkv_BxTxNxK.shape
    h = num_heads
    g = (n - h) // 2
    if n != h + 2 * g or h % g:
        raise ValueError(f"{n} projected heads are not {h} query heads and two equal groups dividing them")
    group = h // g
    specs = [pl.BlockSpec((None, block_q, None, k), lambda i, bi, hi: (bi, i, hi, 0)),
             pl.BlockSpec((None, t, None, k), lambda i, bi, hi: (bi, 0, h + hi // group, 0)),
             pl.BlockSpec((None, t, None, k), lambda i, bi, hi: (bi, 0, h + g + hi // group, 0)),
             pl.BlockSpec((None, k), lambda i, bi, hi: (hi, 0)),
             pl.BlockSpec((None, k), lambda i, bi, hi: (h + hi // group, 0)),
             pl.BlockSpec((None, k), lambda i, bi, hi: (h + g + hi // group, 0))]
    if clip is not None:
        clip = float(np.asarray(clip, qkv_BxTxNxK.dtype))  # as XLA clips bf16 values: at the bound in bf16
    norm = ()
    if norm_weights is not None:
        factors = _rms_factors(qkv_BxTxNxK, bias_NxK, h, g, clip, norm_eps)
        row = pl.BlockSpec((None, t), lambda i, bi, hi: (bi, 0))
        norm = ((norm_weights[0], pl.BlockSpec((None, k), lambda i, bi, hi: (hi, 0))),
                (norm_weights[1], pl.BlockSpec((None, k), lambda i, bi, hi: (hi // group, 0))),
                (factors[0], row), (factors[1], row))
    return _call(qkv_BxTxNxK, bias_NxK, (n, k), specs, h, cos_BxTxR, sin_BxTxR, segment_ids_BxT, block_q, block_k,
                 num_warps, num_stages, interpret, clip, norm)


def _rms_factors(qkv_BxTxNxK, bias_NxK, h, g, clip, eps):
    """Each row's rsqrt(mean(x^2) + eps) in float32 over its H*K query columns and over its G*K key
    columns, x the bf16 projection plus bias, clipped (as layers.Attention's XLA path): [B, T] each."""
    b, t, _, k = qkv_BxTxNxK.shape
    x = qkv_BxTxNxK[:, :, :h + g]
    if bias_NxK is not None:
        x = x + bias_NxK[:h + g].astype(x.dtype)
    if clip is not None:
        x = jnp.clip(x, -clip, clip)
    factor = lambda y: lax.rsqrt((y * y).mean(-1) + eps)
    return factor(x[:, :, :h].reshape(b, t, h * k).astype(_F32)), factor(x[:, :, h:].reshape(b, t, g * k).astype(_F32))


def _call(qkv, bias, bias_shape, qkv_bias_specs, h, cos_BxTxR, sin_BxTxR, segment_ids_BxT, block_q, block_k,
          num_warps, num_stages, interpret, clip=None, norm=()):
    """The kernel over (query block, row, query head), reading q, k, v and their biases from the
    projection and the bias (None: zeros of bias_shape) where qkv_bias_specs (the blocks of q, k,
    v, then of their biases) say; clip and norm ((array, block) of the q and k norm weights and
    factors, or none) as attention_grouped's."""
    b, t, k = qkv.shape[0], qkv.shape[1], qkv.shape[-1]
    r = 0 if cos_BxTxR is None else cos_BxTxR.shape[-1]
    if not applies(t, k, r, qkv.dtype, block_q, block_k):
        raise ValueError(f"packed attention does not take T={t}, K={k}, R={r}, {qkv.dtype} "
                         f"with blocks {block_q} x {block_k}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    dt = qkv.dtype
    if r:
        cos_BxTxR, sin_BxTxR = cos_BxTxR.astype(dt), sin_BxTxR.astype(dt)  # as Hugging Face: tables in bf16
    starts_BxT = segment_starts(segment_ids_BxT)
    rotary, rotary_specs = (), []
    if r:
        rotary = (cos_BxTxR, sin_BxTxR, jnp.asarray(rotate_half_matrix(r), dt))
        rotary_specs = [pl.BlockSpec((None, t, r), lambda i, bi, hi: (bi, 0, 0)),
                        pl.BlockSpec((None, t, r), lambda i, bi, hi: (bi, 0, 0)),
                        pl.BlockSpec((r, r), lambda i, bi, hi: (0, 0))]
    bias = jnp.zeros(bias_shape, dt) if bias is None else bias.astype(dt)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params = dict(compiler_params=plgpu.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or (3 if k <= 64 else 2)))
    row = lambda i, bi, hi: (bi, 0)
    kernel = functools.partial(_kernel, block_q=block_q, block_k=block_k, rot=r,
                               scale=k ** -0.5 * math.log2(math.e), clip=clip, qk_norm=bool(norm))
    return pl.pallas_call(
        kernel, grid=(t // block_q, b, h),
        in_specs=[*qkv_bias_specs, *rotary_specs, *(spec for _, spec in norm),
                  pl.BlockSpec((None, t), row), pl.BlockSpec((None, t), row)],
        out_specs=pl.BlockSpec((None, block_q, None, k), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, h, k), dt),
        interpret=interpret, name="isojax_packed_attention", **params,
    )(qkv, qkv, qkv, bias, bias, bias, *rotary, *(x for x, _ in norm), segment_ids_BxT.astype(jnp.int32),
      starts_BxT)


def reference(qkv_BxTxHx3xK, cos_BxTxR, sin_BxTxR, segment_ids_BxT, bias_Hx3xK=None, clip=None, norm_weights=None,
              norm_eps=1e-6):
    """What the kernel computes, in float64 numpy from q, k and v biased, clipped, normed and
    rotated in bf16 as isojax.model.layers' XLA path does them (the reference of works() and of the
    tests); cos None: no rotary; norm_weights (q's, k's [H, K]): RMSNorms over all heads."""
    from isojax.numerics import apply_rotary, segment_mask
    x = qkv_BxTxHx3xK
    if bias_Hx3xK is not None:
        x = x + bias_Hx3xK.astype(x.dtype)
    if clip is not None:
        x = jnp.clip(x, -clip, clip)
    q, k, v = x[..., 0, :], x[..., 1, :], x[..., 2, :]
    if norm_weights is not None:
        def norm(y, w_HxK):
            y32 = y.reshape(*y.shape[:2], -1).astype(_F32)
            y32 = y32 * lax.rsqrt((y32 * y32).mean(-1, keepdims=True) + norm_eps)
            return (w_HxK.reshape(-1).astype(_F32) * y32).astype(y.dtype).reshape(y.shape)
        q, k = norm(q, norm_weights[0]), norm(k, norm_weights[1])
    if cos_BxTxR is not None:
        q, k = apply_rotary(q, cos_BxTxR, sin_BxTxR), apply_rotary(k, cos_BxTxR, sin_BxTxR)
    q, k, v = (np.asarray(y.astype(_F32), np.float64) for y in (q, k, v))
    s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.asarray(segment_mask(segment_ids_BxT)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqs,bshk->bqhk", p / p.sum(-1, keepdims=True), v)


_WORKS: dict = {}


def works(head_dim: int, rotary_dims: int, qk_norm: bool = False, clip: bool = False) -> str | None:
    """None where the kernel compiles here for these head shapes (with q/k norms, with a clip: the
    grouped kernel's) and lands within bf16 rounding of the float64 attention on a small packed
    row, else why not (once per process and arguments)."""
    key = (head_dim, rotary_dims, qk_norm, clip)
    if key not in _WORKS:
        t = 128
        qkv, bias = (jax.random.normal(key, shape, _F32).astype(jnp.bfloat16) for key, shape in
                     zip(jax.random.split(jax.random.key(0)), ((1, t, 1, 3, head_dim), (1, 3, head_dim))))
        seg = jnp.asarray(np.repeat([1, 2, 3, 0], [50, 40, 30, 8])[None], jnp.int32)
        pos = jnp.asarray(np.concatenate([np.arange(n) for n in (50, 40, 30, 8)])[None], jnp.int32)
        inv = 1.0 / 10000 ** (np.arange(0, rotary_dims, 2) / rotary_dims) if rotary_dims else None
        emb = np.concatenate([pos[..., None] * inv] * 2, -1) if rotary_dims else None
        cos, sin = (None, None) if emb is None else (jnp.asarray(np.cos(emb), _F32), jnp.asarray(np.sin(emb), _F32))
        weights = tuple((1 + 0.3 * jax.random.normal(jax.random.key(1), (2, 1, head_dim), _F32)).astype(jnp.bfloat16)) \
            if qk_norm else None
        try:
            if qk_norm or clip:  # the grouped kernel, one head of each: the per-head layout reshaped
                got = attention_grouped(qkv.reshape(1, t, 3, head_dim), cos, sin, seg, bias.reshape(3, head_dim),
                                        weights, num_heads=1, clip=1.5 if clip else None)
            else:
                got = attention(qkv, cos, sin, seg, bias)
            got = np.asarray(got.astype(_F32), np.float64)
            want = reference(qkv, cos, sin, seg, bias, 1.5 if clip else None, weights)
            real = np.asarray(seg)[0] > 0
            err = float(np.abs(got - want)[:, real].max() / np.abs(want[:, real]).max())
            _WORKS[key] = None if err < 2 ** -6 else f"its result is {err:.3g} (relative) from float64"
        except Exception as e:  # noqa: BLE001 - any failure means: use cuDNN's path
            _WORKS[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return _WORKS[key]
