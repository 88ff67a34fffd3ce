"""Fused Pallas kernels for one hidden state's batch statistics (issue 13, part 1): an attempt,
measured slower than the XLA path on an H100 at every width (0.26-0.82x, bench/RESULTS.md §10),
so the step does not use it; kept with its tests as the record of what was tried.

`fused_moments(x_NxD, valid_N)` returns what update_state's XLA path computes for one state
(`xla_moments` below is that path, kept beside the kernel as its reference):

    sum_D        Sum x            over the valid rows (pairwise over row blocks)
    m2_DxD       Sum (x - m)(x - m)^T,          m = sum_D / n
    unit_sum_D   Sum u,           u = x / |x|   (zero rows stay zero)
    unit_m2_DxD  Sum (u - mu)(u - mu)^T,        mu = unit_sum_D / n
    norm_sum     Sum |x|

all float32, with the XLA path's conventions: for bfloat16 states the deviations are rounded to
bf16 and multiplied with float32 accumulation; float32 states multiply in true float32 (Triton's
IEEE dot, like Precision.HIGHEST; the XLA path's "bf16x6" option has no counterpart here);
invalid rows contribute nothing whatever they hold (NaN and inf included). Unit vectors are
x / |x| as in XLA, but Triton's float32 division may be the 2-ulp `div.full.f32` rather than
XLA's correctly rounded one: ~2e-7 relative on u, far below the bf16 rounding that follows.

Two kernels, T = D / block_d column tiles, R = N / block_n row blocks:

  1. `_row_stats_kernel`, grid (R,): one program per block of block_n rows. It reads its rows
     twice, a [block_n, block_d] tile at a time (the second time mostly from L2): pass 1 sums
     the squares per row and the masked x per column; pass 2 sums x / |x| per column. Writes
     norm_N (zero for invalid rows; 4 bytes a row) and per-row-block partial sums [R, D] of x
     and of u, which XLA then reduces with stats.pairwise_sum (R is small: 1024 at N = 65536).
  2. `_gram_kernel`, grid (T, T, S): program (i, j, s) with i <= j computes tile (I, J) of both
     Grams over the s-th of S contiguous row splits. It reads x[rows, I], x[rows, J], valid,
     norm and the four [block_d] means, and forms in its prologue, block_n rows at a time,
     the deviations x - m and x / |x| - mu, masked, rounded to the product dtype; both
     products accumulate in float32 registers, so x is read once per tile for the two Grams
     and the deviations never touch memory. Programs with i > j return at once. Writes
     [S, D, D] partial Grams, upper tiles only; XLA sums the S splits and mirrors the upper
     tiles into the lower triangle. S (split_n) splits the row loop so that small D still
     fills the GPU (D = 512, block_d = 128: 10 upper tiles, S = 32).

On GPUs the kernels always go through Triton (Triton CompilerParams are passed: jax >= 0.10
would otherwise pick Mosaic GPU). Triton constraints respected: every loaded or stored array is a power of two ([block_n,
block_d], [block_n], [block_d], [block_d, block_d]); refs' blocks may be any size (D = 384 and
6144 work as 3 and 48 tiles). N that is not a multiple of block_n * S is padded (a copy of x);
N = 65536 never is.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from isojax import stats
from isojax.options import StatsOptions

_TN = (((0,), (0,)), ((), ()))  # dot_general contracting the row axis of both: a^T b


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _row_stats_kernel(x_ref, valid_ref, norm_ref, sum_ref, unit_sum_ref, *, block_d: int):
    """x_ref [block_n, D], valid_ref [block_n] int32 -> norm_ref [block_n], sum_ref and
    unit_sum_ref [D] (this row block's partial column sums)."""
    block_n, d = x_ref.shape
    valid_n = valid_ref[...] != 0

    def squares_and_sums(c, ss_n):
        cols = pl.ds(c * block_d, block_d)
        x_nxd = jnp.where(valid_n[:, None], x_ref[:, cols].astype(jnp.float32), 0.0)
        sum_ref[cols] = jnp.sum(x_nxd, axis=0)
        return ss_n + jnp.sum(x_nxd * x_nxd, axis=1)

    ss_n = lax.fori_loop(0, d // block_d, squares_and_sums, jnp.zeros((block_n,), jnp.float32))
    norm_n = jnp.sqrt(ss_n)  # zero for invalid rows: they were masked before squaring
    norm_ref[...] = norm_n
    div_n = jnp.where(norm_n > 0, norm_n, 1.0)

    def unit_sums(c, carry):
        cols = pl.ds(c * block_d, block_d)
        x_nxd = jnp.where(valid_n[:, None], x_ref[:, cols].astype(jnp.float32), 0.0)
        unit_sum_ref[cols] = jnp.sum(x_nxd / div_n[:, None], axis=0)
        return carry

    lax.fori_loop(0, d // block_d, unit_sums, 0)


def _gram_kernel(xi_ref, xj_ref, valid_ref, norm_ref, mean_i_ref, mean_j_ref, umean_i_ref,
                 umean_j_ref, m2_ref, unit_m2_ref, *, block_n: int, gram_dtype, precision):
    """xi_ref, xj_ref [rows, block_d] (this split's rows of column tiles I and J), valid_ref and
    norm_ref [rows], means [block_d] -> m2_ref, unit_m2_ref [block_d, block_d]."""
    i, j = pl.program_id(0), pl.program_id(1)
    rows, block_d = xi_ref.shape

    @pl.when(i <= j)
    def _():
        mean_i, mean_j = mean_i_ref[...], mean_j_ref[...]
        umean_i, umean_j = umean_i_ref[...], umean_j_ref[...]

        def deviations(x_ref, r, valid_n, div_n, mean_d, umean_d):
            x_nxd = x_ref[r, :].astype(jnp.float32)
            dev = jnp.where(valid_n[:, None], x_nxd - mean_d[None, :], 0.0)
            udev = jnp.where(valid_n[:, None], x_nxd / div_n[:, None] - umean_d[None, :], 0.0)
            return dev.astype(gram_dtype), udev.astype(gram_dtype)

        def body(k, carry):
            acc, uacc = carry
            r = pl.ds(k * block_n, block_n)
            valid_n = valid_ref[r] != 0
            norm_n = norm_ref[r]
            div_n = jnp.where(norm_n > 0, norm_n, 1.0)
            dev_i, udev_i = deviations(xi_ref, r, valid_n, div_n, mean_i, umean_i)
            dev_j, udev_j = deviations(xj_ref, r, valid_n, div_n, mean_j, umean_j)
            kw = dict(precision=precision, preferred_element_type=jnp.float32)
            acc = acc + lax.dot_general(dev_i, dev_j, _TN, **kw)
            uacc = uacc + lax.dot_general(udev_i, udev_j, _TN, **kw)
            return acc, uacc

        zeros = jnp.zeros((block_d, block_d), jnp.float32)
        acc, uacc = lax.fori_loop(0, rows // block_n, body, (zeros, zeros))
        m2_ref[...] = acc
        unit_m2_ref[...] = uacc


def default_split(num_tiles: int, row_blocks: int, programs: int = 264) -> int:
    """Row splits S for the Gram grid: the smallest power of two with num_tiles * S >= programs
    (two per SM of an H100), dividing row_blocks and leaving each split >= 8 row blocks."""
    s = 1
    while num_tiles * s < programs and row_blocks % (2 * s) == 0 and row_blocks // (2 * s) >= 8:
        s *= 2
    return s


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_d", "split_n",
                                             "num_warps", "num_stages"))
def fused_moments(x_NxD, valid_N, *, interpret: bool = False, block_n: int = 64, block_d: int = 128,
                  split_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """(sum_D, m2_DxD, unit_sum_D, unit_m2_DxD, norm_sum), float32, of the valid rows of one
    state x_NxD (bfloat16 or float32; other dtypes go through float32). block_n, block_d: powers
    of two >= 16, D a multiple of block_d. split_n: row splits of the Gram (default_split)."""
    n, d = x_NxD.shape
    if not (_is_pow2(block_n) and _is_pow2(block_d) and block_n >= 16 and block_d >= 16):
        raise ValueError(f"block_n, block_d must be powers of two >= 16, not {block_n}, {block_d}")
    if d % block_d:
        raise ValueError(f"D = {d} is not a multiple of block_d = {block_d}")
    if x_NxD.dtype not in (jnp.bfloat16, jnp.float32):
        x_NxD = x_NxD.astype(jnp.float32)
    gram_dtype = x_NxD.dtype
    precision = None if gram_dtype == jnp.bfloat16 else lax.Precision.HIGHEST
    num_tiles = d // block_d
    row_blocks = -(-n // block_n)
    splits = split_n or default_split(num_tiles * (num_tiles + 1) // 2, row_blocks)
    row_blocks = -(-row_blocks // splits) * splits
    pad = row_blocks * block_n - n
    valid_N = jnp.asarray(valid_N).astype(jnp.int32)
    if pad:  # padding rows are invalid, so contribute nothing
        x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
        valid_N = jnp.pad(valid_N, (0, pad))
    n_pad = row_blocks * block_n

    def params(warps):
        if interpret:
            return {}
        from jax.experimental.pallas import triton as plgpu
        return dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=num_stages))

    f32 = jnp.float32
    norm_N, sum_RxD, unit_sum_RxD = pl.pallas_call(
        functools.partial(_row_stats_kernel, block_d=block_d),
        grid=(row_blocks,),
        in_specs=[pl.BlockSpec((block_n, d), lambda r: (r, 0)),
                  pl.BlockSpec((block_n,), lambda r: (r,))],
        out_specs=[pl.BlockSpec((block_n,), lambda r: (r,)),
                   pl.BlockSpec((None, d), lambda r: (r, 0)),
                   pl.BlockSpec((None, d), lambda r: (r, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_pad,), f32), jax.ShapeDtypeStruct((row_blocks, d), f32),
                   jax.ShapeDtypeStruct((row_blocks, d), f32)],
        interpret=interpret, name="isojax_row_stats", **params(num_warps or 4),
    )(x_NxD, valid_N)

    count = jnp.sum(valid_N.astype(f32))
    sum_D = stats.pairwise_sum(sum_RxD)
    unit_sum_D = stats.pairwise_sum(unit_sum_RxD)
    norm_sum = stats.pairwise_sum(norm_N[:, None])[0]
    mean_D = sum_D / jnp.maximum(count, 1.0)
    unit_mean_D = unit_sum_D / jnp.maximum(count, 1.0)

    rows = n_pad // splits
    col_i = pl.BlockSpec((block_d,), lambda i, j, s: (i,))
    col_j = pl.BlockSpec((block_d,), lambda i, j, s: (j,))
    row_s = pl.BlockSpec((rows,), lambda i, j, s: (s,))
    out_spec = pl.BlockSpec((None, block_d, block_d), lambda i, j, s: (s, i, j))
    m2_SxDxD, unit_m2_SxDxD = pl.pallas_call(
        functools.partial(_gram_kernel, block_n=block_n, gram_dtype=gram_dtype, precision=precision),
        grid=(num_tiles, num_tiles, splits),
        in_specs=[pl.BlockSpec((rows, block_d), lambda i, j, s: (s, i)),
                  pl.BlockSpec((rows, block_d), lambda i, j, s: (s, j)),
                  row_s, row_s, col_i, col_j, col_i, col_j],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((splits, d, d), f32)] * 2,
        interpret=interpret, name="isojax_gram", **params(num_warps or (8 if block_d >= 128 else 4)),
    )(x_NxD, x_NxD, valid_N, norm_N, mean_D, mean_D, unit_mean_D, unit_mean_D)

    tile_D = jnp.arange(d) // block_d
    upper_DxD = tile_D[:, None] <= tile_D[None, :]

    def full(g_SxDxD):  # tiles below the diagonal were never written: take the mirror
        g_DxD = stats.pairwise_sum(g_SxDxD)
        return jnp.where(upper_DxD, g_DxD, g_DxD.T)

    return sum_D, full(m2_SxDxD), unit_sum_D, full(unit_m2_SxDxD), norm_sum


@functools.partial(jax.jit, static_argnames=("opts",))
def xla_moments(x_NxD, valid_N, opts: StatsOptions = stats.DEFAULT_OPTIONS):
    """The same five values by stats.update_state's XLA path (its norm, unit and two
    _centered_gram lines), without the per-token part: the reference of fused_moments."""
    valid_N = jnp.asarray(valid_N)
    gram_dtype = jnp.bfloat16 if x_NxD.dtype == jnp.bfloat16 else jnp.float32
    x_NxD = jnp.where(valid_N[:, None], x_NxD.astype(jnp.float32), 0.0)
    norm_N = jnp.sqrt(jnp.sum(x_NxD * x_NxD, axis=1))
    unit_NxD = x_NxD / jnp.where(norm_N > 0, norm_N, 1.0)[:, None]
    def centered_moments(v_NxD):  # as update_state on one device: Sum v, and the Gram about its mean
        n_b = jnp.sum(valid_N.astype(jnp.float32))
        sum_D = stats.pairwise_sum(v_NxD)
        return sum_D, stats._centered_gram(v_NxD, valid_N, sum_D / jnp.maximum(n_b, 1.0), gram_dtype, opts)

    sum_D, m2_DxD = centered_moments(x_NxD)
    unit_sum_D, unit_m2_DxD = centered_moments(unit_NxD)
    return sum_D, m2_DxD, unit_sum_D, unit_m2_DxD, stats.pairwise_sum(norm_N[:, None])[0]
