"""Linear CKA (Kornblith et al. 2019) of every state of a checkpoint against every state of a
reference checkpoint on the same K sampled tokens (a sweep's sweep_cka.json), in float64 on a JAX
device: x64 is switched on around each call, as stats/finalize.py does for its read-outs.

    against = CkaAgainst(final_SxKxD)        # the reference's states, prepared once on the device
    matrix = against.matrix(states_SxKxD)    # [[CKA(states[i], final[j]) for j] for i]
    to_reference(names, states_SxKxD, final_SxKxD)  # {name: [measure(states[s], final[s]) for s]}

Each state is centered (its mean over the K tokens removed) and its norm ||X^T X||_F taken once.
With K < D the cross terms come from the K x K Grams (||Y^T X||_F^2 = <X X^T, Y Y^T>_F: one
[S, K^2] x [K^2, S] product), else from Y^T X_i for every reference state j at once, one state i
at a time. Held on the device: the reference's Grams [S, K, K] or centered states [S, K, D], in
float64 (`nbytes`); a call adds the same again for the checkpoint's, and transiently at most as
much for the cross products. The float64 reference on the host is numpy's (tests/test_cross_cka.py).
to_reference: the registered pairs measures (cka_debiased, procrustes_distance, svcca: their own
read-outs) of each state with the same state of the reference, as the sample's read-out runs them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _uses_grams(k: int, d: int) -> bool:
    return k < d


@jax.jit
def _prepare(states_SxKxD):
    """(Grams [S, K, K] or centered states [S, K, D], ||X^T X||_F [S]) in float64."""
    x = states_SxKxD.astype(jnp.float64)
    x = x - x.mean(axis=1, keepdims=True)
    if _uses_grams(*x.shape[1:]):
        gram_SxKxK = jnp.einsum("skd,sld->skl", x, x)
        return gram_SxKxK, jnp.sqrt(jnp.sum(gram_SxKxK * gram_SxKxK, axis=(1, 2)))
    return x, jax.lax.map(lambda x_KxD: jnp.linalg.norm(x_KxD.T @ x_KxD), x)


@functools.partial(jax.jit, static_argnames="grams")
def _cross(x, y, grams: bool):
    """[S, T]: ||Y_j^T X_i||_F^2 from prepared states: both Grams, or both centered states."""
    if grams:
        return jnp.einsum("ikl,jkl->ij", x, y)

    def row(x_KxD):
        c_TxDxD = jnp.einsum("kd,jke->jde", x_KxD, y)
        return jnp.sum(c_TxDxD * c_TxDxD, axis=(1, 2))
    return jax.lax.map(row, x)


class CkaAgainst:
    """The reference checkpoint's states [S, K, D] (any float dtype, numpy or JAX arrays), prepared
    on the device once; matrix(states) gives each checkpoint's CKA matrix against it."""

    def __init__(self, reference_SxKxD):
        self.shape = tuple(np.shape(reference_SxKxD))
        if len(self.shape) != 3:
            raise ValueError(f"states must be [S, K, D], got the shape {self.shape}")
        self.grams = _uses_grams(*self.shape[1:])
        self._prepared, self._norms = self._prepare(reference_SxKxD)

    @staticmethod
    def _prepare(states):
        with jax.enable_x64(True):
            return _prepare(jnp.asarray(states))

    @property
    def nbytes(self) -> int:
        """Device bytes held for the reference."""
        return int(self._prepared.nbytes + self._norms.nbytes)

    def matrix(self, states_SxKxD) -> list[list[float | None]]:
        """[[linear CKA(states[i], reference[j]) for j] for i], float64; None where either state
        does not vary over the K tokens."""
        shape = tuple(np.shape(states_SxKxD))
        if len(shape) != 3 or shape[1:] != self.shape[1:]:
            raise ValueError(f"states of the shape {shape} against a reference of {self.shape}")
        prepared, norms = self._prepare(states_SxKxD)
        with jax.enable_x64(True):
            cross_SxT = np.asarray(_cross(prepared, self._prepared, self.grams))
        nx, ny = np.asarray(norms), np.asarray(self._norms)
        return [[float(cross_SxT[i, j] / (nx[i] * ny[j])) if nx[i] > 0 and ny[j] > 0 else None
                 for j in range(len(ny))] for i in range(len(nx))]


def to_reference(names, states_SxKxD, reference_SxKxD) -> dict[str, list[float | None]]:
    """{metric: [its value of (states[s], reference[s]) for s]} of the registered pairs measures `names`
    (MEASURES[name].readout), float64: in numpy on the CPU, else jitted on the device
    (stats.measures.pairs_dispatch), every state dispatched before any is read; None where undefined."""
    from isojax.stats import measures
    if np.shape(states_SxKxD) != np.shape(reference_SxKxD):
        raise ValueError(f"states of the shape {np.shape(states_SxKxD)} against a reference of "
                         f"{np.shape(reference_SxKxD)}")
    put = np.asarray if measures.on_host() else jnp.asarray
    xs, ys = put(states_SxKxD), put(reference_SxKxD)
    pending = [measures.pairs_dispatch(xs[s], ys[s], names) for s in range(xs.shape[0])]
    values = {metric: [float(np.asarray(p[metric])) for p in pending] for metric in (pending[0] if pending else {})}
    return {metric: [v if np.isfinite(v) else None for v in vs] for metric, vs in values.items()}
