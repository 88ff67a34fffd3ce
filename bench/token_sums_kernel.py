"""Per-token unit-vector sums (IntraSim) of one state in one Pallas (Triton) kernel and a small
merge: issue 13's attempt to replace stats._update_tokens, measured slower than that XLA path on
an H100 at every Pythia width (bench/RESULTS.md 10k), so the step does not use it; kept with its
tests as the record of what was tried (bench/bench_token_kernel.py times it).

The XLA path gathers the batch's unit vectors into id order, segment-sums them with a float32
scatter-add into a fresh zeroed [M, D] array (M ~ V rows however few ids the batch has), then
gathers, TwoSum-adds and scatters back the accumulator rows of the distinct ids, 4096 at a time.

Here program (b, c) takes `rows` consecutive positions of the id-sorted batch, b * rows .., and
columns c * cols ..: it gathers those rows of the state (in its own dtype) and forms their unit
vectors x / |x| in float32; one product of the 0/1 matrix [segment k holds row r] with the unit
vectors (split exactly into three bf16 parts, float32 accumulation) sums every run of one id (a
segment) among them at once. A segment that lies wholly inside the block is added to its
token's accumulator row right there (TwoSum, in place); one that crosses the block's edge (at
most two per block: a frequent token's run spans many blocks) leaves its partial sum in a slot
of `partials`, and `merge_partials` adds those, per segment, to the accumulators (XLA). Every
program does the same bounded work whatever the ids and nothing is zeroed. (Two earlier designs,
one program per segment and a masked reduction per segment, are described in RESULTS 10k.)

Numbers: the unit vectors are the XLA path's (x in float32 divided by the same norm); rows of
norm 0 add 0; a segment's rows are summed by the tensor cores in float32 within a block, its
blocks' partials then added, and the TwoSum is stats._df_add's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.experimental import pallas as pl

_F32 = jnp.float32
ROWS = 32  # sorted positions per program (the fastest of bench_token_kernel.py's sweep with cols 128, 8 warps)


def columns(d: int, most: int = 256) -> int:
    """Columns per program: the largest power of two dividing d, at most `most`."""
    return min(d & -d, most)


def applies(d: int) -> bool:
    """Whether the kernel takes states of width d (a program's columns a power of two >= 16)."""
    return columns(d) >= 16


@struct.dataclass
class Plan:
    """What the kernel and the merge need beyond stats.TokenIndex, once per batch (the same for
    every state). Slot 2b / 2b + 1 of `partials` holds block b's first / last segment when it
    crosses the block's edge; merged ids number the crossing segments in order."""

    starts_U1: jax.Array  # [N + 1] first sorted position of segment j; N past the last segment
    merged_P: jax.Array  # [P] the merged id of each slot (P = 2 * blocks)
    used_P: jax.Array  # [P] bool: the slot holds a partial
    token_P: jax.Array  # [P] the token of merged id p; unused ids: distinct rows past any vocabulary


def plan(starts_N, rank_N, uniq_U, rows: int = ROWS) -> Plan:
    """Plan from stats.TokenIndex's starts_N, rank_N, uniq_U."""
    n = rank_N.shape[0]
    starts_U1 = jnp.full((n + 1,), n, jnp.int32).at[jnp.where(starts_N, rank_N, n + 1)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop", unique_indices=True)
    r0 = jnp.arange(pl.cdiv(n, rows), dtype=jnp.int32) * rows
    r1 = jnp.minimum(r0 + rows, n)
    first, last = rank_N[r0], rank_N[r1 - 1]
    first_crosses = (starts_U1[first] < r0) | (starts_U1[first + 1] > r1)
    last_crosses = (last != first) & (starts_U1[last + 1] > r1)
    seg_P = jnp.stack([jnp.where(first_crosses, first, -1), jnp.where(last_crosses, last, -1)], 1).reshape(-1)
    run_P = lax.cummax(seg_P)  # crossing segments ascend in slot order; unused slots join the run before
    merged_P = jnp.maximum(jnp.cumsum(run_P != jnp.concatenate([jnp.full(1, -1, jnp.int32), run_P[:-1]])) - 1, 0)
    p = seg_P.shape[0]
    seg_of_P = jnp.full((p,), -1, jnp.int32).at[merged_P].max(seg_P)
    big = jnp.iinfo(jnp.int32).max - p  # past any vocabulary: the scatter drops it
    token_P = jnp.where(seg_of_P >= 0, uniq_U[jnp.maximum(seg_of_P, 0)], big + jnp.arange(p, dtype=jnp.int32))
    return Plan(starts_U1, merged_P.astype(jnp.int32), seg_P >= 0, token_P.astype(jnp.int32))


def _split3(v):
    """v (float32) = a + b + c exactly, each bfloat16 (8 + 8 + 8 bits of the 24)."""
    a = v.astype(jnp.bfloat16)
    r = v - a.astype(_F32)
    b = r.astype(jnp.bfloat16)
    return a, b, (r - b.astype(_F32)).astype(jnp.bfloat16)


def _kernel(s_ref, x_ref, norm_ref, order_ref, rank_ref, start_ref, token_ref, hi_in, lo_in,
            hi_ref, lo_ref, part_ref, *, rows: int, cols: int, n: int, vocab_rows: int):
    """Program (b, c): sorted positions b*rows .., columns c*cols ..; hi_ref, lo_ref alias hi_in, lo_in
    ([S, V, D] float32); part_ref [P, D]. The block's segments are numbered k = 0, 1, .. from its
    first; one product of the 0/1 matrix [segment k holds row r] with the unit vectors (split
    exactly into three bf16 parts, float32 accumulation) sums every segment's rows at once."""
    from jax.experimental.pallas import triton as plt

    b, c = pl.program_id(0), pl.program_id(1)
    cs = pl.ds(c * cols, cols)
    s = s_ref[0]
    r0 = b * rows
    r1 = jnp.minimum(r0 + rows, n)
    lane = jnp.arange(rows, dtype=jnp.int32)
    clamped = jnp.minimum(r0 + lane, n - 1)
    row = order_ref[clamped]
    first, last = rank_ref[r0], rank_ref[r1 - 1]
    k_of_row = jnp.where(r0 + lane < n, rank_ref[clamped] - first, -1)
    norm = norm_ref[row]
    # rows of norm 0 (zero rows, and the invalid rows whatever they hold: the caller's norm is 0) add 0,
    # not 0 * NaN to every segment of the block
    unit = jnp.where((norm > 0)[:, None], x_ref[row, cs].astype(_F32) / jnp.where(norm > 0, norm, 1.0)[:, None], 0.0)
    member = (lane[:, None] == k_of_row[None, :]).astype(jnp.bfloat16)  # [segment k, row r]
    sums = sum(jnp.dot(member, part, preferred_element_type=_F32) for part in _split3(unit))  # [k, cols]

    j = first + lane  # the block's segments
    present = j <= last
    jc = jnp.minimum(j, last)
    t = token_ref[jc]
    whole = (start_ref[jc] >= r0) & (start_ref[jc + 1] <= r1)
    add = present & whole & (t < vocab_rows)
    # Lanes that write nothing point past the array's rows (no two lanes share a row; in interpret
    # mode their loads are filled and their stores dropped; compiled, masked lanes touch nothing).
    col = (c * cols + jnp.arange(cols, dtype=jnp.int32))[None, :]
    idx = (s, jnp.where(add, t, vocab_rows)[:, None], col)
    hi = plt.load(hi_in.at[idx], mask=add[:, None], other=0.0)
    lo = plt.load(lo_in.at[idx], mask=add[:, None], other=0.0)
    new = hi + sums  # TwoSum, as stats._df_add
    b_virtual = new - hi
    plt.store(hi_ref.at[idx], new, mask=add[:, None])
    plt.store(lo_ref.at[idx], lo + ((hi - (new - b_virtual)) + (sums - b_virtual)), mask=add[:, None])
    leave = present & jnp.logical_not(whole)  # at most k = 0 and the last k
    slot = jnp.where(leave, 2 * b + (lane != 0).astype(jnp.int32), part_ref.shape[0])
    plt.store(part_ref.at[slot[:, None], col], sums, mask=leave[:, None])


def merge_partials(hi_SxVxD, lo_SxVxD, s, partials_PxD, p: Plan):
    """Add the crossing segments' partial sums (kernel slots) to their tokens' rows (XLA)."""
    sums_PxD = jax.ops.segment_sum(jnp.where(p.used_P[:, None], partials_PxD, 0.0), p.merged_P,
                                   num_segments=partials_PxD.shape[0], indices_are_sorted=True)
    rows = (s, p.token_P)
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=False)
    hi = hi_SxVxD.at[rows].get(mode="fill", fill_value=0.0)
    lo = lo_SxVxD.at[rows].get(mode="fill", fill_value=0.0)
    new = hi + sums_PxD
    b_virtual = new - hi
    lo = lo + ((hi - (new - b_virtual)) + (sums_PxD - b_virtual))
    return hi_SxVxD.at[rows].set(new, **kw), lo_SxVxD.at[rows].set(lo, **kw)


@functools.partial(jax.jit, static_argnames=("rows", "cols", "num_warps", "num_stages", "interpret"))
def add_token_sums(hi_SxVxD, lo_SxVxD, s, x_NxD, norm_N, order_N, rank_N, uniq_U, p: Plan, *, rows: int = ROWS,
                   cols: int = 128, num_warps: int = 8, num_stages: int = 1, interpret: bool | None = None):
    """(hi, lo) where hi + lo of row uniq_U[j] of state s has gained the sum of x / norm over segment
    j's rows (sorted positions p.starts_U1[j] .., rows order_N of x), for every segment whose
    token is < V; other rows unchanged (updated in place). x [N, D] in any float dtype; norm_N
    float32 (0: a zero row, which adds 0); order_N, rank_N, uniq_U from stats.index_tokens and p
    from plan(..., rows)."""
    n, d = x_NxD.shape
    vocab_rows = hi_SxVxD.shape[1]
    if not applies(d):
        raise ValueError(f"the token kernel does not take width {d}")
    if p.merged_P.shape[0] != 2 * pl.cdiv(n, rows):
        raise ValueError(f"the plan was made for another number of rows per block than {rows}")
    cols = columns(d, cols)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_kernel, rows=rows, cols=cols, n=n, vocab_rows=vocab_rows)
    hi, lo, partials = pl.pallas_call(
        kernel, grid=(pl.cdiv(n, rows), d // cols),
        out_shape=[jax.ShapeDtypeStruct(hi_SxVxD.shape, _F32), jax.ShapeDtypeStruct(lo_SxVxD.shape, _F32),
                   jax.ShapeDtypeStruct((p.merged_P.shape[0], d), _F32)],
        input_output_aliases={7: 0, 8: 1}, interpret=interpret, name="isojax_token_sums", **params,
    )(jnp.reshape(jnp.asarray(s, jnp.int32), (1,)), x_NxD, norm_N.astype(_F32), order_N.astype(jnp.int32),
      rank_N.astype(jnp.int32), p.starts_U1, uniq_U.astype(jnp.int32), hi_SxVxD, lo_SxVxD)
    return merge_partials(hi, lo, s, partials, p)
