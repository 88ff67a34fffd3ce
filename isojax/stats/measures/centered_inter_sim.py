"""Centered InterSim (`--centered`): the mean cosine over distinct pairs of a state's tokens after subtracting the
state's mean, InterSim as Machina & Mercer define it (§3.6) of x - mean(x), the centering of Biś et al. 2021
(*Too Much in Common*). A step measure (base.Step) of the centered pass alone: its setting, sums, per-state
update, merge, read-out and memory are here.

  centered_inter_sim = (|Sum u|^2 - n) / (n^2 - n) over the n measured tokens of the state, u = (x - c)/|x - c|,
  c the state's mean over every measured token and group (the first pass's, in float64, rounded to float32).
A token equal to the center adds a zero vector (no NaN); a state of fewer than 2 tokens reads out NaN (null in
metrics.json).

Its setting is 1 in the second pass of a --centered run and 0 (off) elsewhere: not a flag of its own (--centered,
`centered=True` of isojax.measure, starts that pass: run/centered.py), so the first pass never carries its sums.
device/runner.py's Layout(centered=True) turns it on (Runner.second_pass), and the centers [S, D] are an argument
of the step (Runner.centers_SxD), each state's reaching observe as Rows.center_D (stats.accumulators.update_state).
One device's sums: Sum u per group and state, double-float (hi + lo, float32), in the accumulators' layer part
(Step.layer_part), merged with it on the devices (Sums.merge: TwoSum of the hi parts, the lo parts added, as
stats.accumulators.merge adds its own). Read out in float64 (hi + lo) over every group, with the pass's token
counts (Accumulators.layer_count). The centered pass is not checkpointed: an interruption repeats it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step


class Sums(NamedTuple):
    """One device's sums (the step's global ones lead with a device axis)."""
    sum_hi_GxSxD: Any  # Sum (x - c)/|x - c| over the measured tokens, double-float (hi + lo)
    sum_lo_GxSxD: Any

    def merge(self, other: "Sums") -> "Sums":
        """Both devices' (or halves') sums, as stats.accumulators.merge adds its own."""
        from isojax.stats.accumulators import _two_sum
        hi, err = _two_sum(self.sum_hi_GxSxD, other.sum_hi_GxSxD)
        return Sums(hi, self.sum_lo_GxSxD + other.sum_lo_GxSxD + err)


def init(setting: int, num_groups: int, num_states: int, vocab_rows: int = 0, width: int = 0, dtype=None) -> Sums:
    import jax.numpy as jnp
    return Sums(*(jnp.zeros((num_groups, num_states, width), jnp.float32) for _ in range(2)))


def observe(sums: Sums, setting: int, s, group, rows, index, plan=None) -> Sums:
    """State s of one batch, per device (base.Step.observe): the unit vectors of x - c summed by
    stats.accumulators.pairwise_sum (masked rows zero) and TwoSum-added into the group's and state's slot."""
    import jax.numpy as jnp

    from isojax.stats.accumulators import _df_add, pairwise_sum
    if rows.center_D is None:
        raise ValueError("the centered pass needs each state's center (Rows.center_D): pass centers_SxD")
    dev_NxD = jnp.where(rows.valid_N[:, None], rows.x_NxD - rows.center_D.astype(jnp.float32), 0.0)
    dnorm_N = jnp.sqrt(jnp.sum(dev_NxD * dev_NxD, axis=1))
    dunit_NxD = dev_NxD / jnp.where(dnorm_N > 0, dnorm_N, 1.0)[:, None]
    sum_D, gs = pairwise_sum(dunit_NxD), (group, s)
    hi, lo = _df_add(sums.sum_hi_GxSxD[gs], sums.sum_lo_GxSxD[gs], sum_D)
    return Sums(sums.sum_hi_GxSxD.at[gs].set(hi), sums.sum_lo_GxSxD.at[gs].set(lo))


def merged(per_device: Sums, num_devices: int = 1, vocab_size: int = 0) -> dict:
    """The sums merged on the devices (numpy, a device axis of 1): {"sum": [G, S, D] float64 (hi + lo)}."""
    (hi, lo), = zip(*per_device)
    return {"sum": np.asarray(hi, np.float64) + np.asarray(lo, np.float64)}


def readout(sums: dict, count_S) -> list[dict]:
    """Per state, centered_inter_sim over every group, float64; count_S: each state's measured tokens (int)."""
    from isojax.stats.measures.inter_sim import mean_cos
    out = []
    for s, n in enumerate(count_S):
        sum_D = sums["sum"][:, s].sum(0)
        out.append({"centered_inter_sim": float(mean_cos(sum_D @ sum_D, n))})
    return out


def step_bytes(cfg, dtype: str, tokens_per_device: int, setting: int, model_axis: int = 1) -> int:
    """The sums, 2 x 4 x S x D bytes (one group). Only the centered pass has them, which runs after the first
    pass with neither token statistics nor a sample: it fits where the first pass fits, which the planner plans."""
    return 8 * cfg.num_states * cfg.hidden_size if setting else 0


STEP = Step(keyword="centered", add_arguments=lambda ap, positive_int: None, setting=lambda args: None,
            init=init, merged=merged, step_bytes=step_bytes, boolean=True, observe=observe, layer_part=True)

MEASURE = Measure(
    metrics=(Metric("centered_inter_sim", "cosine", "centered InterSim", only_where_on=True),),
    reads="step", readout=readout, on_by_default=False, step=STEP,
    paper="Machina & Mercer 2024 (InterSim, §3.6); centering: Biś et al. 2021 (Too Much in Common)",
    readme_row="| `centered_inter_sim` | **`--centered` only** (a second pass over the data with the first pass's "
               "mean: twice the time); InterSim of x − c, c the state's mean over every measured token: "
               "(‖Σu‖² − n)/(n² − n), u = (x − c)/‖x − c‖ (0 where x = c), from double-float sums in float64; per "
               "layer (a source's layers carry none), absent without `--centered` | Machina & Mercer 2024 (InterSim, "
               "§3.6); centering: Biś et al. 2021 (Too Much in Common) |")
