"""What a measure declares (isojax.stats.measures): its metrics and its float64 read-out.

A measure reads one of:
- "spectra": a state's (or a source's) floored float64 spectra (Spectra below), read out by
  stats.finalize where it reads the covariances; its read-out is a numpy function of them.
- "sample": one state's sampled points x [K, D] (stats/sample.py: the same K uniformly sampled
  tokens at every state, in the same order);
- "pairs": the sampled points of two consecutive states, (x [K, D] of state s - 1, y [K, D] of
  state s), its value that of state s (null for `embed`, which has no predecessor);
- "step": sums of its own, accumulated by the jitted step behind a flag (its module declares its
  flags, accumulators, update, merge and memory: logit_lens.py); read out by run.measure, not here.
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

    def columns(self) -> list[str]:
        """Its columns in layers.csv / sweep.csv."""
        return [f"{self.name}_{key}" for key in self.keys] or [self.name]

    def null(self):
        """Its value where it is not measured or undefined."""
        return {key: None for key in self.keys} if self.keys else None


@dataclasses.dataclass(frozen=True)
class Measure:
    metrics: tuple[Metric, ...]
    reads: str  # "spectra", "sample", "pairs" or "step" (above)
    readout: Callable  # spectra: Spectra -> {name: float | None}; sample, pairs: arrays -> {name: 0-d array}
    paper: str  # its reference
    readme_row: str  # its row of the README's measures table, exactly
    on_by_default: bool = True  # off: not read out unless its flag turns it on (a "step" measure)
    to_final: bool = False  # a "pairs" one also read out across a sweep's checkpoints (above)

    def __post_init__(self):
        assert self.reads in ("spectra", "sample", "pairs", "step"), self.reads
        assert not self.to_final or self.reads == "pairs" and len(self.metrics) == 1 and not self.metrics[0].keys


@dataclasses.dataclass(frozen=True)
class Spectra:
    """One population's spectra for the "spectra" read-outs, float64, descending, floored
    (geometry.floored at geometry.spectral_floor): `centered` the covariance's eigenvalues
    (Sum (x - mean)(x - mean)^T / n), `uncentered` the second moment's (Sum x x^T / n; None where
    not read out: a source's), n the number of states."""
    n: int
    centered: np.ndarray
    uncentered: np.ndarray | None = None
