"""The per-token unit sums of IntraSim (Ethayarajh 2019; Machina & Mercer 2024: the mean cosine of the states
of one token id, per state), their update and their float64 read-out on the devices: the algorithms of the step
measure stats/measures/intra_sim.py (which declares the sums, count [S, V'] and sums [S, V', D], and calls these),
built on stats/accumulators.py's double-float arithmetic, token index and segment sums.

Per state and batch (update): segment-sum the batch's unit vectors sorted by token id (accumulators.index_tokens,
segment_sums), then TwoSum-add the batch's distinct rows into the double-float sums, a chunk of rows at a time
(_add_batch); with the vocabulary split over opts.token_shards devices (device k owns ids k, k + n, ...), each
device sends its rows of each owner's tokens to that owner, planned once per batch (plan_exchange) and sent by
ppermutes (_add_batch_sharded). Read-out (intra_sim): (|hi + lo|^2 - c) / (c^2 - c) per token row with c >= 2,
in float64, on each device for the rows it holds (device/runner.py Runner.token_readout).
"""

import jax
import jax.numpy as jnp
from jax import lax
from flax import struct

from isojax.stats.accumulators import DF, TokenIndex, _df_add, index_tokens, segment_sums
from isojax.stats.options import StatsOptions


def update(count_SxV, tok: DF, s, unit_NxD, token_ids_N, valid_N, index: TokenIndex | None, opts: StatsOptions,
           exchange=None) -> tuple:
    """(count_SxV, tok) with state s of one batch added: its unit vectors unit_NxD (invalid rows zero) summed per
    token id. index: the batch's sort of its ids (None: sorted here); exchange: its Exchange (plan_exchange, with
    opts.token_shards > 1, inside shard_map; None: planned here)."""
    rows = count_SxV.shape[1]
    shards = opts.token_shards
    if index is None:
        index = index_tokens(token_ids_N, valid_N, rows * shards, shards)
    if shards == 1:
        return _add_batch(count_SxV, tok, s, unit_NxD, index, opts)
    return _add_batch_sharded(count_SxV, tok, s, unit_NxD, index, opts, exchange)


@struct.dataclass
class Exchange:
    """What one batch's per-token exchange needs beyond the rows (inside shard_map, once per
    batch: the same for every state). Segment j of the batch's sort belongs to owner o for
    bounds_O1[o] <= j < bounds_O1[o + 1]; round r sends segments bounds_O1[o] + r * cap + c."""

    bounds_O1: jax.Array
    rounds: jax.Array  # the most segments any device sends to any owner, over cap; >= 1 (a pmax)
    recv_local_OxC: jax.Array  # round 0, received: sender o's rows land on these local rows
    recv_count_OxC: jax.Array  # ... with these token counts



def _add_batch(count_SxV, tok: DF, s, unit_NxD, index: TokenIndex, opts: StatsOptions) -> tuple:
    """Per-token unit sums: segment-sum the sorted batch (a fresh [M, D], M <= min(N, V + 1)
    rounded up to the chunk, never [V, D] per batch), then, opts.token_chunk distinct tokens at
    a time, gather their accumulator rows, TwoSum-add and scatter-set them back in place. Only
    ceil(U / chunk) rounds run (a dynamic trip count), so the gathers and scatters move ~U
    rows, not N: U ~ 15k distinct ids in a 65k-token batch of text."""
    n = unit_NxD.shape[0]
    vocab_size = count_SxV.shape[1]
    chunk = opts.token_chunk if n % opts.token_chunk == 0 else n
    # U <= V + 1 (the distinct ids and one padding segment): a batch longer than the
    # vocabulary needs no more rows than that
    num_rows = min(n, -(-(vocab_size + 1) // chunk) * chunk)
    seg_MxD = segment_sums(unit_NxD[index.order_N], index, num_rows, opts)
    n_unique = index.rank_N[-1] + 1
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)

    def add_chunk(c, carry):
        hi_SxVxD, lo_SxVxD, count_SxV = carry
        take = lambda x: lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        rows = (s, take(index.uniq_U))
        hi_CxD = hi_SxVxD.at[rows].get(mode="fill", fill_value=0.0)
        lo_CxD = lo_SxVxD.at[rows].get(mode="fill", fill_value=0.0)
        hi_CxD, lo_CxD = _df_add(hi_CxD, lo_CxD, take(seg_MxD))
        cnt_C = count_SxV.at[rows].get(mode="fill", fill_value=0) + take(index.count_U)
        return (hi_SxVxD.at[rows].set(hi_CxD, **kw), lo_SxVxD.at[rows].set(lo_CxD, **kw),
                count_SxV.at[rows].set(cnt_C, **kw))

    hi, lo, count = lax.fori_loop(0, (n_unique + chunk - 1) // chunk, add_chunk,
                                  (tok.hi, tok.lo, count_SxV))
    return count, DF(hi, lo)


def _add_owned_rows(carry, s, rows_KxD, local_K, count_K):
    """TwoSum-add K rows of partial sums to this device's token rows local_K: distinct and
    ascending (one sender's share of a round); slots >= the rows held are dropped."""
    hi_SxVxD, lo_SxVxD, count_SxV = carry
    rows = (s, local_K)
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    hi_KxD, lo_KxD = _df_add(hi_SxVxD.at[rows].get(mode="fill", fill_value=0.0),
                             lo_SxVxD.at[rows].get(mode="fill", fill_value=0.0), rows_KxD)
    return (hi_SxVxD.at[rows].set(hi_KxD, **kw), lo_SxVxD.at[rows].set(lo_KxD, **kw),
            count_SxV.at[rows].set(count_SxV.at[rows].get(mode="fill", fill_value=0) + count_K, **kw))


BATCH_OF_QUARTER = 65536  # device batches up to this send a quarter of their rows per round


def exchange_cap(opts: StatsOptions, n: int, held: int) -> int:
    """Segments sent to each owner per round, for a device batch of n rows and owners of `held`
    token rows each. Every round is padded to it, so it is the traffic: by default a quarter of
    the batch up to 65,536 rows (15.2k distinct tokens of 65k on the Zipf workload of bench/, 8.2k
    in a book), then growing as n^0.6, as distinct tokens do (Heaps' law: 32.6k of 262k on the
    Zipf workload, 15.3k in a book; a quarter would pad 410m's exchange to twice what it carries,
    bench/RESULTS.md 7f); never more than `held`, the most distinct rows an owner can receive."""
    rows = opts.exchange_rows or (max(1, n // 4) if n <= BATCH_OF_QUARTER
                                  else int(BATCH_OF_QUARTER // 4 * (n / BATCH_OF_QUARTER) ** 0.6))
    return max(1, min(rows // opts.token_shards, held))


def _round_meta(index: TokenIndex, bounds_O1, r, cap: int, held: int):
    """(segments j_OxC, ok_OxC, local rows, counts) that round r sends to each owner; unused
    slots get distinct local rows >= held (dropped on arrival)."""
    shards = bounds_O1.shape[0] - 1
    j_OxC = bounds_O1[:-1, None] + r * cap + jnp.arange(cap, dtype=jnp.int32)[None]
    ok_OxC = j_OxC < bounds_O1[1:, None]
    unused_OxC = held + jnp.arange(shards * cap, dtype=jnp.int32).reshape(shards, cap)
    local_OxC = jnp.where(ok_OxC, index.uniq_U.at[j_OxC].get(mode="fill", fill_value=0) % held, unused_OxC)
    count_OxC = jnp.where(ok_OxC, index.count_U.at[j_OxC].get(mode="fill", fill_value=0), 0)
    return j_OxC, ok_OxC, local_OxC, count_OxC


def plan_exchange(index: TokenIndex, held: int, opts: StatsOptions) -> Exchange:
    """The batch's Exchange: owner bounds, round count, and round 0's metadata, exchanged once."""
    shards, axes, cap = opts.token_shards, opts.token_axes, exchange_cap(opts, index.order_N.shape[0], held)
    bounds_O1 = jnp.searchsorted(index.uniq_U, jnp.arange(shards + 1, dtype=jnp.int32) * held).astype(jnp.int32)
    most = jnp.max(bounds_O1[1:] - bounds_O1[:-1])
    rounds = jnp.maximum(1, lax.pmax((most + cap - 1) // cap, axes))
    _, _, local_OxC, count_OxC = _round_meta(index, bounds_O1, 0, cap, held)
    recv_OxCx2 = lax.all_to_all(jnp.stack([local_OxC, count_OxC], -1), axes, 0, 0)
    return Exchange(bounds_O1, rounds, recv_OxCx2[..., 0], recv_OxCx2[..., 1])


def _exchange_rows(carry, s, rows_OxCxD, recv_local_OxC, recv_count_OxC, opts: StatsOptions):
    """Send rows_OxCxD[o] to owner o and TwoSum-add what every sender sent here, sender by
    sender (each sender's rows are distinct and ascending: no sort). n - 1 ppermutes (shift k:
    to device me + k, from me - k); this device's own share stays in place. Ppermutes, not one
    all_to_all of every share, because they scale better over devices (bench/RESULTS.md 7b)."""
    shards, axes = opts.token_shards, opts.token_axes
    me = lax.axis_index(axes)
    take = lambda x, o: lax.dynamic_index_in_dim(x, o % shards, 0, keepdims=False)
    carry = _add_owned_rows(carry, s, take(rows_OxCxD, me), take(recv_local_OxC, me), take(recv_count_OxC, me))
    for k in range(1, shards):
        got_CxD = lax.ppermute(take(rows_OxCxD, me + k), axes, [(i, (i + k) % shards) for i in range(shards)])
        carry = _add_owned_rows(carry, s, got_CxD, take(recv_local_OxC, me - k), take(recv_count_OxC, me - k))
    return carry


def _add_batch_sharded(count_SxV, tok: DF, s, unit_NxD, index: TokenIndex, opts: StatsOptions,
                       exchange: Exchange | None = None) -> tuple:
    """Per-token unit sums with the vocabulary split over opts.token_shards devices (inside
    shard_map). Each device segment-sums its rows of the batch (keys grouped by owner), then
    sends up to cap = exchange_rows / shards segments to every owner (_exchange_rows); their
    local rows and counts went once per batch (plan_exchange). The first round is
    unconditional, so that XLA may overlap it with the next block's compute; further rounds
    (usually none) run in a loop and carry their own metadata. The traffic is each device's ~U
    distinct-token rows, once, padded to cap per owner."""
    n, d = unit_NxD.shape
    held = count_SxV.shape[1]  # token rows this device owns: V / shards
    cap = exchange_cap(opts, n, held)
    num_rows = min(n, opts.token_shards * held + 1)  # >= the segments of the batch (distinct keys + padding)
    seg_MxD = segment_sums(unit_NxD[index.order_N], index, num_rows, opts)
    ex = exchange if exchange is not None else plan_exchange(index, held, opts)

    def rows(j_OxC, ok_OxC):
        return jnp.where(ok_OxC[..., None], seg_MxD.at[j_OxC].get(mode="fill", fill_value=0.0), 0.0)

    def later_round(r, carry):
        j_OxC, ok_OxC, local_OxC, count_OxC = _round_meta(index, ex.bounds_O1, r, cap, held)
        recv_OxCx2 = lax.all_to_all(jnp.stack([local_OxC, count_OxC], -1), opts.token_axes, 0, 0)
        return _exchange_rows(carry, s, rows(j_OxC, ok_OxC), recv_OxCx2[..., 0], recv_OxCx2[..., 1], opts)

    j_OxC, ok_OxC, _, _ = _round_meta(index, ex.bounds_O1, 0, cap, held)
    carry = _exchange_rows((tok.hi, tok.lo, count_SxV), s, rows(j_OxC, ok_OxC), ex.recv_local_OxC,
                           ex.recv_count_OxC, opts)
    hi, lo, count = lax.fori_loop(1, ex.rounds, later_round, carry)
    return count, DF(hi, lo)


def intra_sim(count_SxV, tok: DF, rows: int):
    """IntraSim of every token row one device holds, [S, V'] float64 (call under jax.enable_x64): (|hi + lo|^2 - c)
    / (c^2 - c), NaN where c < 2. Reads out the first `rows` rows with c >= 2 (rows: at least as many as it has),
    one state at a time."""
    c_V = count_SxV[0]
    held = c_V.shape[0]
    idx_R = jnp.nonzero(c_V >= 2, size=rows, fill_value=held)[0]  # padding: out of range

    def one(s):
        pick = lambda x: x[s].at[idx_R].get(mode="fill", fill_value=0.0).astype(jnp.float64)
        sum_RxD = pick(tok.hi) + pick(tok.lo)
        return jnp.einsum("rd,rd->r", sum_RxD, sum_RxD)

    sq_SxR = lax.map(one, jnp.arange(count_SxV.shape[0]))
    c_R = c_V.at[idx_R].get(mode="fill", fill_value=0).astype(jnp.float64)
    intra_SxR = (sq_SxR - c_R) / jnp.where(c_R >= 2, c_R * c_R - c_R, 1.0)
    return jnp.full(count_SxV.shape, jnp.nan, jnp.float64).at[:, idx_R].set(intra_SxR, mode="drop")


@jax.jit
def state_sums(tok: DF, s):
    """State s of the per-token sums, hi + lo in float64 (call under jax.enable_x64)."""
    return tok.hi[s].astype(jnp.float64) + tok.lo[s].astype(jnp.float64)
