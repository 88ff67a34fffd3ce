"""What a measure declares (isojax.stats.measures): its metrics and its float64 read-out.

A measure reads one of:
- "moments": a state's (or a source's) first moments (Moments below: the count and the sums of x, x/|x|
  and |x|), read out by stats.finalize for every population; its read-out is a numpy function of them;
- "spectra": a state's (or a source's) floored float64 spectra and what else its second moments give
  (Spectra below), read out by stats.finalize where it reads the covariances (where the population keeps
  second moments of its own and counted a token); its read-out is a numpy function of them.
- "sample": one state's sampled points x [K, D] (stats/sample.py: the same K uniformly sampled
  tokens at every state, in the same order);
- "pairs": the sampled points of two consecutive states, (x [K, D] of state s - 1, y [K, D] of
  state s), its value that of state s (null for `embed`, which has no predecessor);
- "step": sums of its own, accumulated by the jitted step (its Measure.step, a Step below, declares
  its flags, setting, accumulators, update, merge, read-out and memory: logit_lens.py, for one);
  the step, the planner and the run call it for every step measure that is on (registry: steps()).
A "pairs" measure with `to_final` is also read out across a sweep's checkpoints: each state against
the same state of the final checkpoint (sweep.csv's `NAME_to_final`, run/sweep_files.py).
Sample read-outs are written with the array API (numpy, or jax.numpy under jax.jit where the
sample lies on the devices, as stats.geometry's sample functions): float64 0-d arrays, NaN where
undefined (the registry writes null). A metric with `keys` is a dict {key: value} in metrics.json
(its read-out: a float64 1-D array, one value a key), flattened to the columns `name_key` in
layers.csv / sweep.csv (run.results.flat_layer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str  # its key in metrics.json's layers (and its column in layers.csv / sweep.csv)
    unit: str  # what its number counts
    label: str  # its axis label in the report's figures
    keys: tuple[str, ...] = ()  # a dict-valued metric's keys (above); () for a number
    per_token: bool = False  # an array [S, V] in tokens.zarr (a step measure's Step.tokens), not a layer's value
    identifier: bool = False  # where another metric was found (a dimension, token id, position), not a quantity:
    # in metrics.json and layers.csv, but not drawn, correlated nor among names() and columns()
    listed: bool = False  # a list of dicts (inter_sim_by_position's bands), flattened into columns of its own by
    # run.results.flat_layer: not among names() and columns()
    only_where_on: bool = False  # in a layer only where its measure is on (centered_inter_sim: a --centered run),
    # absent elsewhere, not null: not among names(), columns() and nulls()
    drawn: bool = True  # among the report's figures of the measures (report/measures.py); False: drawn with the
    # paper's figures (report/states.py: InterSim, IntraSim, anisotropy) or not a figure (a count)

    def columns(self) -> list[str]:
        """Its columns in layers.csv / sweep.csv."""
        return [f"{self.name}_{key}" for key in self.keys] or [self.name]

    def null(self):
        """Its value where it is not measured or undefined."""
        return {key: None for key in self.keys} if self.keys else None


@dataclasses.dataclass(frozen=True)
class Measure:
    metrics: tuple[Metric, ...]
    reads: str  # "moments", "spectra", "sample", "pairs" or "step" (above)
    readout: Callable  # moments: Moments, spectra: Spectra -> {name: value | None}; sample, pairs: arrays ->
    # {name: 0-d array}
    paper: str  # its reference
    readme_row: str  # its row of the README's measures table, exactly
    on_by_default: bool = True  # off: not read out unless its flag turns it on (a "step" measure: its Step's default)
    step: "Step | None" = None  # a "step" measure's hooks (below)
    to_final: bool = False  # a "pairs" one also read out across a sweep's checkpoints (above)

    def __post_init__(self):
        assert self.reads in ("moments", "spectra", "sample", "pairs", "step"), self.reads
        assert (self.reads == "step") == (self.step is not None), "a step measure, and only one, has a Step"
        assert not self.to_final or self.reads == "pairs" and len(self.metrics) == 1 and not self.metrics[0].keys


@dataclasses.dataclass(frozen=True)
class Step:
    """What a "step" measure adds to the step and the run. Its setting: a non-negative integer, 0 off
    (StatsOptions.step_measures holds (module name, setting) of those on). One device's sums: a
    NamedTuple of arrays (the step's global ones lead with a device axis, split over every device,
    checkpointed with the accumulators and added on the host; `layer_part`: merged on the devices).
    Arrays by the axis names of stats.accumulators; jax is imported inside the hooks (the registry
    stays free of it).

    Its update is `observe` (each state of each batch inside the layer scan, per device, inside
    stats.accumulators.update_state, from the state's Rows it computes once: x, |x|, max |x|, x/|x|),
    after its `plan_batch` where it has one (once per batch and device, before the states: what every
    state of the batch shares)
    or `after_forward` (each device's rows of every state, kept in a buffer [S, B, T, D] during the
    forward, after it)."""
    keyword: str  # its keyword of isojax.measure (MeasureConfig.build) taking the setting
    add_arguments: Callable  # (ap, positive_int): its command-line flags
    setting: Callable  # (args) -> int | None: its setting from the flags; None: not given (`default`)
    init: Callable  # (setting, num_groups, num_states, vocab_rows, width, dtype) -> one device's zero sums (placement
    # "vocab": every device's, [S, V', ...]); dtype: the forward's (the states' as the model produces them)
    # (per-device numpy sums, num_devices, vocab_size) -> its sums on the host, float64; None: its sums are read
    # where they lie, not by Runner.step_sums (the sample's: Runner.sample)
    merged: Callable | None
    step_bytes: Callable  # (cfg, dtype, tokens_per_device, setting, model_axis) -> device bytes the step adds
    default: int = 0  # its setting where not given
    boolean: bool = False  # its setting is on or off: its keyword takes True and False too (1 and 0)
    needs_token_stats: bool = False  # on only with token stats (then `observe` gets the batch's TokenIndex)
    needs_sequences: Callable = lambda setting: False  # whether the step needs the rows' sequence indices
    # (sums, setting, s, group, rows, index, plan) -> sums: state s of one batch, per device; rows: its
    # stats.accumulators.Rows (float32, valid_N without the skipped positions; positions and sequence indices
    # int32; state_NxD the state as the forward made it); index: the batch's TokenIndex (with token stats);
    # plan: what its plan_batch returned for this batch (None without plan_batch)
    observe: Callable | None = None
    # (sums, setting, batch) -> (sums, plan): once per batch and device, before the states (stats.accumulators.
    # Batch: the batch's token ids, valid rows, positions, sequence indices and TokenIndex, what every state
    # shares); `plan` (None, or a pytree of arrays of rank 1 or more: the step passes it between its shard_maps split
    # on the first axis) goes to each state's observe.
    # The sample's: its slots' new keys and which rows enter which slots (sample_states.py)
    plan_batch: Callable | None = None
    # its sums sit in the accumulators' layer part (Accumulators.layer_steps) and are merged with it on the
    # devices by their Sums.merge(other) (symmetric: partners agree bit for bit); `merged` then gets them merged,
    # with a device axis of 1. Else they are added on the host (`merged` gets every device's)
    layer_part: bool = False
    # (module, params, setting) -> (update, weights): update(sums, states_SxBxTxD, tokens_BxT, seg_BxT,
    # kept_BxT, pos_BxT, seq_BxT, group, weights) -> sums, per device after the forward
    after_forward: Callable | None = None
    # where its sums lie: "device", each device's own (a leading device axis, above); "vocab", split over the padded
    # vocabulary V' on every device (axis 1 of each leaf, [S, V', ...]: device k holds rows k * V'/n.., token ids
    # j * n + k; device/runner.py), no device axis, each token row on one device: nothing to merge (the per-token
    # IntraSim sums, intra_sim.py). Observed after the others of the state (where the step did them before they were
    # a step measure)
    placement: str = "device"
    # on exactly with token statistics (setting 1; added by device/runner.py's Layout, as the sample by the planner),
    # not by a flag of its own
    with_token_stats: bool = False
    # its plan_batch and observe take the statistics' options (stats.options.StatsOptions) as the keyword `opts`
    takes_options: bool = False
    layers: Callable | None = None  # (sums, groups or None) -> per state {metric: value} (None: every group)
    tokens: Callable | None = None  # (sums, count_V) -> {name: [S, V] float64}, written into tokens.zarr
    info: Callable | None = None  # (sums, setting, tokens counted) -> metrics.json's block named as its module


@dataclasses.dataclass(frozen=True)
class Moments:
    """One population's first moments for the "moments" read-outs, float64: n states x, their sums."""
    n: int
    sum_D: np.ndarray  # Sum x
    unit_sum_D: np.ndarray  # Sum x/|x|
    norm_sum: float  # Sum |x|


@dataclasses.dataclass(frozen=True)
class Spectra:
    """One population's spectra for the "spectra" read-outs, float64, descending, floored
    (geometry.floored at geometry.spectral_floor): `centered` the covariance's eigenvalues
    (Sum (x - mean)(x - mean)^T / n), `uncentered` the second moment's (Sum x x^T / n; None where
    not read out: a source's), n the number of states (n >= 1); with what else stats.finalize reads from
    the second moments (None where not read out)."""
    n: int
    centered: np.ndarray
    uncentered: np.ndarray | None = None
    unit: np.ndarray | None = None  # the unit vectors' covariance's (a state's over every source; a source's: None)
    centered_raw: np.ndarray | None = None  # `centered` before the floor
    # the largest eigenvalue's share of the trace of the second moment's and of the unit vectors' covariance
    top_share_uncentered: float | None = None
    top_share_unit: float | None = None
    mean_sq_norm: float | None = None  # Sum |x|^2 / n
    second_moment_diag_D: np.ndarray | None = None  # the diagonal of Sum x x^T / n
    unit_cov_diag_D: np.ndarray | None = None  # the diagonal of the unit vectors' covariance
    unit_sum_D: np.ndarray | None = None  # Sum x/|x|
    # a source's IsoScore* covariance (1 - zeta) C + zeta C0's eigenvalues, floored (None: a state over every
    # source, whose C0 is C); zeta: its shrinkage
    shrunk: np.ndarray | None = None
    zeta: float | None = None
