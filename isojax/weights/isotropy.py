"""Isotropy of a weight matrix W [n rows, d columns] and of a final LayerNorm, in float64 numpy.

Partition-function isotropy (Arora et al. 2016; Machina & Mercer eq. 3-4; Bis et al. eq. 7-8):

    Z(c) = sum_i exp(<c, W_i>),   I(W) = min_c Z(c) / max_c Z(c)

with c over the d eigenvectors of W^T W **and their negations** (2d candidates): an
eigensolver's sign choice is arbitrary, so the one-sided version is not reproducible; with
both signs it is. log Z is a log-sum-exp in float64 and I = exp(min log Z - max log Z).

`isotropy_one_sided` is the published definition (d candidates, one sign per eigenvector)
with a fixed sign rule instead of the solver's: each eigenvector c_k is oriented so that
<c_k, mu> > 0, mu the mean row of W (the direction the rows drift in). The rule is
geometric: the value does not change when W is rotated (W Q, Q orthogonal) or negated
(-W has mean -mu, so every c_k flips and Z(c_k) stays). Where mu gives no direction,
|<c_k, mu>| <= 1e-9 * mean row norm (a centered matrix; c_k orthogonal to mu), the largest-
magnitude component of c_k is made positive (sklearn's `svd_flip`; the first such
component on a tie), which depends on the coordinate axes. The two-sided I(W) is never
above a one-sided value, whatever its signs.

Variants of W (each measured with the eigenvectors of its own Gram matrix):

- centered:   W~ = W - mu, mu the mean row (Bis et al. eq. 9).
- pc_removed: W^ = W~ minus its projection on the top D = ceil(d/100) principal components
  of W~ (eq. 10-11, projections of the *centered* rows). W^T W^ has the eigenvectors of
  W~^T W~ with the top D eigenvalues set to 0, so Z over those D directions is exactly n and
  the others equal the centered Z: no extra eigendecomposition.
- scaled_centered: W'_i = W_i - |W_i| mu^, mu^ = mean of the unit rows (Bis et al. §5.2,
  "scaled centering"). A zero row has no direction; it adds 0 to mu^.

Cost for n x d: one float64 pass for the Gram matrix and row sums (n d^2, BLAS syrk), three
d x d eigendecompositions (uncentered, centered, scaled), and one pass of three n x d x d
products with streamed log-sum-exp. Everything stays float64; bench/bench_weights.py times it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np

from isojax.hf.files import RowBlocks
from threadpoolctl import threadpool_limits

OUTLIER_STD = 3.0
_BLOCK_BYTES = 64 << 20  # float64 work per row block of a projection
_SINGLE_THREAD_BELOW_D = 1024
_SIGN_TOL = 1e-9  # |<c, mu>| below this times the mean row norm: mu gives c no direction


@contextlib.contextmanager
def blas_threads(n: int | None):
    """Run the block with at most n threads in every loaded BLAS (None: unchanged)."""
    if not n:
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield


def _blas_threads_for(d: int):
    # LAPACK's eigh of a few-hundred-square matrix ran 100x slower with 2 OpenBLAS threads
    # than with 1 on a shared 2-core machine (thread hand-offs); big d needs every core.
    return blas_threads(1 if d < _SINGLE_THREAD_BELOW_D else None)


def _block_rows(d: int) -> int:
    return max(256, _BLOCK_BYTES // (8 * max(d, 1)))


def _as_matrix(W):
    if not isinstance(W, (np.ndarray, RowBlocks)):
        W = np.asarray(W)
    if len(W.shape) != 2 or W.shape[0] < 1 or W.shape[1] < 1:
        raise ValueError(f"expected a non-empty 2-D matrix, got shape {tuple(W.shape)}")
    return W


@dataclasses.dataclass(frozen=True)
class _Stats:
    """One pass over W: everything the three Gram matrices need."""
    gram_DxD: np.ndarray      # W^T W
    sum_D: np.ndarray         # sum of rows
    norms_N: np.ndarray       # row norms
    wr_D: np.ndarray          # W^T |W_i|  (for the scaled-centered Gram)
    unit_sum_D: np.ndarray    # sum of unit rows


def _stats(W_NxD: np.ndarray) -> _Stats:
    n, d = W_NxD.shape
    G = np.zeros((d, d))
    s, wr, us = np.zeros(d), np.zeros(d), np.zeros(d)
    norms = np.empty(n)
    step = _block_rows(d)
    for a in range(0, n, step):
        Wb = np.asarray(W_NxD[a:a + step], dtype=np.float64)
        G += Wb.T @ Wb  # syrk
        r = np.sqrt(np.einsum("nd,nd->n", Wb, Wb))
        norms[a:a + len(Wb)] = r
        s += Wb.sum(0)
        wr += r @ Wb
        us += np.divide(1.0, r, out=np.zeros_like(r), where=r > 0) @ Wb
    G = (G + G.T) / 2
    return _Stats(G, s, norms, wr, us)


class _LogSumExp:
    """Running log sum_i exp(x_i) down the rows of successive blocks, per column."""

    def __init__(self, k: int):
        self.m = np.full(k, -np.inf)
        self.s = np.zeros(k)

    def add(self, P_BxK: np.ndarray, buf: np.ndarray) -> None:
        m = np.maximum(self.m, P_BxK.max(0))
        np.subtract(P_BxK, m, out=buf)
        np.exp(buf, out=buf)
        self.s = self.s * np.exp(self.m - m) + buf.sum(0)
        self.m = m

    def value(self) -> np.ndarray:
        return self.m + np.log(self.s)


def _eigh_desc(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and eigenvectors (columns) of a symmetric matrix."""
    w, V = np.linalg.eigh(G)
    return w[::-1].copy(), np.ascontiguousarray(V[:, ::-1])


def _lap(timings: dict | None, name: str, t0: float) -> float:
    t = time.perf_counter()
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + t - t0
    return t


def _isotropy_from_logz(logz: np.ndarray) -> float:
    return float(math.exp(logz.min() - logz.max()))


@dataclasses.dataclass(frozen=True)
class MatrixReport:
    """All matrix metrics of one W; `metrics` is the JSON part (DESIGN.md contract M)."""
    metrics: dict
    singular_values: np.ndarray           # sigma_k / sigma_1 of W, descending
    singular_values_centered: np.ndarray  # the same for W - mu
    proj2d: np.ndarray                    # [n, 2] W onto its top-2 right singular vectors
    proj2d_centered: np.ndarray           # [n, 2] the same for W - mu


def analyze_matrix(W_NxD, *, variants=("uncentered", "centered", "scaled_centered"),
                   timings: dict | None = None) -> MatrixReport:
    """Every matrix metric of W (any real dtype; an array, a memory map or `RowBlocks`), in
    float64. Raises ValueError when W is not a non-empty 2-D matrix of finite values.

    `timings`, when given, receives the seconds spent in each phase (for bench/).
    """
    W_NxD = _as_matrix(W_NxD)
    with _blas_threads_for(W_NxD.shape[1]):
        return _analyze(W_NxD, variants, timings)


def _analyze(W_NxD: np.ndarray, variants, timings: dict | None) -> MatrixReport:
    n, d = W_NxD.shape
    t = time.perf_counter()
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite input: refused just below
        st = _stats(W_NxD)
    t = _lap(timings, "gram_pass", t)
    # a NaN or inf anywhere reaches its column's sum and the Gram matrix (eigh would fail)
    if not (np.isfinite(st.sum_D).all() and np.isfinite(st.gram_DxD).all()):
        raise ValueError("the matrix holds NaN or infinite values, or values too large to square")
    mu = st.sum_D / n
    mu_hat = st.unit_sum_D / n
    grams = {"uncentered": st.gram_DxD,
             "centered": st.gram_DxD - n * np.outer(mu, mu)}
    # (W - r mu^T)^T (W - r mu^T) = G - mu^ a^T - a mu^^T + (r.r) mu^ mu^^T, a = W^T r
    scaled = st.gram_DxD - np.outer(mu_hat, st.wr_D) - np.outer(st.wr_D, mu_hat) \
        + (st.norms_N @ st.norms_N) * np.outer(mu_hat, mu_hat)
    grams["scaled_centered"] = scaled
    need = set(variants) | {"uncentered", "centered"}
    eig = {}
    for v in need:
        eig[v] = _eigh_desc((grams[v] + grams[v].T) / 2)
        t = _lap(timings, f"eigh_{v}", t)

    # One pass: P = (W - offset) @ V for each variant, streamed log-sum-exp of +P and -P.
    offsets = {"uncentered": lambda Wb, rows: Wb,
               "centered": lambda Wb, rows: Wb - mu,
               "scaled_centered": lambda Wb, rows: Wb - np.outer(st.norms_N[rows], mu_hat)}
    lse = {v: (_LogSumExp(d), _LogSumExp(d)) for v in need}
    proj = {v: np.empty((n, min(2, d))) for v in ("uncentered", "centered")}
    step = _block_rows(d)
    P = np.empty((step, d))
    buf = np.empty((step, d))
    for a in range(0, n, step):
        Wb = np.asarray(W_NxD[a:a + step], dtype=np.float64)
        rows = slice(a, a + len(Wb))
        for v in need:
            Pb, bb = P[:len(Wb)], buf[:len(Wb)]
            np.matmul(offsets[v](Wb, rows), eig[v][1], out=Pb)
            if v in proj:
                proj[v][rows] = Pb[:, :2]
            lse[v][0].add(Pb, bb)
            np.negative(Pb, out=Pb)
            lse[v][1].add(Pb, bb)
    t = _lap(timings, "projection_pass", t)
    logz = {v: np.concatenate([lse[v][0].value(), lse[v][1].value()]) for v in need}

    D = math.ceil(d / 100)
    keep = np.r_[np.arange(D, d), np.arange(d + D, 2 * d)]
    logz_pc = np.concatenate([logz["centered"][keep], np.full(2 * D, math.log(n))])
    mean_norm = float(st.norms_N.mean())
    mean_vec_norm = float(np.linalg.norm(mu))
    top = eig["uncentered"][1][:, 0]
    plus = one_sided_signs(eig["uncentered"][1], mu, mean_norm) > 0
    logz_one = np.where(plus, logz["uncentered"][:d], logz["uncentered"][d:])
    m = {
        "isotropy": _isotropy_from_logz(logz["uncentered"]),
        "isotropy_one_sided": _isotropy_from_logz(logz_one),
        "isotropy_centered": _isotropy_from_logz(logz["centered"]),
        "isotropy_pc_removed": _isotropy_from_logz(logz_pc),
        "mean_norm": mean_norm,
        "mean_vector_norm": mean_vec_norm,
        "mean_vector_norm_ratio": mean_vec_norm / mean_norm if mean_norm > 0 else None,
        "pc_removed_D": D,
        "rows": n,
        "dim": d,
        "log_z_min": float(logz["uncentered"].min()),
        "log_z_max": float(logz["uncentered"].max()),
        "top_eigvec_mean_cos": float(abs(top @ mu) / mean_vec_norm) if mean_vec_norm > 0 else None,
    }
    if "scaled_centered" in need:
        m["isotropy_scaled_centered"] = _isotropy_from_logz(logz["scaled_centered"])

    def sv(w):
        s = np.sqrt(np.clip(w, 0, None))
        return s / s[0] if s[0] > 0 else s

    return MatrixReport(m, sv(eig["uncentered"][0]), sv(eig["centered"][0]),
                        proj["uncentered"], proj["centered"])


def one_sided_signs(V_DxK: np.ndarray, mu_D: np.ndarray, scale: float) -> np.ndarray:
    """+-1 per column c of V: the sign that makes <c, mu> > 0, or, where |<c, mu>| <=
    1e-9 * scale (mu gives no direction), the one that makes c's largest-magnitude
    component positive (module docstring)."""
    dots = mu_D @ V_DxK
    big = np.argmax(np.abs(V_DxK), axis=0)
    flip = np.sign(V_DxK[big, np.arange(V_DxK.shape[1])])
    signs = np.where(np.abs(dots) > _SIGN_TOL * scale, np.sign(dots), flip)
    return np.where(signs == 0, 1.0, signs)


def isotropy(W) -> float:
    """I(W) over the +-eigenvectors of W^T W."""
    return analyze_matrix(W, variants=("uncentered",)).metrics["isotropy"]


def isotropy_one_sided(W) -> float:
    """I(W) over the eigenvectors of W^T W, each with the sign of the module's rule."""
    return analyze_matrix(W, variants=("uncentered",)).metrics["isotropy_one_sided"]


def isotropy_centered(W) -> float:
    return analyze_matrix(W, variants=("centered",)).metrics["isotropy_centered"]


def isotropy_pc_removed(W) -> float:
    return analyze_matrix(W, variants=("centered",)).metrics["isotropy_pc_removed"]


def isotropy_scaled_centered(W) -> float:
    return analyze_matrix(W, variants=("scaled_centered",)).metrics["isotropy_scaled_centered"]


def mean_norm(W) -> float:
    return float(np.linalg.norm(np.asarray(W, dtype=np.float64), axis=1).mean())


def mean_vector_norm(W) -> float:
    return float(np.linalg.norm(np.asarray(W, dtype=np.float64).mean(0)))


def _outliers(v: np.ndarray) -> list[int]:
    sd = v.std()
    return [] if sd == 0 else [int(i) for i in np.flatnonzero(np.abs(v - v.mean()) > OUTLIER_STD * sd)]


NORM_KEYS = ("dim", "avgnorm_g", "avgnorm_b", "norm_g", "norm_b", "b_over_g", "outlier_dims_g", "outlier_dims_b",
             "gao_sum", "b_parallel", "b_parallel_norm", "b_perp_norm", "b_perp_over_g")


def layer_norm_metrics(g, b=None) -> dict:
    """Final LayerNorm y = g * (x - m)/s + b (Machina & Mercer §4.3, §5.3); `NORM_KEYS`.

    avgnorm(v) = |v|/sqrt(d) (eq. 8); gao_sum = sum b_i/g_i (eq. 9; None when some g_i = 0);
    b split into its parts parallel and perpendicular to g' = (1/g_1, ..., 1/g_d), the normal
    of the hyperplane the LayerNorm maps into; outlier dimensions: entries more than
    3 standard deviations from the mean of g (or of b). b None (a norm without a bias, such as
    an RMSNorm): every statistic that needs b is None.
    """
    g = np.asarray(g, dtype=np.float64).ravel()
    b = None if b is None else np.asarray(b, dtype=np.float64).ravel()
    if g.size == 0 or b is not None and b.shape != g.shape:
        raise ValueError(f"g and b must be non-empty vectors of one length, got {g.shape}, {np.shape(b)}")
    d = g.size
    gn = float(np.linalg.norm(g))
    out = dict.fromkeys(NORM_KEYS)
    out.update(dim=d, avgnorm_g=gn / math.sqrt(d), norm_g=gn, outlier_dims_g=_outliers(g))
    if b is None:
        return out
    bn = float(np.linalg.norm(b))
    out.update(avgnorm_b=bn / math.sqrt(d), norm_b=bn, b_over_g=bn / gn if gn > 0 else None,
               outlier_dims_b=_outliers(b))
    if np.all(g != 0):
        gp = 1.0 / g
        u = gp / np.linalg.norm(gp)
        par = float(b @ u)
        perp = float(np.linalg.norm(b - par * u))
        out.update(gao_sum=float(np.sum(b / g)), b_parallel=par, b_parallel_norm=abs(par),
                   b_perp_norm=perp, b_perp_over_g=perp / gn)
    return out
