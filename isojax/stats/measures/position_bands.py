"""InterSim by position band (the attention-sink controls of Xiao et al. 2024 and Sun et al. 2024), streamed:
per state, the InterSim of the states at positions [0, 1), [1, 16), [16, 128), [128, inf) of their sequences.
A step measure on by default (base.Step): its accumulators, per-state update inside the layer scan, merge
and read-out are here.

  inter_sim_by_position = [{"lo", "hi", "tokens", "inter_sim"}, ...], one per band (hi null for the last):
  inter_sim = (|Sum u|^2 - n) / (n^2 - n) over the n measured tokens of the band, u = x / |x|.
A position is the token's position in its packed segment as the model sees it: a sequence longer than the
row is cut into windows, each starting at 0. Positions left out by --skip-positions are in no band; a band
of fewer than 2 tokens reads out null, with one log line.

The update: per band, the unit vectors' sum (band_sums: masked copies of update_state's pairwise tree of the
unit sum, whose first level reads Rows.unit_NxD as the unit sum's does: sibling reductions, which XLA fuses
into one pass on GPUs) TwoSum-added into double-float sums (accumulators._df_add), and the band's tokens
into int32 limbs. Merge across devices and processes: the sums sit in the accumulators' layer part
(Step.layer_part) and are merged with it on the devices (Sums.merge: TwoSum of the hi parts, the lo parts
added; counts limb by limb); checkpointed with the accumulators; read out in float64 (hi + lo). Read out
per layer (over every group); a source's layers do not carry it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step

POSITION_BANDS = (0, 1, 16, 128)  # the bands' lower ends: [0, 1), [1, 16), [16, 128), [128, inf)
COUNT_BITS = 30  # accumulators._COUNT_BITS: the counts' int32 limbs


class Sums(NamedTuple):
    """One device's per-band sums, B = len(POSITION_BANDS)."""
    count_lo_BxS: Any  # int32 limbs of the measured tokens per band
    count_hi_BxS: Any
    sum_hi_BxSxD: Any  # Sum x/|x| per band, double-float (hi + lo)
    sum_lo_BxSxD: Any

    def merge(self, other: "Sums") -> "Sums":
        """Both devices' (or halves') sums, as stats.accumulators.merge adds its own."""
        from isojax.stats.accumulators import _add_count, _two_sum
        lo, hi = _add_count(self.count_lo_BxS, self.count_hi_BxS + other.count_hi_BxS, other.count_lo_BxS)
        sum_hi, err = _two_sum(self.sum_hi_BxSxD, other.sum_hi_BxSxD)
        return Sums(lo, hi, sum_hi, self.sum_lo_BxSxD + other.sum_lo_BxSxD + err)


def init(setting: int, num_groups: int, num_states: int, vocab_rows: int = 0, width: int = 0, dtype=None) -> Sums:
    import jax.numpy as jnp
    b = len(POSITION_BANDS)
    return Sums(jnp.zeros((b, num_states), jnp.int32), jnp.zeros((b, num_states), jnp.int32),
                jnp.zeros((b, num_states, width), jnp.float32), jnp.zeros((b, num_states, width), jnp.float32))


def band_sums(x_NxD, band_N, num_bands: int):
    """[num_bands, D]: Sum of the rows of each band, as accumulators.pairwise_sum sums (its first level of 16
    rows, then its tree), in one pass over x: the first level is a reduce of x times the rows' one-hot
    bands, [N/16, B, D], a quarter of x's size at four bands, not B masked copies of x."""
    import jax.numpy as jnp

    from isojax.stats.accumulators import pairwise_sum
    n, d = x_NxD.shape
    pad = -n % 16
    if pad:
        x_NxD = jnp.concatenate([x_NxD, jnp.zeros((pad, d), x_NxD.dtype)])
        band_N = jnp.concatenate([band_N, jnp.full(pad, -1, band_N.dtype)])
    onehot_NxB = (band_N[:, None] == jnp.arange(num_bands, dtype=band_N.dtype)).astype(x_NxD.dtype)
    first_MxBxD = (x_NxD.reshape(-1, 16, 1, d) * onehot_NxB.reshape(-1, 16, num_bands, 1)).sum(axis=1)
    return pairwise_sum(first_MxBxD.reshape(first_MxBxD.shape[0], num_bands * d)).reshape(num_bands, d)


def position_band(positions_N):
    """Band index (POSITION_BANDS) of each position."""
    import jax.numpy as jnp
    return sum((positions_N >= lo).astype(jnp.int32) for lo in POSITION_BANDS[1:])


def observe(sums: Sums, setting: int, s, group, rows, index, plan=None) -> Sums:
    """State s of one batch, per device (base.Step.observe): the bands' unit sums and counts."""
    import jax.numpy as jnp

    from isojax.stats.accumulators import _add_count, _df_add
    b = len(POSITION_BANDS)
    band_N = position_band(rows.positions_N)
    sums_BxD = band_sums(rows.unit_NxD, band_N, b)
    counts_B = jnp.sum(rows.valid_N[:, None] & (band_N[:, None] == jnp.arange(b)), axis=0, dtype=jnp.int32)
    lo_B, hi_B = _add_count(sums.count_lo_BxS[:, s], sums.count_hi_BxS[:, s], counts_B)
    sum_hi, sum_lo = _df_add(sums.sum_hi_BxSxD[:, s], sums.sum_lo_BxSxD[:, s], sums_BxD)
    return Sums(sums.count_lo_BxS.at[:, s].set(lo_B), sums.count_hi_BxS.at[:, s].set(hi_B),
                sums.sum_hi_BxSxD.at[:, s].set(sum_hi), sums.sum_lo_BxSxD.at[:, s].set(sum_lo))


def merged(per_device: Sums, num_devices: int = 1, vocab_size: int = 0) -> dict:
    """The sums merged on the devices (numpy, a device axis of 1): {"tokens": [B, S] int64, "sum": [B, S, D]
    float64 (hi + lo)}."""
    (count_lo, count_hi, hi, lo), = zip(*per_device)
    tokens = (np.asarray(count_hi, np.int64) << COUNT_BITS) + np.asarray(count_lo, np.int64)
    return {"tokens": tokens, "sum": np.asarray(hi, np.float64) + np.asarray(lo, np.float64)}


def _bands(n_B, sum_BxD) -> list[dict]:
    out = []
    for b, lo in enumerate(POSITION_BANDS):
        n = int(n_B[b])
        inter = (float(sum_BxD[b] @ sum_BxD[b]) - n) / (n * n - n) if n >= 2 else None
        hi = POSITION_BANDS[b + 1] if b + 1 < len(POSITION_BANDS) else None
        out.append({"lo": lo, "hi": hi, "tokens": n, "inter_sim": inter})
    return out


def readout(sums: dict, groups=None) -> list[dict]:
    """Per state, inter_sim_by_position over every group; a source's layers (groups given) carry none."""
    num_states = sums["tokens"].shape[1]
    if groups is not None:
        return [{} for _ in range(num_states)]
    out = [{"inter_sim_by_position": _bands(sums["tokens"][:, s], sums["sum"][:, s])} for s in range(num_states)]
    few = [f"[{b['lo']}, {'inf' if b['hi'] is None else b['hi']}) ({b['tokens']} tokens)"
           for b in (out[0]["inter_sim_by_position"] if out else []) if b["tokens"] < 2]
    if few:
        from isojax.log import log
        log(f"inter_sim_by_position is null in the position bands of fewer than 2 tokens: {', '.join(few)}")
    return out


def step_bytes(cfg, dtype: str, tokens_per_device: int, setting: int, model_axis: int = 1) -> int:
    """The sums (B x S x (2 x 4 + 2 x 4 x D) bytes), as the accumulators counted them before they were a step
    measure; the first level of the bands' tree lies within the measured peak of memory.STEP_BYTES_PER_TOKEN_WIDTH."""
    return 8 * len(POSITION_BANDS) * cfg.num_states * (1 + cfg.hidden_size) if setting else 0


STEP = Step(keyword="position_bands", add_arguments=lambda ap, positive_int: None, setting=lambda args: None,
            init=init, merged=merged, step_bytes=step_bytes, default=1, boolean=True, observe=observe, layers=readout,
            layer_part=True)

MEASURE = Measure(
    metrics=(Metric("inter_sim_by_position", "cosine", "InterSim by position band", listed=True),),
    reads="step", readout=readout, paper="the attention-sink controls of Xiao et al. 2024 and Sun et al. 2024",
    step=STEP,
    readme_row="| `inter_sim_by_position` | InterSim of the states at positions [0, 1), [1, 16), [16, 128), [128, ∞) of "
               "their sequences (below) | the attention-sink controls of Xiao et al. 2024 and Sun et al. 2024 |")
