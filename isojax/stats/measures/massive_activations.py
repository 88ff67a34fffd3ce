"""Massive activations (Sun et al. 2024), streamed and exact: per state, the largest |x| over every
measured token and dimension, and where it is. A step measure on by default (base.Step): its
accumulators, per-state update inside the layer scan, merge and read-out are here.

  massive_max = max |x| over the measured tokens and dimensions of the state (float32: a max is exact),
  massive_dim its dimension, massive_token the token id, massive_position its position in its sequence.
Equal maxima go to the earliest token, by (its sequence's index in the token cache, position), then the
lowest dimension (_earlier): token identity, not batch order, so any device count, batch size or
resume gives the same answer.

The update: the rows' maxima of |x| (Rows.rowmax_N: update_state's one reduce beside its norms, on the
same float32 masked rows), the earliest row holding the largest, merged into each (group, state)'s pair
by the rule above. Merge across devices and processes: the pairs sit in the accumulators' layer part
(Step.layer_part) and are merged with it on the devices by the same rule (Sums.merge: a total order, so
any fold gives the same pair); checkpointed with the accumulators. Read out per layer (over every group);
a source's layers do not carry them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step

NAMES = ("massive_max", "massive_dim", "massive_token", "massive_position")


class Sums(NamedTuple):
    """One device's running maxima (the step's global ones lead with a device axis)."""
    max_GxS: Any  # float32 max |x| over measured tokens and dimensions; -1 before any token
    at_GxSx4: Any  # int32: its (dim, token id, position, sequence index); -1 before any

    def merge(self, other: "Sums") -> "Sums":
        """The pairs of both (two devices' or two halves'), elementwise by `merge`."""
        return Sums(*merge(self.max_GxS, self.at_GxSx4, other.max_GxS, other.at_GxSx4))


def init(setting: int, num_groups: int, num_states: int, vocab_rows: int = 0, width: int = 0, dtype=None) -> Sums:
    import jax.numpy as jnp
    return Sums(jnp.full((num_groups, num_states), -1.0, jnp.float32),
                jnp.full((num_groups, num_states, 4), -1, jnp.int32))


def _earlier(at_a, at_b):
    """Whether a's token comes before b's: (sequence index, position, dim) lexicographic, on [..., 4]
    arrays of (dim, token id, position, sequence index)."""
    import jax.numpy as jnp
    before, same = jnp.zeros(at_a.shape[:-1], bool), jnp.ones(at_a.shape[:-1], bool)
    for k in (3, 2, 0):
        before = before | (same & (at_a[..., k] < at_b[..., k]))
        same = same & (at_a[..., k] == at_b[..., k])
    return before


def merge(max_a, at_a, max_b, at_b):
    """The larger of two (max |x|, where) pairs, elementwise; on a tie the earlier token (_earlier).
    Symmetric, so merge partners agree bit for bit; an empty side has max -1."""
    import jax.numpy as jnp
    take_b = (max_b > max_a) | ((max_b == max_a) & (max_b >= 0) & _earlier(at_b, at_a))
    return jnp.where(take_b, max_b, max_a), jnp.where(take_b[..., None], at_b, at_a)


def batch_max(x_NxD, rowmax_N, valid_N, token_ids_N, positions_N, sequences_N):
    """(max |x|, [4] where) of one batch's valid rows (x float32, invalid rows zero; rowmax_N the rows'
    maxima of |x|): the earliest row holding the largest, then the lowest dim of that row."""
    import jax.numpy as jnp
    rowmax_N = jnp.where(valid_N, rowmax_N, -1.0)
    top = jnp.max(rowmax_N)
    tied_N = rowmax_N == top
    last = jnp.iinfo(jnp.int32).max
    seq = jnp.min(jnp.where(tied_N, sequences_N, last))
    tied_N = tied_N & (sequences_N == seq)
    pos = jnp.min(jnp.where(tied_N, positions_N, last))
    row = jnp.argmax(tied_N & (positions_N == pos))
    dim = jnp.argmax(jnp.abs(x_NxD[row]))  # the first of equal values: the lowest dim
    return top, jnp.stack([dim, token_ids_N[row], pos, seq]).astype(jnp.int32)


def observe(sums: Sums, setting: int, s, group, rows, index, plan=None) -> Sums:
    """State s of one batch, per device (base.Step.observe)."""
    import jax.numpy as jnp
    top, at_4 = batch_max(rows.x_NxD, rows.rowmax_N, rows.valid_N, rows.token_ids_N.astype(jnp.int32),
                          rows.positions_N, rows.sequences_N)
    gs = (group, s)
    new_max, new_at = merge(sums.max_GxS[gs], sums.at_GxSx4[gs], top, at_4)
    return Sums(sums.max_GxS.at[gs].set(new_max), sums.at_GxSx4.at[gs].set(new_at))


def merged(per_device: Sums, num_devices: int = 1, vocab_size: int = 0) -> dict:
    """The pairs (numpy, a leading device axis: merged on the devices already, or several to merge) merged by
    `merge`: {"max": [G, S], "at": [G, S, 4]}."""
    top, at = per_device.max_GxS[0], per_device.at_GxSx4[0]
    for i in range(1, len(per_device.max_GxS)):
        top, at = merge(top, at, per_device.max_GxS[i], per_device.at_GxSx4[i])
    return {"max": np.asarray(top), "at": np.asarray(at)}


def _of_state(max_G, at_Gx4) -> dict:
    """The largest over groups, ties to the earliest token (merge's order)."""
    seen = [g for g in range(len(max_G)) if max_G[g] >= 0]
    if not seen:
        return dict.fromkeys(NAMES)
    g = min(seen, key=lambda g: (-float(max_G[g]), int(at_Gx4[g, 3]), int(at_Gx4[g, 2]), int(at_Gx4[g, 0])))
    dim, token, position, _ = (int(v) for v in at_Gx4[g])
    return dict(massive_max=float(max_G[g]), massive_dim=dim, massive_token=token, massive_position=position)


def readout(sums: dict, groups=None) -> list[dict]:
    """Per state, massive_* over every group; a source's layers (groups given) carry none."""
    num_states = sums["max"].shape[1]
    if groups is not None:
        return [{} for _ in range(num_states)]
    out = [_of_state(sums["max"][:, s], sums["at"][:, s]) for s in range(num_states)]
    if out and out[0]["massive_max"] is None:
        from isojax.log import log
        log("massive_max, massive_dim, massive_token and massive_position are null: no token was measured")
    return out


def step_bytes(cfg, dtype: str, tokens_per_device: int, setting: int, model_axis: int = 1) -> int:
    """The pairs (20 bytes a group and state: counted with one group), as the accumulators counted them before
    they were a step measure; the rows' maxima lie within the measured peak of memory.STEP_BYTES_PER_TOKEN_WIDTH."""
    return 20 * cfg.num_states if setting else 0


STEP = Step(keyword="massive_activations", add_arguments=lambda ap, positive_int: None, setting=lambda args: None,
            init=init, merged=merged, step_bytes=step_bytes, default=1, boolean=True, observe=observe, layers=readout,
            layer_part=True)

MEASURE = Measure(
    metrics=(Metric("massive_max", "|x|", "largest |activation|"),
             Metric("massive_dim", "dimension", "its dimension", identifier=True),
             Metric("massive_token", "token id", "its token id", identifier=True),
             Metric("massive_position", "position", "its position", identifier=True)),
    reads="step", readout=readout, paper="Sun et al. 2024 (massive activations)", step=STEP,
    readme_row="| `massive_max`, `massive_dim`, `massive_token`, `massive_position` | the largest \\|x\\| over every "
               "measured token and dimension, and where (streamed, exact: below) | Sun et al. 2024 (massive activations) |")
