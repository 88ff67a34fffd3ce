"""Mean norm per token id (the norm against frequency, as Macocco et al. 2025 plot it): per state and
token id, the mean L2 norm of the token's states, in tokens.zarr beside `count` and `intra_sim`.
A step measure (base.Step) of one file: its flag, sums, per-state update, merge, read-out and memory.

Definition, per state s and token id v, over the tokens the statistics count (--skip-positions
applies; the same tokens as tokens.zarr/count): mean_norm[s, v] = Sum |x_s(t)| / count[v] over the
tokens t of id v (NaN where count[v] = 0).

The step: inside the layer scan, per device and state, the norms |x| in float32 of the forward's
states (stats.accumulators.Rows: those of its norm sums), summed per token id by a sorted segment sum
over the batch's sort of the ids (stats.accumulators.index_tokens: made once per batch with token
stats; segment_sums in its associative-scan form, never an unordered scatter-add, so the sums are
bit-reproducible), then TwoSum-added (accumulators._df_add) into the device's double-float sums of
every token id [S, V'] (V' the padded vocabulary, in the token stats' key order), one scatter of the
batch's distinct ids. Kept per device (a leading device axis), checkpointed with the accumulators
and added over the devices in float64 on the host.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step

# On by default with token statistics: +0.5% of a 1.4b loop on an H200 (bench/RESULTS.md 18; the rule: on
# by default only under 1% of the loop); False turns it off by default (--token-norms then turns it on).
ON_BY_DEFAULT = True


def add_arguments(ap, positive_int) -> None:
    import argparse
    ap.add_argument("--token-norms", action=argparse.BooleanOptionalAction, default=None,
                    help="the mean norm per token id and state in tokens.zarr/mean_norm (with token statistics; "
                         f"default: {'on' if ON_BY_DEFAULT else 'off'})")


def setting(args) -> int | None:
    return None if args.token_norms is None else int(args.token_norms)


class Sums(NamedTuple):
    """One device's double-float sums of |x| per state and token id (hi + lo, float32), [S, V']."""
    hi_SxV: Any
    lo_SxV: Any


def init(on: int, num_groups: int, num_states: int, vocab_rows: int, width: int = 0, dtype=None) -> Sums:
    import jax.numpy as jnp
    return Sums(jnp.zeros((num_states, vocab_rows), jnp.float32), jnp.zeros((num_states, vocab_rows), jnp.float32))


def observe(sums: Sums, on: int, s, group, rows, index, plan=None) -> Sums:
    """State s of one device's batch: its norms (rows.norm_N) summed per token id (index: the batch's TokenIndex)."""
    from isojax.stats.accumulators import _df_add, segment_sums
    from isojax.stats.options import StatsOptions
    norm_N = rows.norm_N
    n = norm_N.shape[0]
    seg_N = segment_sums(norm_N[index.order_N][:, None], index, n, StatsOptions(segment_sum="scan"))[:, 0]
    rows = (s, index.uniq_U)  # distinct ascending keys; padding keys >= V' are dropped
    hi_N, lo_N = _df_add(sums.hi_SxV.at[rows].get(mode="fill", fill_value=0.0),
                         sums.lo_SxV.at[rows].get(mode="fill", fill_value=0.0), seg_N)
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    return Sums(sums.hi_SxV.at[rows].set(hi_N, **kw), sums.lo_SxV.at[rows].set(lo_N, **kw))


def merged(per_device: Sums, num_devices: int, vocab_size: int) -> np.ndarray:
    """Sum |x| [S, V] in float64, added over the devices, in token id order."""
    from isojax.stats.accumulators import token_order
    sums = (np.asarray(per_device.hi_SxV, np.float64) + np.asarray(per_device.lo_SxV, np.float64)).sum(0)
    return token_order(sums, num_devices, vocab_size)


def tokens(sums: np.ndarray, count_V) -> dict:
    """tokens.zarr/mean_norm [S, V]: Sum |x| / count (NaN where a token was not seen)."""
    count = np.asarray(count_V, np.float64)
    return {"mean_norm": np.where(count > 0, sums / np.where(count > 0, count, 1.0), np.nan)}


def step_bytes(cfg, dtype: str, tokens_per_device: int, on: int, model_axis: int = 1) -> int:
    """The sums (two float32 [S, V] per device) and a few float32 and int32 [N] temporaries per state."""
    return 8 * cfg.num_states * cfg.vocab_size + 32 * tokens_per_device if on else 0


STEP = Step(keyword="token_norms", add_arguments=add_arguments, setting=setting, init=init, merged=merged,
            step_bytes=step_bytes, default=int(ON_BY_DEFAULT), boolean=True, needs_token_stats=True,
            observe=observe, tokens=tokens)

MEASURE = Measure(
    metrics=(Metric("mean_norm", "L2 norm", "mean norm of the token's states", per_token=True),),
    reads="step", readout=tokens, paper="Macocco et al. 2025", on_by_default=ON_BY_DEFAULT, step=STEP,
    readme_row="| `mean_norm` | per token id and state, `tokens.zarr/mean_norm` [L+2, V] float64: the mean L2 norm of "
               "the token's states, Σ ‖x‖ / `count` over the tokens the statistics count (`--skip-positions` "
               "applies; NaN where a token was not seen); norms in float32, summed per token id by a sorted segment "
               "sum of each batch, added in double-float; with token statistics, on by default (`--no-token-norms` "
               "or `token_norms=False` in `measure`: off; on one H200 a 1.4b loop of 2M tokens took 10.94 s with it, 10.89 s "
               "without, 10.93 s before it existed: bench/RESULTS.md 18); the report draws it against the token's count | "
               "Macocco et al. 2025 |")
