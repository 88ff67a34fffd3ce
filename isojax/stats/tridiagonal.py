"""Householder reduction of a batch of symmetric matrices to tridiagonal form, blocked as LAPACK's
dsytrd (dlatrd's panels), written in jax so that a batch of B matrices goes through its D steps
side by side: cuSOLVER's sytrd takes one matrix at a time, and one [1024, 1024] float64 matrix costs
it ~8 ms of latency (a column after another), where the batch's steps are bandwidth (bench/RESULTS.md
15c). The eigenvalues of the tridiagonal forms come from finalize._bisect.

Each step reads the trailing matrix once (its product with the step's reflector); a panel's PANEL
reflectors update it once, as one product. The trailing matrix shrinks at SEGMENTS static sizes, so
that the steps read ~0.4 D^3 entries in all (the unshrunk matrix: D^3) with a program of fixed size.
"""

import functools

import jax
import jax.numpy as jnp

PANEL = 32  # reflectors applied together (dlatrd's nb)
SEGMENTS = 8  # static trailing sizes (the matrix shrinks after each)


def _panel(a_BxMxM, diag_BxM, off_BxM, p):
    """Panel p of a_BxMxM (columns p * PANEL ...): its reflectors, as dlatrd, and the trailing
    update A - V W^T - W V^T. Fills diag_BxM[:, c] and off_BxM[:, c] (the subdiagonal of column c)."""
    b, m, _ = a_BxMxM.shape
    rows_M = jnp.arange(m)

    def column(j, carry):
        v_BxMxP, w_BxMxP, diag_BxM, off_BxM = carry
        c = p * PANEL + j
        # column c as updated by the panel's earlier reflectors (rows of a symmetric matrix)
        a_BxM = (jax.lax.dynamic_index_in_dim(a_BxMxM, c, 1, keepdims=False)
                 - jnp.einsum("bmp,bp->bm", v_BxMxP, jax.lax.dynamic_index_in_dim(w_BxMxP, c, 1, keepdims=False))
                 - jnp.einsum("bmp,bp->bm", w_BxMxP, jax.lax.dynamic_index_in_dim(v_BxMxP, c, 1, keepdims=False)))
        diag_BxM = diag_BxM.at[:, c].set(a_BxM[:, c])
        alpha_B = jnp.take(a_BxM, jnp.minimum(c + 1, m - 1), axis=1) * (c + 1 < m)
        below_BxM = jnp.where(rows_M > c + 1, a_BxM, 0.0)
        sigma_B = jnp.sum(below_BxM * below_BxM, axis=1)
        reflect_B = sigma_B > 0
        beta_B = jnp.where(reflect_B, -jnp.where(alpha_B >= 0, 1.0, -1.0) * jnp.sqrt(alpha_B ** 2 + sigma_B), alpha_B)
        tau_B = jnp.where(reflect_B, (beta_B - alpha_B) / jnp.where(reflect_B, beta_B, 1.0), 0.0)
        scale_B = jnp.where(reflect_B, alpha_B - beta_B, 1.0)
        v_BxM = below_BxM / scale_B[:, None] + (rows_M == c + 1)
        off_BxM = off_BxM.at[:, c].set(beta_B)
        y_BxM = (jnp.einsum("bmn,bn->bm", a_BxMxM, v_BxM)
                 - jnp.einsum("bmp,bp->bm", v_BxMxP, jnp.einsum("bmp,bm->bp", w_BxMxP, v_BxM))
                 - jnp.einsum("bmp,bp->bm", w_BxMxP, jnp.einsum("bmp,bm->bp", v_BxMxP, v_BxM)))
        w_BxM = tau_B[:, None] * y_BxM
        w_BxM = w_BxM - (0.5 * tau_B * jnp.sum(w_BxM * v_BxM, axis=1))[:, None] * v_BxM
        v_BxMxP = jax.lax.dynamic_update_index_in_dim(v_BxMxP, v_BxM, j, 2)
        w_BxMxP = jax.lax.dynamic_update_index_in_dim(w_BxMxP, w_BxM, j, 2)
        return v_BxMxP, w_BxMxP, diag_BxM, off_BxM

    zeros = jnp.zeros((b, m, PANEL), a_BxMxM.dtype)
    v_BxMxP, w_BxMxP, diag_BxM, off_BxM = jax.lax.fori_loop(0, PANEL, column, (zeros, zeros, diag_BxM, off_BxM))
    vw_BxMxM = jnp.einsum("bmp,bnp->bmn", v_BxMxP, w_BxMxP)
    return a_BxMxM - vw_BxMxM - vw_BxMxM.swapaxes(1, 2), diag_BxM, off_BxM


@jax.jit
def tridiagonalize(a_BxDxD):
    """([B, D] diagonals, [B, D-1] off-diagonals) of a tridiagonal matrix similar to each symmetric
    a_BxDxD[i] (only its lower triangle's values matter as long as it is symmetric); float64 under
    jax.enable_x64. The same eigenvalues as jax.lax.linalg.tridiagonal's forms (the off-diagonals'
    signs may differ)."""
    b, d, _ = a_BxDxD.shape
    # segment sizes: multiples of PANEL, the last segment taking the rest
    seg = max(PANEL, -(-d // SEGMENTS) // PANEL * PANEL)
    diags, offs, a, done = [], [], a_BxDxD, 0
    while done < d:
        m = d - done
        cols = min(seg, m)
        diag_BxM, off_BxM = jnp.zeros((b, m), a.dtype), jnp.zeros((b, m), a.dtype)
        full, rest = divmod(cols, PANEL)

        def panels(p, carry):
            return _panel(*carry, p)

        a, diag_BxM, off_BxM = jax.lax.fori_loop(0, full, panels, (a, diag_BxM, off_BxM))
        if rest:  # the matrix's last columns: a partial panel, done one reflector at a time by a full one's code
            a, diag_BxM, off_BxM = _panel_tail(a, diag_BxM, off_BxM, full, rest)
        diags.append(diag_BxM[:, :cols])
        offs.append(off_BxM[:, :cols])
        a, done = a[:, cols:, cols:], done + cols
    return jnp.concatenate(diags, 1), jnp.concatenate(offs, 1)[:, :d - 1]


def _panel_tail(a_BxMxM, diag_BxM, off_BxM, p, rest):
    """The last `rest` (< PANEL) columns: the matrix padded to a whole panel with zeros (their
    rows and columns zero: tau 0, no reflection), the panel run, the padding dropped."""
    b, m, _ = a_BxMxM.shape
    pad = PANEL - rest
    a = jnp.pad(a_BxMxM, ((0, 0), (0, pad), (0, pad)))
    a, diag, off = _panel(a, jnp.pad(diag_BxM, ((0, 0), (0, pad))), jnp.pad(off_BxM, ((0, 0), (0, pad))), p)
    return a[:, :m, :m], diag[:, :m], off[:, :m]
