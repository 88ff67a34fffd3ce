"""The batched Householder reduction (isojax.stats.tridiagonal) and finalize's chunks of states:
eigenvalues against numpy's LAPACK eigvalsh of the same float64 matrices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from isojax.stats import accumulators as stats
from isojax.stats import finalize as fz
from isojax.stats import tridiagonal


def _eigs_of_forms(diag_BxD, off_BxD):
    return np.stack([scipy.linalg.eigvalsh_tridiagonal(a, b) for a, b in zip(np.asarray(diag_BxD), np.asarray(off_BxD))])


def _matrices(d, rng):
    """Covariance-like matrices of width d: anisotropic, rank deficient (a LayerNorm state's null
    direction and a low-rank one), with zero rows (no reflection), diagonal, zero, and a 1e6 scale."""
    x = rng.normal(size=(2 * d, d)) * np.linspace(0.01, 3.0, d) + 4.0 * rng.normal(size=d)
    full = x.T @ x / len(x)
    centered = x - x.mean(1, keepdims=True)  # every row sums to 0: one null direction
    low = rng.normal(size=(d, 3))
    zero_rows = full.copy()
    zero_rows[:, ::3] = zero_rows[::3, :] = 0.0
    return np.stack([full, centered.T @ centered / len(x), low @ low.T, zero_rows,
                     np.diag(rng.uniform(0, 5, d)), np.zeros((d, d)), 1e6 * full])


@pytest.mark.parametrize("d", [1, 2, 5, 32, 33, 70, 129])
def test_batched_reduction_keeps_the_eigenvalues(d):
    """Widths below, at and across a panel (32) and the segments' boundaries."""
    a_BxDxD = _matrices(d, np.random.default_rng(d))
    with jax.enable_x64(True):
        diag_BxD, off_BxD = tridiagonal.tridiagonalize(jnp.asarray(a_BxDxD))
    assert diag_BxD.shape == (len(a_BxDxD), d) and off_BxD.shape == (len(a_BxDxD), d - 1)
    for got, a in zip(_eigs_of_forms(diag_BxD, off_BxD), a_BxDxD):
        want = np.linalg.eigvalsh(a)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13 * max(np.abs(want).max(), 1e-300))


def test_chunks_of_states_read_out_as_one(monkeypatch):
    """finalize's accelerator path with a chunk budget of one and of two states' matrices (an
    uneven last chunk), against LAPACK per state: every state gets its own eigenvalues back."""
    rng = np.random.default_rng(7)
    g, n, d, num = 2, 300, 24, 5
    pair = lambda m: stats.DFPair(jnp.asarray(np.stack([m, m - m.astype(np.float32)], -1).astype(np.float32)))
    states = []
    for s in range(num):
        x_GxNxD = (s + 1.0) * (rng.normal(size=(g, n, d)) * np.linspace(0.01, 2.0, d) + rng.normal(size=d))
        dev = x_GxNxD - x_GxNxD.mean(1, keepdims=True)
        u = x_GxNxD / np.linalg.norm(x_GxNxD, axis=-1, keepdims=True)
        udev = u - u.mean(1, keepdims=True)
        states.append((np.full(g, float(n)), x_GxNxD.sum(1), u.sum(1),
                       pair(np.einsum("gnd,gne->gde", dev, dev)), pair(np.einsum("gnd,gne->gde", udev, udev))))
    with jax.enable_x64(True):
        want = [fz._host_eigs(jax.device_get(fz._whole_spectra(*a, per_group=True))) for a in states]
        for states_per_chunk in (1, 2):
            monkeypatch.setattr(fz, "READOUT_BYTES", states_per_chunk * 3 * d * d * 8)
            assert fz.chunk_states(3, d, num) == states_per_chunk  # 5 states: 5 x 1, or 2 + 2 + 1
            got = fz._read_states(lambda s: fz._whole_spectra(*states[s], per_group=True), num, on_cpu=False)
            for (eig, *rest), (ref, *ref_rest) in zip(got, want):
                np.testing.assert_allclose(eig, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
                np.testing.assert_allclose(rest[0], ref_rest[0], rtol=1e-14)
