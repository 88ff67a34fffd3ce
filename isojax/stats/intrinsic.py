"""Intrinsic dimension of a point cloud: TwoNN, MLE and MoM, equal to scikit-dimension's.

The estimators of *The Shape of Learning* (section 2.4), each equal to scikit-dimension 0.5
(`skdim.id.TwoNN()`, `skdim.id.MLE()`, `skdim.id.MOM()` with `n_neighbors=k`) to 1e-3
relative, on points of any size N x D that fits the device.

Axis names: N points, D features; a query block of B rows is searched against point blocks
of P rows, in G groups of g columns; K = k + SPARE candidates per row.

Neighbours (`knn_distances`): the k nearest other points of every point, by index (the point
itself is left out, an exact duplicate of it counts at distance 0), sorted, as skdim's
`get_nn` (sklearn `kneighbors()` with no query) and TwoNN's sorted distance rows give them.
A distance is the float32 ||x_i - x_j|| of the raw points (a duplicate gives exactly 0). The
search runs on the accelerator, never holds an N x N matrix, and proves each row exact:
  1. on points centred and scaled by a power of two (max |entry| < 1), the B x P block
     |q|^2 + |p|^2 - 2 q.p from one matmul at a cheap precision (TF32 on GPU, float32
     elsewhere), less C |p|^2 (below): it ranks points by a lower bound of their distance;
  2. exact selection of the K smallest of the block without sorting it: the minimum of each
     group of g columns, the K groups with the smallest minima (every one of the K smallest
     values lies in one of them), then the K smallest of those K*g values; merged with the K
     best of the earlier point blocks;
  3. the K candidates measured from the raw points; the k smallest are kept;
  4. certificate: every point left out is at squared distance >= floor = (K-th value) - C |q|^2
     - 2^-100; a row whose k-th measured value, raised by 1 + 2 (D + 4) 2^-23, is <= floor is
     exact. The others are searched again at HIGHEST with K = k + 4 SPARE, and those that fail
     again exhaustively (measured ||x_i - x_j|| to every point): `knn_distances(fallback=[])`.
The bound C (`_bound`): with q, p the centred, scaled points, Q = |q|^2, P = |p|^2, u = 2^-24,
the value of step 1 without its shift is within C0 (Q + P) of the raw points' squared
distance (scaled), C0 the sum of
  - the product: inputs rounded by <= u_in (TF32 truncated: 2^-10; float32: 2^-24), D products
    and D - 1 additions each off by <= u_acc = 2^-22 (4 u: truncating tensor-core adders, any
    order): |err q.p| <= (2 u_in + u_in^2 + (1 + u_in)^2 D u_acc) |q| |p|, 2 |q| |p| <= Q + P;
  - Q and P in float32: D u (Q + P); the centring's rounding (each point moves by
    <= u |x - mean|): 4 u (Q + P); the few float32 additions after the product: 16 u (Q + P);
and C = 2 C0 (D = 2048: 5.1e-3 with TF32, 1.2e-3 in float32). So a point's true value is >=
its step-1 value - C0 Q + (C - C0) P >= it - C |q|^2; subnormal flushes cost < D 2^-125, in
the 2^-100. A measured squared distance is off by <= delta = (D + 4) u (a rounded difference,
square, D - 1 additions); the factor of step 4 exceeds (1 + delta) / (1 - delta) by more than
the test's own rounding, so a certified row's k smallest measured values are an exhaustive
search's. Points far from the mean relative to their neighbour distances (two distant tight
clusters) fail and take the exhaustive path; bench/bench_intrinsic.py counts such rows.

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
SPARE = 16             # extra candidates per row beyond k (the search again takes 4 SPARE)
QUERY_BLOCK = 2048     # B: query rows per block (the faster of 1024 and 2048: bench/RESULTS.md 9)
POINT_BLOCK = 16384    # P: point rows per block (a B x P float32 block is 128 MiB)
EXACT_BLOCK = 2 ** 21  # elements of a query x point x D block of the exhaustive search (8 rows)
INPUT_ROUNDING = {"TF32_TF32_F32": 2.0 ** -10, "HIGHEST": 2.0 ** -24}  # u_in of the docstring


def _cheap_precision(x_NxD):
    """TF32 on GPU (named as an algorithm, so no flag can make it cheaper); float32 elsewhere."""
    gpu = next(iter(x_NxD.devices())).platform == "gpu"
    return lax.DotAlgorithmPreset.TF32_TF32_F32 if gpu else lax.Precision.HIGHEST


def _bound(d: int, precision) -> float:
    """C of the docstring: |computed - true squared distance| <= C0 (Q + P), C = 2 C0."""
    u_in, u, u_acc = INPUT_ROUNDING[precision.name], 2.0 ** -24, 2.0 ** -22
    c0 = 2 * u_in + u_in ** 2 + (1 + u_in) ** 2 * d * u_acc + d * u + 4 * u + 16 * u
    return 2 * c0


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


@jax.jit
def _prepare(x_NxD):
    """Centred points scaled by 2^-e (max |entry| < 1, exact), their squared norms, 2^-2e."""
    xc_NxD = x_NxD - jnp.mean(x_NxD, axis=0)  # distances are shift-invariant; small norms, small error
    _, e = jnp.frexp(jnp.max(jnp.abs(xc_NxD)))
    scale = jnp.ldexp(jnp.float32(1), -jnp.maximum(e, -60))  # 2^-e; its square stays finite
    xs_NxD = xc_NxD * scale
    return xs_NxD, jnp.sum(xs_NxD * xs_NxD, axis=1), scale * scale


def _pad(a, rows, value=0):
    return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=value)


@partial(jax.jit, static_argnames=("k", "n_cand", "query_block", "point_block", "group", "precision"))
def _search(x_NxD, xs_NxD, sq_N, scale2, rows_R, *, k, n_cand, query_block, point_block, group, precision):
    """Distances [R, k] of the rows `rows_R` (a multiple of query_block; >= N: padding) and
    whether each is certified (steps 1-4 of the docstring)."""
    n, d = x_NxD.shape
    bound = _bound(d, precision)
    n_pblocks = -(-n // point_block)
    p_CxPxD = _pad(xs_NxD, n_pblocks * point_block).reshape(n_pblocks, point_block, d)
    sel_CxP = _pad(sq_N - bound * sq_N, n_pblocks * point_block).reshape(n_pblocks, point_block)
    col_CxP = jnp.arange(n_pblocks * point_block, dtype=jnp.int32).reshape(n_pblocks, point_block)
    slack = 1 + 2 * (d + 4) * 2.0 ** -23  # the measurement's error, both ways

    def query_block_fn(row_B):
        safe_B = jnp.minimum(row_B, n - 1)
        q_BxD, qsq_B = xs_NxD[safe_B], sq_N[safe_B]

        def point_block_fn(carry, args):
            best_BxK, best_id_BxK = carry
            p_PxD, sel_P, col_P = args
            d2_BxP = qsq_B[:, None] + sel_P[None, :] - 2.0 * jnp.einsum(
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
        (best_BxK, id_BxK), _ = lax.scan(point_block_fn, init, (p_CxPxD, sel_CxP, col_CxP))
        diff_BxKxD = x_NxD[safe_B][:, None, :] - x_NxD[jnp.minimum(id_BxK, n - 1)]
        r2_BxK = jnp.where(jnp.isinf(best_BxK), jnp.inf, jnp.sum(diff_BxKxD * diff_BxKxD, axis=2))
        r2_Bxk = jnp.sort(r2_BxK, axis=1)[:, :k]
        floor_B = best_BxK[:, -1] - bound * qsq_B - 2.0 ** -100  # no point left out is nearer
        ok_B = (r2_Bxk[:, -1] * slack * scale2 <= floor_B) | (n_cand >= n - 1)
        return jnp.sqrt(r2_Bxk), ok_B

    dist_QxBxk, ok_QxB = lax.map(query_block_fn, rows_R.reshape(-1, query_block))
    return dist_QxBxk.reshape(-1, k), ok_QxB.reshape(-1)


@partial(jax.jit, static_argnames=("k", "query_block", "point_block"))
def _exhaustive(x_NxD, rows_R, *, k, query_block, point_block):
    """Distances [R, k] of the rows `rows_R`: the k smallest measured ||x_i - x_j|| of all points."""
    n, d = x_NxD.shape
    n_pblocks = -(-n // point_block)
    p_CxPxD = _pad(x_NxD, n_pblocks * point_block).reshape(n_pblocks, point_block, d)
    col_CxP = jnp.arange(n_pblocks * point_block, dtype=jnp.int32).reshape(n_pblocks, point_block)

    def query_block_fn(row_B):
        q_BxD = x_NxD[jnp.minimum(row_B, n - 1)]

        def point_block_fn(best_Bxk, args):
            p_PxD, col_P = args
            diff_BxPxD = q_BxD[:, None, :] - p_PxD[None, :, :]
            d2_BxP = jnp.sum(diff_BxPxD * diff_BxPxD, axis=2)
            d2_BxP = jnp.where((col_P[None, :] >= n) | (col_P[None, :] == row_B[:, None]), jnp.inf, d2_BxP)
            neg_Bxk, _ = lax.top_k(-jnp.concatenate([best_Bxk, d2_BxP], axis=1), k)
            return -neg_Bxk, None

        best_Bxk, _ = lax.scan(point_block_fn, jnp.full((query_block, k), jnp.inf, jnp.float32),
                               (p_CxPxD, col_CxP))
        return jnp.sqrt(best_Bxk)

    return lax.map(query_block_fn, rows_R.reshape(-1, query_block)).reshape(-1, k)


def _check_k(k, n: int, need: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < need:
        raise UserError(f"k must be an integer >= {need}, got {k!r}")
    if n <= k:
        raise UserError(f"need more than k = {k} points for k neighbours each, got N = {n}")


def knn_distances(X, k: int, *, query_block: int = QUERY_BLOCK, point_block: int = POINT_BLOCK,
                  fallback: list | None = None) -> np.ndarray:
    """Distances [N, k] (float64, ascending) from each point to its k nearest other points.
    fallback: a list that receives (rows searched again at HIGHEST, rows searched exhaustively)."""
    x_NxD = _as_points(X)
    n = x_NxD.shape[0]
    _check_k(k, n, 1)
    return _knn_checked(x_NxD, int(k), query_block, point_block, fallback)


def _blocks(rows: int, block: int, multiple: int) -> int:
    """Equal blocks of at most about `block` rows (a multiple of `multiple`), little padding."""
    return _round_up(-(-rows // -(-rows // block)), multiple)


def _knn_checked(x_NxD, k, query_block=QUERY_BLOCK, point_block=POINT_BLOCK, fallback=None) -> np.ndarray:
    n, d = x_NxD.shape
    xs_NxD, sq_N, scale2 = _prepare(x_NxD)
    p = _blocks(n, point_block, 128)
    dist_Nxk = np.empty((n, k), np.float32)
    todo = np.arange(n, dtype=np.int32)
    counts = []
    for precision, spare in ((_cheap_precision(x_NxD), SPARE), (lax.Precision.HIGHEST, 4 * SPARE)):
        if todo.size:
            n_cand = min(k + spare, n - 1)  # with n - 1 every other point is a candidate: exact
            group = 1
            while group < 128 and (2 * group) ** 2 * n_cand <= p:  # g ~ sqrt(P/K): both top_k small
                group *= 2
            # a re-search pads its rows to a power of two: few shapes to compile
            rows = todo.size if len(counts) == 0 else max(8, 1 << (todo.size - 1).bit_length())
            b = _blocks(rows, query_block, 8)
            rows_R = np.full(_round_up(rows, b), n, np.int32)
            rows_R[:todo.size] = todo
            dist, ok = jax.device_get(_search(x_NxD, xs_NxD, sq_N, scale2, jnp.asarray(rows_R), k=k,
                                              n_cand=n_cand, query_block=b, point_block=p, group=group,
                                              precision=precision))
            dist_Nxk[todo] = dist[:todo.size]
            todo = todo[~ok[:todo.size]]
        counts.append(int(todo.size))
    if todo.size:
        b = 8
        rows_R = np.full(_round_up(todo.size, b), n, np.int32)
        rows_R[:todo.size] = todo
        pe = _blocks(n, max(8, EXACT_BLOCK // (b * d)), 8)
        dist_Nxk[todo] = np.asarray(_exhaustive(x_NxD, jnp.asarray(rows_R), k=k, query_block=b,
                                                point_block=pe))[:todo.size]
    if fallback is not None:
        fallback.append(tuple(counts))
    return dist_Nxk.astype(np.float64)


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
