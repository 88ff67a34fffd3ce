"""Shared cases of the registered measures' tests (isojax.stats.measures): Hugging Face float64 hidden
states of random checkpoints of two families (test_author_measures.states_of: 1,024 tokens of 40
token ids, so the embedding has rank 39 and final_ln misses a dimension), the floor as the README
states it, and finalize's read-out of them, each computed once per session."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

FAMILIES = ["gpt_neox", "gpt2"]


@functools.cache
def hf_points(family: str) -> np.ndarray:
    """[S, N, D] float32 hidden states (test_author_measures.states_of)."""
    from test_author_measures import states_of
    return states_of(Path(tempfile.mkdtemp(prefix=f"measures-{family}-")), family)


@functools.cache
def finalized(family: str, bf16: bool) -> tuple[np.ndarray, list[dict], dict]:
    """(the points fed, float32 or rounded to bfloat16, [S, N, D]; finalize's layers; its sources "a"
    and "b", the first and second 512 tokens, each with its own second moments)."""
    from test_stats import _feed
    from isojax.stats import accumulators as stats
    from isojax.stats import finalize as fz
    x = hf_points(family)
    x = x.astype(ml_dtypes.bfloat16) if bf16 else x
    s, n, d = x.shape
    acc = stats.init_accumulators(s, d, num_groups=2)
    acc = _feed(acc, x, np.zeros(n, np.int32), np.ones(n, bool), groups=[0, 1], batch=n // 2)
    out = fz.finalize(acc, [f"s{i}" for i in range(s)], ["a", "b"], bf16=bf16)
    return x.astype(np.float64), out["layers"], out["groups"]


def floored_spectrum(x, bf16: bool, centered: bool = True) -> np.ndarray:
    """The eigenvalues, descending, of the points' covariance (ddof 0; not centered: their second
    moment x^T x / n), under the README's floor set to 0 (test_author_measures.floor_of)."""
    from test_author_measures import floor_of
    x = np.asarray(x, np.float64)
    m = np.cov(x.T, ddof=0) if centered else x.T @ x / len(x)
    lam = np.sort(np.linalg.eigvalsh(m))[::-1]
    return np.where(lam > floor_of(lam, x, bf16), lam, 0.0)


def check_spectral(key: str, reference, sources: bool = True) -> None:
    """finalize's `key` of every state (both families, float32 and bf16) and, with `sources`, of each
    source (float32) against reference(x, bf16) of the same points."""
    import pytest
    for family in FAMILIES:
        for bf16 in (False, True):
            x, layers, groups = finalized(family, bf16)
            tol = 1e-3 if bf16 else 1e-6  # bf16 Grams: ~1e-4 of the spectrum (README "bfloat16")
            for i, layer in enumerate(layers):
                assert layer[key] == pytest.approx(reference(x[i], bf16), rel=tol), (family, bf16, i)
            if bf16 or not sources:
                continue
            half = x.shape[1] // 2
            for g, part in (("a", slice(0, half)), ("b", slice(half, None))):
                for i, layer in enumerate(groups[g]["layers"]):
                    want = reference(x[i, part], bf16)
                    assert layer[key] == (None if want is None else pytest.approx(want, rel=tol)), (family, g, i)


def alone(name: str, *points, host: bool = True):
    """The registered measure `name` alone on one state's points (a "sample" measure) or two consecutive
    states' (a "pairs" one), as the registry writes it (null where undefined): in numpy on the host, or
    jitted (the accelerators' way, x64)."""
    import jax
    from isojax.stats import measures
    m = measures.MEASURES[name]
    with jax.enable_x64(True):
        pending = m.readout(*points) if host else jax.jit(m.readout)(*map(jax.numpy.asarray, points))
    return measures.sample_values(pending)[m.metrics[0].name]


def check_metrics(reference, sources: bool = True, absolute: float | None = None) -> None:
    """check_spectral for each metric of reference(x, bf16) -> {metric: value}; absolute: a tolerance in its units
    in place of check_spectral's relative one."""
    import pytest
    keys = reference(hf_points(FAMILIES[0])[0][:64].astype(np.float64), False).keys()
    for key in keys:
        if absolute is None:
            check_spectral(key, lambda x, bf16: reference(x, bf16)[key], sources)
            continue
        for family in FAMILIES:
            for bf16 in (False, True):
                x, layers, groups = finalized(family, bf16)
                populations = [(layers, slice(None))] + ([(groups["a"]["layers"], slice(0, x.shape[1] // 2)),
                                                          (groups["b"]["layers"], slice(x.shape[1] // 2, None))]
                                                         if sources and not bf16 else [])
                for got, part in populations:
                    for i, layer in enumerate(got):
                        want = reference(x[i, part], bf16)[key]
                        assert (layer[key] is None) == (want is None), (family, bf16, i, key)
                        assert want is None or layer[key] == pytest.approx(want, abs=absolute), (family, bf16, i, key)
