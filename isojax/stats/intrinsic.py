"""Intrinsic dimension of a point cloud: TwoNN, MLE and MoM, equal to scikit-dimension's.

The estimators of *The Shape of Learning* (section 2.4), each equal to scikit-dimension 0.5
(`skdim.id.TwoNN()`, `skdim.id.MLE()`, `skdim.id.MOM()` with `n_neighbors=k`) to 1e-3
relative, on points of any size N x D that fits the device.

Axis names: N points, D features; a query block of B rows is searched against point blocks
of P rows, in G groups of g columns; K = k + SPARE candidates per row.

Neighbours (`knn_distances`): the k nearest other points of every point, by index (the point
itself is left out, an exact duplicate of it counts at distance 0), sorted, as skdim's
`get_nn` (sklearn `kneighbors()` with no query) and TwoNN's sorted distance rows give them.
It runs on the accelerator and never holds an N x N matrix:
  1. squared distances of a B x P block from |q|^2 + |p|^2 - 2 q.p (one float32 matmul at
     precision HIGHEST, on mean-centred points so that the norms, and so the cancellation,
     stay small);
  2. exact selection of the K smallest of the block without sorting it: the minimum of each
     group of g columns, the K groups with the smallest minima (every one of the K smallest
     values lies in one of them), then the K smallest of those K*g values; merged with the
     K best of the earlier point blocks;
  3. the K candidates' distances measured again as ||x_i - x_j|| from the raw float32 points
     (no cancellation: a duplicate gives exactly 0) and sorted; the k smallest are kept.
The SPARE candidates absorb the float32 error of step 1 (relative ~1e-7 of |q|^2 + |p|^2),
which could only swap points whose distances agree to that precision. The search runs close to
the bare HIGHEST matmul's time; faster bf16x3 and TF32 matmuls give no such guarantee
(bench/RESULTS.md 9).

Estimators (float64 numpy on the N x k distances; the O(N k) arithmetic is negligible):
  TwoNN: mu = r2/r1; the int(N (1 - discard_fraction)) smallest mu are kept; slope of the
    least-squares line through the origin of -log(1 - i/N) on log(mu_(i)).
  MLE: per point m = (k - 1) / sum_j log(r_k / r_j) (Levina-Bickel), combined as
    1 / mean(1 / m) (MacKay-Ghahramani): skdim's MLE default comb='mle'.
  MoM: per point m = -mean(r) / (mean(r) - r_k) over the k distances; mean over points.
Duplicates: a point whose nearest neighbour is at distance 0 has no TwoNN ratio and an
infinite MLE term; skdim's TwoNN drops such points with a warning and so do `twonn` and
`mle` (skdim's MLE would return 0.0). `mom` keeps them as skdim does and drops only points
whose k distances are all equal (skdim: NaN or -inf). Each drop warns with its count.
`intrinsic_dimensions(..., min_kept=f)` refuses (UserError) a sample that keeps fewer than a
fraction f of its points once duplicates are dropped; extract uses f = MIN_KEPT_SAMPLE = 1/2.
Input is cast to float32; float64 input is centred in float64 first, so that a large
common offset costs no float32 precision. Against skdim (float64) on the same points: at
most 3e-8 relative (tests, CPU; GPU figures in bench/RESULTS.md 9).
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.errors import UserError

# extract --sample-states: a layer whose sample keeps fewer than half its points once exact
# duplicates are dropped (the embedding layer: one row per token type) gets a null dimension;
# the embedding of 4,096 sampled tokens kept 571 points and gave 212.9, far above every block.
MIN_KEPT_SAMPLE = 0.5
SPARE = 8              # extra candidates per row that absorb the float32 error of the Gram trick
QUERY_BLOCK = 2048     # B: query rows per block (the faster of 1024 and 2048: bench/RESULTS.md 9)
POINT_BLOCK = 16384    # P: point rows per block (a B x P float32 block is 128 MiB)
PRECISION = lax.Precision.HIGHEST  # of the search matmul: float32, no TF32 (see the docstring)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _as_points(X) -> jax.Array:
    """[N, D] float32 on the device, or UserError."""
    if isinstance(X, jax.Array):
        if X.ndim != 2:
            raise UserError(f"X must be a 2-D [N, D] array, got shape {tuple(X.shape)}")
        if not (jnp.issubdtype(X.dtype, jnp.floating) or jnp.issubdtype(X.dtype, jnp.integer)):
            raise UserError(f"X must hold real numbers, got dtype {X.dtype}")
        x_NxD = X.astype(jnp.float32)
    else:
        a = np.asarray(X)
        if a.ndim != 2:
            raise UserError(f"X must be a 2-D [N, D] array, got shape {a.shape}")
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise UserError(f"X must hold real numbers, got dtype {a.dtype}")
        if a.dtype.itemsize > 4 and a.size:  # float64/int64: centre before float32 drops digits
            a = a.astype(np.float64)
            with np.errstate(all="ignore"):
                a = a - a.mean(axis=0)
        x_NxD = jnp.asarray(a, dtype=jnp.float32)
    if x_NxD.shape[1] == 0:
        raise UserError("X has no features (D = 0)")
    if not bool(jnp.all(jnp.isfinite(x_NxD))):
        raise UserError("X contains NaN or infinite values (after conversion to float32)")
    return x_NxD


def _smallest(d2_BxP, n_cand: int, group: int):
    """Exact K smallest values of each row and their column, via group minima (no full sort)."""
    b, p = d2_BxP.shape
    d2_BxGxg = d2_BxP.reshape(b, p // group, group)
    # A value among the K smallest of a row lies in one of the K groups with smallest minima:
    # each group ranked before its own has a distinct member no larger than it.
    _, grp_BxK = lax.top_k(-jnp.min(d2_BxGxg, axis=2), n_cand)
    sub_BxKxg = d2_BxGxg[jnp.arange(b)[:, None], grp_BxK]
    neg_BxK, pos_BxK = lax.top_k(-sub_BxKxg.reshape(b, n_cand * group), n_cand)
    col_BxK = jnp.take_along_axis(grp_BxK, pos_BxK // group, axis=1) * group + pos_BxK % group
    return -neg_BxK, col_BxK


@partial(jax.jit, static_argnames=("k", "n_cand", "query_block", "point_block", "group", "precision"))
def _knn(x_NxD, *, k, n_cand, query_block, point_block, group, precision=PRECISION):
    n, d = x_NxD.shape
    n_qblocks, n_pblocks = -(-n // query_block), -(-n // point_block)
    xc_NxD = x_NxD - jnp.mean(x_NxD, axis=0)  # distances are shift-invariant; small norms, small error
    sq_N = jnp.sum(xc_NxD * xc_NxD, axis=1)

    def pad(a, rows):
        return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

    q_QxBxD = pad(xc_NxD, n_qblocks * query_block).reshape(n_qblocks, query_block, d)
    qsq_QxB = pad(sq_N, n_qblocks * query_block).reshape(n_qblocks, query_block)
    row_QxB = jnp.arange(n_qblocks * query_block, dtype=jnp.int32).reshape(n_qblocks, query_block)
    p_CxPxD = pad(xc_NxD, n_pblocks * point_block).reshape(n_pblocks, point_block, d)
    psq_CxP = pad(sq_N, n_pblocks * point_block).reshape(n_pblocks, point_block)
    col_CxP = jnp.arange(n_pblocks * point_block, dtype=jnp.int32).reshape(n_pblocks, point_block)

    def query_block_fn(args):
        q_BxD, qsq_B, row_B = args

        def point_block_fn(carry, args):
            best_BxK, best_id_BxK = carry
            p_PxD, psq_P, col_P = args
            d2_BxP = qsq_B[:, None] + psq_P[None, :] - 2.0 * jnp.einsum(
                "bd,pd->bp", q_BxD, p_PxD, precision=precision)
            # the point itself and the padding are no neighbours
            invalid_BxP = (col_P[None, :] >= n) | (col_P[None, :] == row_B[:, None])
            d2_BxP = jnp.where(invalid_BxP, jnp.inf, d2_BxP)
            val_BxK, local_BxK = _smallest(d2_BxP, n_cand, group)
            all_Bx2K = jnp.concatenate([best_BxK, val_BxK], axis=1)
            all_id_Bx2K = jnp.concatenate([best_id_BxK, col_P[0] + local_BxK], axis=1)
            neg_BxK, pos_BxK = lax.top_k(-all_Bx2K, n_cand)
            return (-neg_BxK, jnp.take_along_axis(all_id_Bx2K, pos_BxK, axis=1)), None

        init = (jnp.full((query_block, n_cand), jnp.inf, jnp.float32),
                jnp.zeros((query_block, n_cand), jnp.int32))
        (best_BxK, id_BxK), _ = lax.scan(point_block_fn, init, (p_CxPxD, psq_CxP, col_CxP))
        # measure the candidates again from the raw points: x_i - x_j has no cancellation
        xq_BxD = x_NxD[jnp.minimum(row_B, n - 1)]
        diff_BxKxD = xq_BxD[:, None, :] - x_NxD[jnp.minimum(id_BxK, n - 1)]
        dist_BxK = jnp.sqrt(jnp.sum(diff_BxKxD * diff_BxKxD, axis=2))
        dist_BxK = jnp.where(jnp.isinf(best_BxK), jnp.inf, dist_BxK)
        return jnp.sort(dist_BxK, axis=1)[:, :k]

    dist_QxBxk = lax.map(query_block_fn, (q_QxBxD, qsq_QxB, row_QxB))
    return dist_QxBxk.reshape(n_qblocks * query_block, k)[:n]


def _check_k(k, n: int, need: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < need:
        raise UserError(f"k must be an integer >= {need}, got {k!r}")
    if n <= k:
        raise UserError(f"need more than k = {k} points for k neighbours each, got N = {n}")


def knn_distances(X, k: int, *, query_block: int = QUERY_BLOCK, point_block: int = POINT_BLOCK) -> np.ndarray:
    """Distances [N, k] (float64, ascending) from each point to its k nearest other points."""
    x_NxD = _as_points(X)
    n = x_NxD.shape[0]
    _check_k(k, n, 1)
    return _knn_checked(x_NxD, int(k), query_block, point_block)


def _knn_checked(x_NxD, k, query_block=QUERY_BLOCK, point_block=POINT_BLOCK) -> np.ndarray:
    n = x_NxD.shape[0]
    n_cand = min(k + SPARE, n - 1)  # with n - 1 every other point is a candidate: exact anyway
    b = _round_up(-(-n // -(-n // query_block)), 8)  # equal blocks, little padding
    p = _round_up(-(-n // -(-n // point_block)), 128)
    group = 1
    while group < 128 and (2 * group) ** 2 * n_cand <= p:  # g ~ sqrt(P/K): both top_k stay small
        group *= 2
    dist = _knn(x_NxD, k=k, n_cand=n_cand, query_block=b, point_block=p, group=group)
    return np.asarray(jax.device_get(dist), dtype=np.float64)


def _drop(keep: np.ndarray, what: str, name: str, notes: list | None = None) -> None:
    """Warn of dropped points, or append (name, dropped, of, what) to `notes` (a caller that logs)."""
    dropped = int(keep.size - np.count_nonzero(keep))
    if dropped:
        if notes is None:
            warnings.warn(f"{name}: dropped {dropped} of {keep.size} points {what}", stacklevel=4)
        else:
            notes.append((name, dropped, int(keep.size), what))
    if not keep.any():
        raise UserError(f"{name}: every point was dropped ({what}); the dimension is undefined")


def _twonn_from(dist_NxK: np.ndarray, discard_fraction: float, notes: list | None = None) -> float:
    r1, r2 = dist_NxK[:, 0], dist_NxK[:, 1]
    keep = r1 > 0
    _drop(keep, "with a duplicate (nearest-neighbour distance 0)", "twonn", notes)  # as skdim's TwoNN
    mu = r2[keep] / r1[keep]
    n = mu.size
    # skdim keeps int(N (1 - f)); at f = 0 the largest ratio has F_emp = 1, y = inf, and
    # skdim raises: leave that one point out instead.
    n_keep = min(int(n * (1 - discard_fraction)), n - 1)
    if n_keep < 2:
        raise UserError(f"twonn: fewer than 2 points left after discarding (N = {n}, "
                        f"discard_fraction = {discard_fraction})")
    x = np.log(np.sort(mu)[:n_keep])
    y = -np.log(1.0 - np.arange(1, n_keep + 1) / n)
    xx = np.dot(x, x)
    if xx == 0:
        raise UserError("twonn: every kept ratio r2/r1 is 1 (points on a lattice?); the dimension is undefined")
    return float(np.dot(x, y) / xx)  # least squares through the origin


def _mle_from(dist_NxK: np.ndarray, notes: list | None = None) -> float:
    keep = dist_NxK[:, 0] > 0
    _drop(keep, "with a duplicate (nearest-neighbour distance 0)", "mle", notes)
    r = dist_NxK[keep]
    k = r.shape[1]
    inv_m = np.sum(np.log(r[:, -1:] / r), axis=1) / (k - 1)  # 1 / Levina-Bickel estimate
    mean_inv = np.mean(inv_m)
    if mean_inv == 0:
        raise UserError("mle: every point's k neighbour distances are equal; the dimension is undefined")
    return float(1.0 / mean_inv)


def _mom_from(dist_NxK: np.ndarray, notes: list | None = None) -> float:
    keep = dist_NxK[:, 0] < dist_NxK[:, -1]
    _drop(keep, "whose k neighbour distances are all equal", "mom", notes)
    r = dist_NxK[keep]
    w = r[:, -1]
    m1 = np.sum(r, axis=1) / r.shape[1]
    return float(np.mean(-m1 / (m1 - w)))


def _check_discard(discard_fraction) -> float:
    try:
        f = float(discard_fraction)
    except (TypeError, ValueError):
        raise UserError(f"discard_fraction must be a number in [0, 1), got {discard_fraction!r}") from None
    if not 0.0 <= f < 1.0:
        raise UserError(f"discard_fraction must be in [0, 1), got {discard_fraction!r}")
    return f


def twonn(X, discard_fraction: float = 0.1) -> float:
    """TwoNN (Facco et al. 2017) as skdim.id.TwoNN(discard_fraction).fit(X).dimension_."""
    f = _check_discard(discard_fraction)
    x_NxD = _as_points(X)
    if x_NxD.shape[0] < 3:
        raise UserError(f"twonn needs at least 3 points, got N = {x_NxD.shape[0]}")
    return _twonn_from(_knn_checked(x_NxD, 2), f)


def mle(X, k: int = 20) -> float:
    """Levina-Bickel MLE, MacKay-Ghahramani average, as skdim.id.MLE().fit(X, n_neighbors=k)."""
    x_NxD = _as_points(X)
    _check_k(k, x_NxD.shape[0], 2)
    return _mle_from(_knn_checked(x_NxD, int(k)))


def mom(X, k: int = 20) -> float:
    """Method of Moments (Amsaleg et al. 2018) as skdim.id.MOM().fit(X, n_neighbors=k)."""
    x_NxD = _as_points(X)
    _check_k(k, x_NxD.shape[0], 2)
    return _mom_from(_knn_checked(x_NxD, int(k)))


def intrinsic_dimensions(X, k: int = 20, discard_fraction: float = 0.1, *, min_kept: float = 0.0,
                         notes: list | None = None) -> dict[str, float]:
    """{"twonn", "mle", "mom"} from one neighbour search (TwoNN uses its first two columns).

    min_kept: the least fraction of the points that may remain once those with an exact
    duplicate are dropped; below it a UserError, as the dimension of a few distinct points says
    little about the cloud (`extract --sample-states` passes MIN_KEPT_SAMPLE). notes: a list
    that receives (estimator, dropped, of, why) for each drop instead of a warning."""
    f = _check_discard(discard_fraction)
    x_NxD = _as_points(X)
    _check_k(k, x_NxD.shape[0], 2)
    dist_NxK = _knn_checked(x_NxD, int(k))
    n, kept = dist_NxK.shape[0], int(np.count_nonzero(dist_NxK[:, 0] > 0))
    if kept < min_kept * n:
        raise UserError(f"only {kept:,} of {n:,} points have no exact duplicate (fewer than "
                        f"{min_kept:.0%}): a degenerate sample")
    return {"twonn": _twonn_from(dist_NxK, f, notes), "mle": _mle_from(dist_NxK, notes),
            "mom": _mom_from(dist_NxK, notes)}
