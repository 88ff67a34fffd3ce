"""Exact streaming statistics of hidden states, accumulated on device.
Length: the double-float arithmetic and the accumulators that use it are one numerical unit, tested together.

Axis names: G groups (data sources), S states (embed, block_1..block_L, final_ln),
N packed positions of one batch, D model width, V vocabulary, H = G when each group keeps
its own second moments and 1 when they share one.

Every floating-point sum is a double-float pair (`hi`, `lo`) in float32: each batch's
contribution is first reduced within the batch (pairwise tree for plain sums, a sorted
segment sum for per-token sums, one float32 matmul for the second moments), then added
with TwoSum, whose rounding error goes into `lo`. hi + lo (taken in float64 by
finalize) then carries ~48 bits, so drift across 10^4..10^6 batches is gone, and the only
float32 error left is that of one batch's own partial sum. See stats/finalize.py for the read-out.

Second moments are kept centered (Chan, Golub & LeVeque's pairwise update): storing
Sum (x - mean)(x - mean)^T instead of Sum x x^T avoids the catastrophic cancellation of
Sum x x^T / n - mean mean^T when the states are nearly parallel (cos ~ 0.999 costs three
decimal digits that float32 cannot spare). The uncentered Gram is rebuilt exactly in
float64 as M2 + sum sum^T / n.

These moments (the count, the sums of x, x/|x| and |x|, and the second moments of x and x/|x|) are every
step's own, not a step measure (stats/measures base.Step): the registered measures that read a population's
first moments or spectra (stats/measures/: inter_sim.py, anisotropy.py, isoscore.py, ...) all read them, so they
cannot be off; each state's Rows, which the step measures observe, come from the same pass; and their merge ties
them together (Chan's term over the second moments' rows, which StatsOptions.gram_shards splits over devices).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from isojax.stats.options import StatsOptions

DEFAULT_OPTIONS = StatsOptions()

_COUNT_BITS = 30  # counts are int32 limbs: n = hi * 2**30 + lo, exact to 2**61


@struct.dataclass
class DF:
    """A double-float sum: the value is hi + lo, |lo| <= ulp(hi)/2 after each add."""

    hi: jax.Array
    lo: jax.Array


@struct.dataclass
class DFPair:
    """A double-float sum kept as one [..., 2] array (hi, lo on the last axis) for the Grams: an
    update writes both halves with one in-place slice. With separate hi and lo arrays XLA kept a
    copy of the whole hi array inside the layer scan (lo's new value reads hi's old one): every
    Gram twice, 13 GB per device at gpt-neox-20b (bench/RESULTS.md 7b)."""

    hl: jax.Array

    @property
    def hi(self) -> jax.Array:
        return self.hl[..., 0]

    @property
    def lo(self) -> jax.Array:
        return self.hl[..., 1]

    @classmethod
    def of(cls, hi, lo) -> "DFPair":
        return cls(jnp.stack([hi, lo], -1))


def _two_sum(a, b):
    """a + b = s + err exactly (Knuth's TwoSum, branch-free; needs no |a| >= |b|)."""
    s = a + b
    b_virtual = s - a
    err = (a - (s - b_virtual)) + (b - b_virtual)
    return s, err


def _df_add(hi, lo, v):
    s, err = _two_sum(hi, v)
    return s, lo + err


def _df_zeros(shape):
    return DF(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


@struct.dataclass
class Accumulators:
    count_lo_GxS: jax.Array  # int32 limbs of the valid-position count
    count_hi_GxS: jax.Array
    sum_GxSxD: DF  # Sum x
    unit_sum_GxSxD: DF  # Sum x/|x|  (InterSim)
    norm_sum_GxS: DF  # Sum |x|
    m2_HxSxDxD: DFPair  # Sum (x - mean)(x - mean)^T over the H-slot's population
    unit_m2_HxSxDxD: DFPair  # the same for unit vectors
    # the sums of the step measures merged with this layer part on the devices (stats/measures base.Step.
    # layer_part: massive activations, position bands; centered InterSim in the centered pass), in
    # StatsOptions.step_measures' order; () when none is on
    layer_steps: tuple
    # the other step measures' sums (stats/measures base.Step), added on the host (the sample's, stats/measures/
    # sample_states.py: merged bottom-K) or split over the vocabulary (IntraSim's per-token sums, stats/measures/
    # intra_sim.py), in StatsOptions.step_measures' order; () (no leaves) when none is on
    step: tuple = ()

    def gram_slots(self) -> int:
        """H: the second moments' slots (G where each group keeps its own, else 1); also of the
        step's global accumulators, whose fields lead with a device axis."""
        return self.m2_HxSxDxD.hl.shape[-5]

    def layer_count(self) -> np.ndarray:
        """[S] int64: the valid positions of each state over every group (merged accumulators)."""
        n_GxS = (np.asarray(self.count_hi_GxS, np.int64) << _COUNT_BITS) + np.asarray(self.count_lo_GxS, np.int64)
        return n_GxS.sum(0)

    def means(self) -> np.ndarray:
        """[S, D] float64: each state's mean over every group, hi + lo in float64 (merged accumulators)."""
        sums = (np.asarray(self.sum_GxSxD.hi, np.float64) + np.asarray(self.sum_GxSxD.lo, np.float64)).sum(0)
        return sums / self.layer_count().astype(np.float64)[:, None]


def _shapes(num_states, d, num_groups, group_spectra, gram_rows):
    g, s, h = num_groups, num_states, num_groups if group_spectra else 1
    return dict(count=(g, s), sum=(g, s, d), norm=(g, s), m2=(h, s, gram_rows or d, d))


def init_accumulators(num_states: int, d: int, *, num_groups: int = 1, group_spectra: bool = True,
                      gram_rows: int | None = None) -> Accumulators:
    """Zeroed accumulators. group_spectra=False shares one pair of [S, D, D] second moments
    among all groups (groups then report no anisotropy), which saves 4*S*D*D*4 bytes per
    group beyond the first (the step measures' sums, the sample's and the per-token ones among them:
    stats.measures.init_sums).
    gram_rows: rows of the second moments this device keeps (StatsOptions.gram_shards);
    None: all D."""
    sh = _shapes(num_states, d, num_groups, group_spectra, gram_rows)
    return Accumulators(
        count_lo_GxS=jnp.zeros(sh["count"], jnp.int32),
        count_hi_GxS=jnp.zeros(sh["count"], jnp.int32),
        sum_GxSxD=_df_zeros(sh["sum"]), unit_sum_GxSxD=_df_zeros(sh["sum"]),
        norm_sum_GxS=_df_zeros(sh["norm"]),
        m2_HxSxDxD=DFPair(jnp.zeros((*sh["m2"], 2), jnp.float32)),
        unit_m2_HxSxDxD=DFPair(jnp.zeros((*sh["m2"], 2), jnp.float32)),
        layer_steps=())


def accumulator_bytes(num_states, d, *, num_groups=1, group_spectra=True, gram_rows=None) -> int:
    """Device bytes of init_accumulators(...), without allocating (every float sum is two float32 arrays, hi
    and lo)."""
    shaped = jax.eval_shape(lambda: init_accumulators(
        num_states, d, num_groups=num_groups, group_spectra=group_spectra, gram_rows=gram_rows))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shaped))


def pairwise_sum(x_NxD):
    """Sum over rows in levels of 16 (a 16-ary tree): at most 15 rounding errors per level and
    element, ceil(log16 N) levels (4 for N <= 65536), against up to N for one sequential reduce.
    Each level is one reduce op. (A binary tree of slices fuses into a single GPU kernel with N
    leaves, which XLA's GPU compiler took minutes to build.)"""
    while x_NxD.shape[0] > 1:
        n = x_NxD.shape[0]
        pad = -n % 16
        if pad:
            x_NxD = jnp.concatenate([x_NxD, jnp.zeros((pad, *x_NxD.shape[1:]), x_NxD.dtype)])
        x_NxD = x_NxD.reshape((n + pad) // 16, 16, *x_NxD.shape[1:]).sum(axis=1)
    return x_NxD[0]


@struct.dataclass
class TokenIndex:
    """The sort of one batch's token ids, shared by all S states of that batch.

    Sorting is by key: the token id itself, or, when the vocabulary is split over `shards`
    devices (device k owns ids k, k + shards, ...), key = owner * (V / shards) + id // shards,
    so that each owner's tokens form one contiguous run of segments and key % (V / shards) is
    the row on the owner. uniq_U holds the distinct valid keys in ascending order at ranks
    0..U-1; the remaining N - U slots hold distinct out-of-range keys (>= V), so a scatter with
    mode='drop' skips them and every index is unique and sorted (no contention, no atomics)."""

    order_N: jax.Array  # permutation that sorts the batch by key
    starts_N: jax.Array  # bool: sorted position opens a new segment
    rank_N: jax.Array  # segment (distinct-key) index of each sorted position
    uniq_U: jax.Array  # [N] keys per segment, padded with V, V+1, ... (dropped)
    count_U: jax.Array  # [N] valid occurrences per segment


def token_order(values_SxV: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """Rows of the global token layout (device/runner.py: global row k * V'/n + j holds token id j * n + k)
    -> token id order, [S, V'] -> [S, V]; host numpy."""
    s, v = values_SxV.shape
    return values_SxV.reshape(s, n, v // n).transpose(0, 2, 1).reshape(s, v)[:, :vocab_size]


def index_tokens(token_ids_N, valid_N, vocab_size, shards: int = 1) -> TokenIndex:
    """vocab_size: the (padded) vocabulary, a multiple of `shards`."""
    n = token_ids_N.shape[0]
    ids_N = token_ids_N.astype(jnp.int32)
    if shards > 1:
        ids_N = (ids_N % shards) * (vocab_size // shards) + ids_N // shards
    ids_N = jnp.where(valid_N, ids_N, vocab_size)  # padding sorts last
    order_N = jnp.argsort(ids_N, stable=True)
    sorted_N = ids_N[order_N]
    starts_N = jnp.concatenate([jnp.ones(1, bool), sorted_N[1:] != sorted_N[:-1]])
    rank_N = jnp.cumsum(starts_N.astype(jnp.int32)) - 1
    # Padding forms one segment of id V; unused slots get V + slot, all distinct.
    uniq_U = (vocab_size + jnp.arange(n, dtype=jnp.int32)).at[rank_N].set(sorted_N)
    count_U = jax.ops.segment_sum((sorted_N < vocab_size).astype(jnp.int32), rank_N,
                                  num_segments=n, indices_are_sorted=True)
    return TokenIndex(order_N, starts_N, rank_N, uniq_U, count_U)


def _add_count(lo, hi, n):
    lo = lo + n
    return lo & ((1 << _COUNT_BITS) - 1), hi + (lo >> _COUNT_BITS)


def _count_f32(lo, hi):
    return hi.astype(jnp.float32) * float(1 << _COUNT_BITS) + lo.astype(jnp.float32)


def _centered_gram(x_NxD, valid_N, mean_D, gram_dtype, opts: StatsOptions):
    """Sum (x - m)(x - m)^T over the valid rows, [D, D] float32.

    gram_dtype bfloat16 (for states from a bfloat16 forward): the deviations are rounded to
    bf16 and multiplied on the tensor cores with float32 accumulation. Rounding errors are
    unbiased and independent, so their effect on M2 shrinks like 1/sqrt(n); the bias left is
    ~(2^-8)^2 relative (measured: README, "bfloat16")."""
    d = x_NxD.shape[1]
    block = opts.gram_block
    k = d // block if d >= 2 * block and d % block == 0 else 1
    blocks = [slice(i * d // k, (i + 1) * d // k) for i in range(k)]
    # each column block's deviations computed on their own, so that each is contiguous
    devs = [jnp.where(valid_N[:, None], x_NxD[:, c] - mean_D[c], 0.0).astype(gram_dtype) for c in blocks]
    kw = dict(preferred_element_type=jnp.float32)
    if gram_dtype != jnp.bfloat16:
        kw["precision"] = opts.gram_dot_precision()
    # Sum dev dev^T is symmetric: the k(k+1)/2 blocks on and above the diagonal are
    # (k+1)/(2k) of the products (5/8 at D = 2048)
    upper = {(i, j): jnp.einsum("nd,ne->de", devs[i], devs[j], **kw) for i in range(k) for j in range(i, k)}
    return jnp.block([[upper[i, j] if i <= j else upper[j, i].T for j in range(k)] for i in range(k)])


def chan_term(n_a, sum_a_D, n_b, sum_b_D, row0=None, rows=None):
    """What Chan, Golub & LeVeque add to M2_a + M2_b when two populations merge:
    n_a n_b / n (mean_b - mean_a)(mean_b - mean_a)^T. Leading axes broadcast ([..., D] sums,
    [...] counts -> [..., D, D]; with row0 and rows: only rows row0..row0 + rows, [..., rows, D]);
    the one place isojax writes the formula (stats.merge, the batch update and finalize's
    groups use it)."""
    n = n_a + n_b
    delta = sum_b_D / jnp.maximum(n_b, 1.0)[..., None] - sum_a_D / jnp.maximum(n_a, 1.0)[..., None]
    w = n_a * n_b / jnp.maximum(n, 1.0)
    left = delta if rows is None else lax.dynamic_slice_in_dim(delta, row0, rows, axis=-1)
    return w[..., None, None] * left[..., :, None] * delta[..., None, :]


def _merge_m2(m2: DFPair, idx, n_a, sum_a_D, n_b, sum_b_D, m2_b_RxD, row0=None):
    """M2 = M2_a + M2_b + chan_term, into the double-float slot idx (one in-place write); R = D
    rows, or the rows row0.. this device keeps (StatsOptions.gram_shards)."""
    old_RxDx2 = m2.hl[idx]
    rows = old_RxDx2.shape[0] if row0 is not None else None
    hi, lo = _df_add(old_RxDx2[..., 0], old_RxDx2[..., 1],
                     m2_b_RxD + chan_term(n_a, sum_a_D, n_b, sum_b_D, row0, rows))
    return DFPair(m2.hl.at[idx].set(jnp.stack([hi, lo], -1)))


def _population(acc_sum: DF, count_lo, count_hi, m2_slots, group, s):
    """(n, Sum x) of the population that M2 slot covers: one group, or all groups."""
    if m2_slots > 1:
        return (_count_f32(count_lo[group, s], count_hi[group, s]),
                acc_sum.hi[group, s] + acc_sum.lo[group, s])
    n = jnp.sum(_count_f32(count_lo[:, s], count_hi[:, s]))
    return n, jnp.sum(acc_sum.hi[:, s] + acc_sum.lo[:, s], axis=0)


def _df_slot_add(df: DF, idx, v):
    hi, lo = _df_add(df.hi[idx], df.lo[idx], v)
    return DF(df.hi.at[idx].set(hi), df.lo.at[idx].set(lo))


class Rows(NamedTuple):
    """One state of one batch as update_state reads it, computed once and handed to the step measures'
    observe (stats/measures base.Step): float32, invalid rows zero."""
    x_NxD: Any  # the states in float32, rows not valid_N zero
    norm_N: Any  # |x|
    rowmax_N: Any  # max |x| over each row's dimensions (a sibling of the norms' reduce: one read of x)
    unit_NxD: Any  # x / |x| (zero rows stay zero)
    token_ids_N: Any
    valid_N: Any  # bool: the rows the statistics count (skipped positions and padding False)
    positions_N: Any  # int32: each row's position in its sequence
    sequences_N: Any  # int32: its sequence's index
    state_NxD: Any  # the state as the forward made it (its dtype; rows not valid_N as they are): the sample's
    center_D: Any = None  # the centered pass's center of this state, [D] (stats/measures/centered_inter_sim.py)


class Batch(NamedTuple):
    """One device's batch as the step measures' plan_batch reads it (stats/measures base.Step), once per batch."""
    token_ids_N: Any
    valid_N: Any  # bool: the rows the statistics count (skipped positions and padding False)
    positions_N: Any  # int32: each row's position in its sequence
    sequences_N: Any  # int32: its sequence's index
    index: Any  # the batch's TokenIndex (index_tokens), or None


def update_state(acc: Accumulators, s, x_NxD, token_ids_N, valid_N, group, center_D=None,
                 *, index: TokenIndex | None = None, opts: StatsOptions = DEFAULT_OPTIONS,
                 plans=None, positions_N=None, sequences_N=None, observe=None) -> Accumulators:
    """Add state s of one batch. s, group: (traced) int32 scalars; padding rows
    (valid_N False) contribute nothing, whatever they hold (the caller masks skipped positions,
    StatsOptions.skip_positions, into valid_N). positions_N: each row's position in its sequence
    (None: the batch is one sequence, 0..N-1), sequences_N its sequence's
    index (None: 0); center_D: the centered pass's center of state s (Rows.center_D). observe(acc, s, group, rows:
    Rows, index, plans) -> acc: the step measures' updates of this
    state (stats.measures.observer), called once its Rows are made, with `plans`: their plans of the batch
    (stats.measures.batch_planner, once per batch). `index` (from index_tokens)
    lets a caller sort the ids once per batch instead of once per state. With
    opts.token_shards > 1 this runs inside shard_map: the step measures' per-token sums (IntraSim's)
    hold this device's share of the vocabulary and the batch's per-token sums are exchanged."""
    s, group = jnp.asarray(s, jnp.int32), jnp.asarray(group, jnp.int32)
    token_ids_N, valid_N = jnp.asarray(token_ids_N), jnp.asarray(valid_N)
    gram_dtype = jnp.bfloat16 if x_NxD.dtype == jnp.bfloat16 else jnp.float32
    state_NxD = x_NxD
    x_NxD = jnp.where(valid_N[:, None], x_NxD.astype(jnp.float32), 0.0)
    n_b = jnp.sum(valid_N.astype(jnp.int32))
    n_bf = n_b.astype(jnp.float32)
    norm_N = jnp.sqrt(jnp.sum(x_NxD * x_NxD, axis=1))
    rowmax_N = jnp.max(jnp.abs(x_NxD), axis=1)  # a sibling of the norms' reduce: one read of x
    # Zero vectors (and padding) stay zero rather than becoming NaN.
    unit_NxD = x_NxD / jnp.where(norm_N > 0, norm_N, 1.0)[:, None]

    m2_slots = acc.m2_HxSxDxD.hl.shape[0]
    m2_idx = (group if m2_slots > 1 else 0, s)
    gs = (group, s)
    n_a, sum_a_D = _population(acc.sum_GxSxD, acc.count_lo_GxS, acc.count_hi_GxS,
                               m2_slots, group, s)
    _, unit_sum_a_D = _population(acc.unit_sum_GxSxD, acc.count_lo_GxS, acc.count_hi_GxS,
                                  m2_slots, group, s)

    sum_D, unit_sum_D = pairwise_sum(x_NxD), pairwise_sum(unit_NxD)  # invalid rows are zero
    n_m, sum_m_D, unit_sum_m_D, row0 = n_bf, sum_D, unit_sum_D, None  # the batch's M2 population
    if opts.gram_shards > 1:  # the devices of gram_axis pool their rows; each keeps its rows of M2
        axis = opts.gram_axis
        n_a, sum_a_D, unit_sum_a_D, n_m, sum_m_D, unit_sum_m_D = lax.psum(
            (n_a, sum_a_D, unit_sum_a_D, n_bf, sum_D, unit_sum_D), axis)
        row0 = lax.axis_index(axis) * acc.m2_HxSxDxD.hl.shape[2]
    grams = [_centered_gram(v_NxD, valid_N, v_sum_D / jnp.maximum(n_m, 1.0), gram_dtype, opts)
             for v_NxD, v_sum_D in ((x_NxD, sum_m_D), (unit_NxD, unit_sum_m_D))]
    if opts.gram_shards > 1:  # [D, D] -> this device's rows of the pooled sum, [D / shards, D]
        grams = [lax.psum_scatter(g_DxD, opts.gram_axis, scatter_dimension=0, tiled=True) for g_DxD in grams]
    m2_RxD, unit_m2_RxD = grams
    acc = acc.replace(
        m2_HxSxDxD=_merge_m2(acc.m2_HxSxDxD, m2_idx, n_a, sum_a_D, n_m, sum_m_D, m2_RxD, row0),
        unit_m2_HxSxDxD=_merge_m2(acc.unit_m2_HxSxDxD, m2_idx, n_a, unit_sum_a_D, n_m,
                                  unit_sum_m_D, unit_m2_RxD, row0),
        sum_GxSxD=_df_slot_add(acc.sum_GxSxD, gs, sum_D),
        unit_sum_GxSxD=_df_slot_add(acc.unit_sum_GxSxD, gs, unit_sum_D),
        norm_sum_GxS=_df_slot_add(acc.norm_sum_GxS, gs, pairwise_sum(norm_N[:, None])[0]))
    lo, hi = _add_count(acc.count_lo_GxS[gs], acc.count_hi_GxS[gs], n_b)
    acc = acc.replace(count_lo_GxS=acc.count_lo_GxS.at[gs].set(lo),
                      count_hi_GxS=acc.count_hi_GxS.at[gs].set(hi))
    n = x_NxD.shape[0]
    positions_N = jnp.arange(n, dtype=jnp.int32) if positions_N is None else jnp.asarray(positions_N, jnp.int32)
    sequences_N = jnp.zeros(n, jnp.int32) if sequences_N is None else jnp.asarray(sequences_N, jnp.int32)
    if observe is not None:
        acc = observe(acc, s, group, Rows(x_NxD, norm_N, rowmax_N, unit_NxD, token_ids_N, valid_N, positions_N,
                                          sequences_N, state_NxD, center_D), index, plans)
    return acc


def segment_sums(sorted_NxD, index: TokenIndex, num_rows: int, opts: StatsOptions = DEFAULT_OPTIONS):
    """Per-segment sums of rows already in sorted order, at rows 0..U-1 of a [num_rows, D]
    array (num_rows >= U)."""
    if opts.segment_sum_mode() == "scatter":
        return jax.ops.segment_sum(sorted_NxD, index.rank_N, num_segments=num_rows,
                                   indices_are_sorted=sorted_NxD.shape[1] <= opts.sorted_scatter_max_d)

    def add_within_segment(a, b):
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(start_b[:, None], sum_b, sum_a + sum_b)

    _, prefix_NxD = lax.associative_scan(add_within_segment, (index.starts_N, sorted_NxD))
    ends_N = jnp.concatenate([index.starts_N[1:], jnp.ones(1, bool)])
    target_N = jnp.where(ends_N, index.rank_N, num_rows)  # only segment ends land; the rest drop
    return jnp.zeros((num_rows, sorted_NxD.shape[1]), sorted_NxD.dtype).at[target_N].set(
        prefix_NxD, mode="drop", unique_indices=True, indices_are_sorted=True)


def update(acc: Accumulators, states_SxNxD, token_ids_N, valid_N, group=0,
           centers_SxD=None, opts: StatsOptions = DEFAULT_OPTIONS,
           positions_N=None, sequences_N=None, observe=None, plan=None, vocab_rows: int = 0) -> Accumulators:
    """Add all S states of one batch (ids sorted once, a fori_loop over states). positions_N, sequences_N,
    observe: as update_state takes them; positions below opts.skip_positions are left out. plan: the step
    measures' per-batch hook (stats.measures.batch_planner), run once before the states; the sample's
    (stats/measures/sample_states.py) keys tokens by positions_N and sequences_N. vocab_rows: the padded
    vocabulary V' the token measures' sums hold (IntraSim's, stats/measures/intra_sim.py), which the batch's
    token index keys into (0: none)."""
    states_SxNxD, token_ids_N, valid_N = map(jnp.asarray, (states_SxNxD, token_ids_N, valid_N))
    if opts.skip_positions:
        if positions_N is None:
            raise ValueError("skip_positions needs the rows' positions")
        valid_N = valid_N & (jnp.asarray(positions_N) >= opts.skip_positions)
    centers_SxD = None if centers_SxD is None else jnp.asarray(centers_SxD)
    index = index_tokens(token_ids_N, valid_N, max(vocab_rows, 1), opts.token_shards)
    plans = None
    if plan is not None:
        n = token_ids_N.shape[0]
        acc, plans = plan(acc, Batch(token_ids_N, valid_N,
                                     jnp.arange(n, dtype=jnp.int32) if positions_N is None else
                                     jnp.asarray(positions_N, jnp.int32),
                                     jnp.zeros(n, jnp.int32) if sequences_N is None else
                                     jnp.asarray(sequences_N, jnp.int32), index))

    def body(s, acc):
        center_D = None if centers_SxD is None else centers_SxD[s]
        return update_state(acc, s, states_SxNxD[s], token_ids_N, valid_N, group, center_D,
                            index=index, opts=opts, plans=plans, positions_N=positions_N,
                            sequences_N=sequences_N, observe=observe)

    return lax.fori_loop(0, states_SxNxD.shape[0], body, acc)


def merge(a: Accumulators, b: Accumulators, *, keep_m2: bool = False, m2_row0=None) -> Accumulators:
    """The accumulators of the concatenated data: data parallelism, multi-host and resuming.
    Equal to one pass up to float32 rounding of the merge terms (measured <= 1e-8 relative
    on the finalized metrics), in any association order. Second moments split by rows
    (StatsOptions.gram_shards): keep_m2 keeps a's (a and b hold rows of one pooled population);
    else both hold rows m2_row0.. of their populations' M2."""

    def df_merge(x: DF, y: DF) -> DF:
        hi, err = _two_sum(x.hi, y.hi)
        return DF(hi, x.lo + y.lo + err)

    n_a_GxS = _count_f32(a.count_lo_GxS, a.count_hi_GxS)
    n_b_GxS = _count_f32(b.count_lo_GxS, b.count_hi_GxS)

    def m2_merge(m2_a: DFPair, m2_b: DFPair, sum_a: DF, sum_b: DF) -> DFPair:
        if keep_m2:
            return m2_a
        if m2_a.hi.shape[0] > 1:
            na, nb = n_a_GxS, n_b_GxS
            sa, sb = sum_a.hi + sum_a.lo, sum_b.hi + sum_b.lo
        else:
            na, nb = n_a_GxS.sum(0, keepdims=True), n_b_GxS.sum(0, keepdims=True)
            sa = (sum_a.hi + sum_a.lo).sum(0, keepdims=True)
            sb = (sum_b.hi + sum_b.lo).sum(0, keepdims=True)
        merged = df_merge(m2_a, m2_b)
        rows = m2_a.hi.shape[-2]
        hi, lo = _df_add(merged.hi, merged.lo, chan_term(na, sa, nb, sb, *(
            (m2_row0, rows) if rows != sa.shape[-1] else ())))
        return DFPair.of(hi, lo)

    lo = a.count_lo_GxS + b.count_lo_GxS  # < 2**31 since each limb < 2**30
    return Accumulators(
        count_lo_GxS=lo & ((1 << _COUNT_BITS) - 1),
        count_hi_GxS=a.count_hi_GxS + b.count_hi_GxS + (lo >> _COUNT_BITS),
        sum_GxSxD=df_merge(a.sum_GxSxD, b.sum_GxSxD),
        unit_sum_GxSxD=df_merge(a.unit_sum_GxSxD, b.unit_sum_GxSxD),
        norm_sum_GxS=df_merge(a.norm_sum_GxS, b.norm_sum_GxS),
        m2_HxSxDxD=m2_merge(a.m2_HxSxDxD, b.m2_HxSxDxD, a.sum_GxSxD, b.sum_GxSxD),
        unit_m2_HxSxDxD=m2_merge(a.unit_m2_HxSxDxD, b.unit_m2_HxSxDxD, a.unit_sum_GxSxD,
                                 b.unit_sum_GxSxD),
        layer_steps=tuple(x.merge(y) for x, y in zip(a.layer_steps, b.layer_steps, strict=True)))
