"""Float64 read-out of stats.Accumulators: each population's (a state over every source, and each source's) first
moments and floored spectra, which the registered measures read (stats.measures.population: the formulas are the
measures' own, stats/measures/, one file each), and metrics.json's layers around them.
Length: the second moments' read-out (their merge over the sources, the covariances, the batched reductions on the
devices, the threads that overlap them with the host) is one pipeline, read together.

Each double-float pair is summed as float64(hi) + float64(lo). Vectors (counts, sums) are read
out in numpy on the host. The second moments, the bulk of the work, are read out where they lie by
jitted float64 functions (jax.enable_x64): per state, groups combined with Chan's pairwise formula,
the uncentered Gram rebuilt, the covariances formed; then on an accelerator the eigenvalues of a
chunk of states' covariances at once: a batched Householder reduction to tridiagonal form
(stats/tridiagonal.py; cuSOLVER's sytrd takes one matrix at a time) and bisection of every
tridiagonal matrix in one call. jax's eigvalsh would also build the eigenvectors (it is eigh). On
the CPU the eigenvalues come from LAPACK's eigvalsh through numpy instead: XLA's bisection and its
compile are slower there (the same eigenvalues to ~1e-14 of the largest; tests/test_stats.py
compares with numpy's eigvalsh)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import eigh_tridiagonal
from jax.sharding import NamedSharding, PartitionSpec

from isojax.stats import accumulators as stats
from isojax.stats import geometry, measures, tridiagonal
from isojax.stats.accumulators import _COUNT_BITS, Accumulators, chan_term
from isojax.stats.measures import alpha_req, intra_sim
from isojax.stats.measures.anisotropy import top_share
from isojax.stats.measures.isoscore_star import ZETA as ISOSCORE_ZETA
from isojax.stats.sample_readout import _top_eigenvalue, sample_programs


def _f64(df):
    return np.asarray(df.hi, np.float64) + np.asarray(df.lo, np.float64)


def _combine_m2(n_G, sum_GxD, m2_GxDxD):
    """Per-group (n, Sum x, M2) merged into the whole population's M2, group by group."""
    n, s, m2 = n_G[0], sum_GxD[0], m2_GxDxD[0]
    for g in range(1, n_G.shape[0]):
        m2 = m2 + m2_GxDxD[g] + chan_term(n, s, n_G[g], sum_GxD[g])
        n, s = n + n_G[g], s + sum_GxD[g]
    return m2


def _covariances(n, sum_D, m2_DxD, unit_m2_DxD):
    """[3, D, D]: the covariance, the second moment (the uncentered Gram M2 + sum sum^T / n,
    exact in float64) and the unit vectors' covariance; and Sum |x|^2 / n."""
    gram_DxD = m2_DxD + jnp.outer(sum_D, sum_D) / jnp.maximum(n, 1)
    mats = jnp.stack([m2_DxD, gram_DxD, unit_m2_DxD]) / jnp.maximum(n, 1)
    return (mats + mats.swapaxes(1, 2)) / 2, jnp.trace(gram_DxD) / jnp.maximum(n, 1)


def _matrices(n, sum_D, m2_DxD, unit_m2_DxD):
    """(_covariances' [3, D, D] matrices, Sum |x|^2 / n, their [3, D] diagonals)."""
    mats, mean_sq_norm = _covariances(n, sum_D, m2_DxD, unit_m2_DxD)
    return mats, mean_sq_norm, jnp.diagonal(mats, axis1=1, axis2=2)


@jax.jit
def _bisect(diags: list, offs: list):
    """Eigenvalues, descending, [N, D], of the N symmetric tridiagonal matrices in diags ([..., D]
    arrays) and offs ([..., D-1]), by bisection. Its time is the latency of ~53 x D/16 loop steps,
    whatever N: all states go in one call (bench/RESULTS.md 8d)."""
    d = diags[0].shape[-1]
    diag_NxD = jnp.concatenate([x.reshape(-1, d) for x in diags])
    off_NxD = jnp.concatenate([x.reshape(-1, d - 1) for x in offs])
    return jax.vmap(lambda a, b: eigh_tridiagonal(a, b, eigvals_only=True))(diag_NxD, off_NxD)[:, ::-1]


def _bisect_states(reduced: list) -> list:
    """Per state, a read-out whose first element is a tridiagonal form, ([..., D] diagonals,
    [..., D-1] off-diagonals) (_reduce_chunk's) -> the same with the eigenvalues in its place, in
    host memory: one bisection of all their matrices."""
    parts = [r[0] for r in reduced]
    with jax.enable_x64(True):
        eig_NxD = np.asarray(_bisect([p[0] for p in parts], [p[1] for p in parts]))
    out, at = [], 0
    for p, r in zip(parts, reduced):
        k = int(np.prod(p[0].shape[:-1]))
        out.append((eig_NxD[at:at + k].reshape(p[0].shape), *map(np.asarray, r[1:])))
        at += k
    return out


READOUT_BYTES = 2 << 30  # the float64 matrices of one batched reduction (a chunk of states) at most (15c)


def chunk_states(matrices_per_state: int, d: int, num_states: int) -> int:
    """States per batched reduction: as many as fit READOUT_BYTES (at least one), spread evenly
    over the chunks (at most two chunk sizes to compile)."""
    most = max(1, READOUT_BYTES // (matrices_per_state * d * d * 8))
    chunks = -(-num_states // most)
    return -(-num_states // chunks)


@jax.jit
def _tridiagonal_forms(mats: list) -> list:
    """The tridiagonal forms ([..., D], [..., D-1]) of each [..., D, D] stack in mats, all of them
    reduced in one batch (stats/tridiagonal.py)."""
    d = mats[0].shape[-1]
    diag_BxD, off_BxD = tridiagonal.tridiagonalize(jnp.concatenate([m.reshape(-1, d, d) for m in mats]))
    out, at = [], 0
    for m in mats:
        k = int(np.prod(m.shape[:-2]))
        out.append((diag_BxD[at:at + k].reshape(*m.shape[:-1]), off_BxD[at:at + k].reshape(*m.shape[:-2], d - 1)))
        at += k
    return out


def _reduce_chunk(chunk: list, top_ratios: bool) -> list:
    """Read-outs whose first element is a [..., D, D] stack of matrices -> the same with their
    tridiagonal forms in its place (on the devices; one batched reduction); top_ratios: the second
    element a stack too, replaced by _top_ratios' (one batch)."""
    with jax.enable_x64(True):
        forms = _tridiagonal_forms([r[0] for r in chunk])
        ratios = _top_ratios([r[1] for r in chunk]) if top_ratios else [r[1] for r in chunk]
    return [(f, q, *r[2:]) for f, q, r in zip(forms, ratios, chunk)]


def _read_states(dispatch, num_states: int, on_cpu: bool, before_read=None, top_ratios: bool = False) -> list:
    """dispatch(s)'s read-out of every state (its first element a [..., D, D] stack of matrices),
    in host memory with the matrices' eigenvalues in their place (top_ratios: and the second
    element, a stack too, replaced by _top_ratios'). The CPU: LAPACK, dispatched one state ahead.
    Accelerators: a chunk of states (chunk_states) dispatched, their matrices reduced in one batch,
    then the next chunk; one bisection of all states at the end.
    before_read: called once the first two states are dispatched, before the first is read."""
    if on_cpu:
        reduced, ahead = [], dispatch(0)
        for s in range(num_states):
            current, ahead = ahead, dispatch(s + 1) if s + 1 < num_states else None
            if s == 0 and before_read is not None:
                before_read()
            if top_ratios:
                with jax.enable_x64(True):
                    current = (current[0], _top_ratios([current[1]])[0], *current[2:])
            reduced.append(_host_eigs(jax.device_get(current)))
        return reduced
    reduced, chunk, size = [], [], None
    for s in range(num_states):
        chunk.append(dispatch(s))
        if s == min(1, num_states - 1) and before_read is not None:
            before_read()
        if size is None:
            mats = chunk[0][0]
            size = chunk_states(int(np.prod(mats.shape[:-2])) * (2 if top_ratios else 1), mats.shape[-1], num_states)
        if len(chunk) == size or s == num_states - 1:
            reduced += _reduce_chunk(chunk, top_ratios)
            chunk = []
    return _bisect_states(reduced)


def _host_eigs(readout):
    """_whole_spectra's or _group_spectra's read-out with eigenvalues, descending, in
    place of its matrices, in host memory: LAPACK (numpy) on the CPU."""
    if readout is None:
        return None
    mats, *rest = readout
    return (np.linalg.eigvalsh(np.asarray(mats))[..., ::-1], *map(np.asarray, rest))


GROUP_LANCZOS_STEPS = 128  # 1e-15 of numpy's top eigenvalue on near-isotropic 2048-wide covariances


def _group_readout(n, sum_D, m2_DxD, unit_m2_DxD, c0_DxD, zeta):
    """One source's covariances read out for _population: the centered one whole (its spectrum gives
    the effective rank) and IsoScore*'s shrunk covariance (1 - zeta) C + zeta C0 (C the source's
    sample covariance, ddof = 1; C0 the layer's, c0_DxD), both as matrices ([2, D, D]) whose spectra
    _read_states takes; the second moment and the unit vectors' covariance ([2, D, D]), of which
    _read_states(top_ratios=True) takes only sigma_1^2 / sum sigma^2, by Lanczos (bench/RESULTS.md
    8e); Sum |x|^2 / n; and the [3, D] diagonals of the three matrices."""
    mats, mean_sq_norm = _covariances(n, sum_D, m2_DxD, unit_m2_DxD)
    diag_3xD = jnp.diagonal(mats, axis1=1, axis2=2)
    shrunk = (1.0 - zeta) * mats[0] * (n / jnp.maximum(n - 1.0, 1.0)) + zeta * c0_DxD
    return jnp.stack([mats[0], shrunk]), mats[1:], mean_sq_norm, diag_3xD


@jax.jit
def _top_ratios(mats: list) -> list:
    """sigma_1^2 / sum sigma^2 (NaN where the trace is 0) of each matrix of each [..., D, D] stack in
    mats, by Lanczos (_top_eigenvalue, GROUP_LANCZOS_STEPS), all of them side by side: their steps
    are latency, not work."""
    d = mats[0].shape[-1]
    a_BxDxD = jnp.concatenate([m.reshape(-1, d, d) for m in mats])
    top_B = jax.vmap(lambda a: _top_eigenvalue(a, GROUP_LANCZOS_STEPS))(a_BxDxD)
    trace_B = jnp.trace(a_BxDxD, axis1=1, axis2=2)
    ratio_B = jnp.where(trace_B > 0, top_B / jnp.where(trace_B > 0, trace_B, 1.0), jnp.nan)
    out, at = [], 0
    for m in mats:
        k = int(np.prod(m.shape[:-2]))
        out.append(ratio_B[at:at + k].reshape(m.shape[:-2]))
        at += k
    return out


def _float64_m2(m2, unit_m2):
    return m2.hi.astype(jnp.float64) + m2.lo.astype(jnp.float64), \
        unit_m2.hi.astype(jnp.float64) + unit_m2.lo.astype(jnp.float64)


@functools.partial(jax.jit, static_argnames=("per_group",))
def _whole_spectra(n_G, sum_GxD, unit_sum_GxD, m2, unit_m2, per_group: bool):
    """One state's covariances of the whole population (all groups together; per_group: m2 holds
    each group's, combined here); call under jax.enable_x64. m2, unit_m2: stats.DFPair of [H, D, D]
    float32 pairs. Returns _matrices' read-out, whose matrices _read_states reduces (on the CPU,
    LAPACK beats XLA's reduction, bisection and their compile; on accelerators the host's dsterf of
    the tridiagonals is the slower path, bench/RESULTS.md 8c)."""
    m2_HxDxD, unit_m2_HxDxD = _float64_m2(m2, unit_m2)
    if per_group:
        whole = (_combine_m2(n_G, sum_GxD, m2_HxDxD), _combine_m2(n_G, unit_sum_GxD, unit_m2_HxDxD))
    else:
        whole = (m2_HxDxD[0], unit_m2_HxDxD[0])
    return _matrices(n_G.sum(), sum_GxD.sum(0), *whole)


@jax.jit
def _group_spectra(n_G, sum_GxD, unit_sum_GxD, m2, unit_m2, zeta):
    """One state's covariances of each group (_group_readout), m2 holding each group's
    (_whole_spectra for the arguments; zeta: IsoScore*'s shrinkage toward the layer's covariance).
    Apart from _whole_spectra, so that the whole population's metrics, figures and files are ready
    while the devices reduce these (bench/RESULTS.md 8e)."""
    m2_HxDxD, unit_m2_HxDxD = _float64_m2(m2, unit_m2)
    c0 = _combine_m2(n_G, sum_GxD, m2_HxDxD) / jnp.maximum(n_G.sum() - 1.0, 1.0)
    c0 = (c0 + c0.T) / 2
    return jax.vmap(_group_readout, in_axes=(0, 0, 0, 0, None, None))(
        n_G, sum_GxD, m2_HxDxD, unit_m2_HxDxD, c0, zeta)


def _whole_readout(eigs):
    """A whole population's ([3, D] eigenvalues, Sum |x|^2 / n, [3, D] diagonals) as _population takes it."""
    (centered_D, uncentered_D, unit_D), mean_sq_norm, diag_3xD = eigs
    return centered_D, top_share(uncentered_D), top_share(unit_D), mean_sq_norm, diag_3xD


def _population(n, sum_D, unit_sum_D, norm_sum, readout=None, zeta: float = ISOSCORE_ZETA,
                bf16: bool = False, unit_D=None, shrunk_D=None, uncentered_D=None) -> dict:
    """The registered moments and spectral measures' metrics of one population (stats.measures.population);
    readout: (the centered covariance's eigenvalues, descending, the top share of the second moment's and of
    the unit vectors' covariance's trace, Sum |x|^2 / n, the [3, D] diagonals of _covariances' matrices)
    (_whole_readout, or a group's part of _bisect_states or _host_eigs), or None (no second moments kept for
    it: no spectral measure). zeta: IsoScore*'s shrinkage. bf16: the states were bfloat16
    (geometry.spectral_floor). unit_D: the unit vectors' covariance eigenvalues (None: not read out, a
    source's); uncentered_D: the second moment's (None: not read out). shrunk_D: the eigenvalues of a source's
    IsoScore* covariance (1 - zeta) C + zeta C0 (_group_readout); None: the population is the layer, C0 = C.
    Each spectrum is floored (geometry.spectral_floor) before the measures read it."""
    moments = measures.Moments(int(n), sum_D, unit_sum_D, norm_sum)
    if readout is None or not n:
        return measures.population(moments, None)
    centered_D, top_uncentered, top_unit, mean_sq_norm, diag_3xD = readout
    diag_3xD = np.asarray(diag_3xD)
    # bf16 states: the floor scales with the largest mean square of a coordinate (spectral_floor)
    mean_sq = float(diag_3xD[1].max()) if bf16 else None
    unit_mean_sq = float((diag_3xD[2] + (unit_sum_D / n) ** 2).max()) if bf16 else None
    floored = lambda eig_D, scale: None if eig_D is None else geometry.floored(
        eig_D, geometry.spectral_floor(eig_D, scale))
    spectra = measures.Spectra(
        int(n), floored(centered_D, mean_sq), floored(uncentered_D, mean_sq), floored(unit_D, unit_mean_sq),
        centered_raw=np.asarray(centered_D), top_share_uncentered=float(top_uncentered),
        top_share_unit=float(top_unit), mean_sq_norm=float(mean_sq_norm), second_moment_diag_D=diag_3xD[1],
        unit_cov_diag_D=diag_3xD[2], unit_sum_D=unit_sum_D, shrunk=floored(shrunk_D, mean_sq), zeta=zeta)
    return measures.population(moments, spectra)


# the metrics whose null _log_nulls names, and why (others are null by design where they are: erank_pooled of a
# source, a measure of a population without second moments of its own)
_LOGGED_NULLS = ("isoscore", "isoscore_star", "alpha_req", "rogue_dims", "rogue_share_top3", "feature_kurtosis")


def _log_nulls(what: str, out: dict) -> None:
    """One log line naming the geometry measures that are null for a population, and why."""
    from isojax.log import log
    nulls = [k for k in _LOGGED_NULLS if k in out and out[k] is None]
    if nulls == ["alpha_req"] and out["count"] >= 2:
        lo, hi = alpha_req.RANKS
        log(f"alpha_req of {what}: null (fewer than 2 of its fit ranks {lo} to {hi} above the spectral floor)")
    elif nulls:
        why = "fewer than 2 tokens" if out["count"] < 2 else "its states do not vary (or InterSim is 0)"
        log(f"{', '.join(nulls)} of {what}: null ({why})")


def _state_m2(x_HxSxDxDx2, s: int):
    """State s of second moments: [H, D, D, 2] on one local device (or numpy). Split over several
    devices (runner.Runner.merged_layers, rows over "model"), the devices gather one state."""
    if not isinstance(x_HxSxDxDx2, jax.Array) or len(x_HxSxDxDx2.sharding.device_set) == 1:
        return x_HxSxDxDx2[:, s]
    return _gather_state(x_HxSxDxDx2.sharding.mesh)(x_HxSxDxDx2, np.int32(s)).addressable_shards[0].data


@functools.cache
def _gather_state(mesh):
    take = lambda x, s: jax.lax.dynamic_index_in_dim(x, s, 1, keepdims=False)
    return jax.jit(take, out_shardings=NamedSharding(mesh, PartitionSpec()))


@functools.cache  # once per shape in a process: a sweep's later checkpoints find them in jit's own cache
def compile_ahead(m2_HxSxDxD_shape: tuple, num_groups: int, sample_count: int, device,
                  extra: tuple[str, ...] = ()) -> None:
    """Compile the float64 read-outs that finalize and sample_metrics run on accelerators, for
    second moments of [H, S, D, D] and num_groups groups read out on `device` (committed there with
    its SingleDeviceSharding: runner.Runner.merged_layers, .sample), from shapes alone: run in a
    background thread while the devices measure, so that a first run's read-outs do not compile
    after the loop (jit reuses these executables)."""
    h, s, _, d = m2_HxSxDxD_shape
    per_group = h == num_groups and num_groups > 1
    on = jax.sharding.SingleDeviceSharding(device)  # the arrays finalize passes are committed there
    f64 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float64)  # numpy, on the host
    f64_on = lambda *shape: jax.ShapeDtypeStruct(shape, np.float64, sharding=on)
    pair = stats.DFPair(jax.ShapeDtypeStruct((h, d, d, 2), np.float32, sharding=on))
    args = (f64(num_groups), f64(num_groups, d), f64(num_groups, d), pair, pair)
    programs = [lambda: _whole_spectra.lower(*args, per_group=per_group)]
    if per_group:
        programs.append(lambda: _group_spectra.lower(*args, f64()))
    # _read_states' calls: the chunks' batched reductions, then one bisection of every state's
    # whole population, then of every state's groups
    for per_state, ratios in [((3,), 1)] + ([((num_groups, 2), 2)] if per_group else []):
        size = chunk_states(int(np.prod(per_state)) * ratios, d, s)
        for k in {size, s - size * (-(-s // size) - 1)}:
            chunk = [f64_on(*per_state, d, d)] * k
            programs.append(lambda chunk=chunk: _tridiagonal_forms.lower(chunk))
            if ratios == 2:  # the groups' read-out: _top_ratios of their other two matrices
                programs.append(lambda chunk=chunk: _top_ratios.lower(chunk))
        diagonals = ([f64_on(*per_state, d)] * s, [f64_on(*per_state, d - 1)] * s)
        programs.append(lambda diagonals=diagonals: _bisect.lower(*diagonals))
    if sample_count:
        programs += sample_programs(sample_count, d, s, on, extra)  # extra: --measure's

    with jax.enable_x64(True):  # one after another: on 2 or 4 threads a cached 410m run's first loop was slower
        for lower in programs:  # (7.7-8.1 s against 7.0-7.5; bench/RESULTS.md 15d), its finalize no faster
            lower().compile()


def finalize(acc: Accumulators, state_names: list[str],
             group_names: list[str] | None = None, token=None, isoscore_zeta: float = ISOSCORE_ZETA,
             bf16: bool = False) -> dict:
    """finalize_whole's metrics with their "groups" filled in (finalize_whole for what they are)."""
    result, finish_groups = finalize_whole(acc, state_names, group_names, token, isoscore_zeta, bf16)
    if finish_groups is not None:
        finish_groups()
    return result


def finalize_whole(acc: Accumulators, state_names: list[str], group_names: list[str] | None = None, token=None,
                   isoscore_zeta: float = ISOSCORE_ZETA, bf16: bool = False) -> tuple[dict, object]:
    """Metrics of all states: {"layers": [...], "groups": {...}, "token": {...},
    "spectra": {...}}. "layers" combines all groups; "groups" (only with group_names) holds
    per-source results without per-token fields. Spectra are eigenvalues of the covariance
    (Sum (x-mean)(x-mean)^T / n), of the second moment (Sum x x^T / n), and of the
    covariance of unit vectors, each in descending order. `token`: (count_V, intra_sim_SxV)
    when already read out (runner.Runner.token_readout); else taken from acc. The second
    moments may be device arrays (runner.Runner.merged_layers): they are read out there.
    isoscore_zeta: IsoScore*'s shrinkage (stats/measures/isoscore_star.py). bf16: the states were bfloat16
    (the spectral floor, geometry.spectral_floor).

    Returns (metrics, finish_groups): with group_names, metrics["groups"] is an empty dict that
    finish_groups() fills in: it dispatches the groups' reductions to the devices (two Householder
    reductions per source and state, its covariance's and IsoScore*'s: seconds at 8 sources,
    bench/RESULTS.md 8e for one) and reads them out;
    run on a thread, the host meanwhile draws and writes what needs only the whole population
    (run/results.py). None without group_names, or where the second moments are split over
    devices: then the groups are read out here (their gathers in this thread's order)."""
    m2_HxSxDxD, unit_m2_HxSxDxD = acc.m2_HxSxDxD, acc.unit_m2_HxSxDxD
    acc = jax.device_get(acc.replace(m2_HxSxDxD=None, unit_m2_HxSxDxD=None))
    n_GxS = (np.asarray(acc.count_hi_GxS, np.int64) << _COUNT_BITS) + np.asarray(
        acc.count_lo_GxS, np.int64)
    num_groups, num_states = n_GxS.shape
    if len(state_names) != num_states:
        raise ValueError(f"{len(state_names)} state names for {num_states} states")
    if group_names is not None and len(group_names) != num_groups:
        raise ValueError(f"{len(group_names)} group names for {num_groups} groups")
    sum_GxSxD, unit_sum_GxSxD = _f64(acc.sum_GxSxD), _f64(acc.unit_sum_GxSxD)
    norm_GxS = _f64(acc.norm_sum_GxS)
    per_group_m2 = m2_HxSxDxD.hi.shape[0] == num_groups and num_groups > 1
    if token is None:
        token = intra_sim.host_readout(acc)
    if token is not None:  # a mean cosine is at most 1; rounding can pass it by ~1e-8 (identical vectors)
        token = (token[0], np.minimum(token[1], 1.0))
    token_stats = token is not None

    layers, spectra = [], {"centered_SxD": [], "uncentered_SxD": [], "unit_SxD": []}
    on_cpu = jax.default_backend() == "cpu"

    def state_args(s):
        return (n_GxS[:, s].astype(np.float64), sum_GxSxD[:, s], unit_sum_GxSxD[:, s],
                jax.tree.map(lambda x: _state_m2(x, s), m2_HxSxDxD),
                jax.tree.map(lambda x: _state_m2(x, s), unit_m2_HxSxDxD))

    def dispatch(s):
        with jax.enable_x64(True):
            return _whole_spectra(*state_args(s), per_group=per_group_m2)

    reduced = _read_states(dispatch, num_states, on_cpu)
    for s, name in enumerate(state_names):
        n_G = n_GxS[:, s]
        whole = reduced[s]
        out = _population(n_G.sum(), sum_GxSxD[:, s].sum(0), unit_sum_GxSxD[:, s].sum(0), norm_GxS[:, s].sum(),
                          _whole_readout(whole) if n_G.sum() else None, isoscore_zeta, bf16,
                          unit_D=whole[0][2] if n_G.sum() else None,
                          uncentered_D=whole[0][1] if n_G.sum() else None)
        _log_nulls(name, out)
        layer = {"name": name, **out}
        for key, eig in zip(spectra, whole[0] if n_G.sum() else (None,) * 3):
            spectra[key].append(eig)
        if token_stats:  # else null (below): the keys are part of the output contract; null says "not measured"
            layer.update(intra_sim.layer_metrics(token[0], token[1][s]))
        layers.append(layer)

    for layer in layers:  # massive_*, inter_sim_by_position: read out by run.measure, here null (their place)
        layer.update(measures.default_step_nulls())
    for layer in layers:  # the contract's keys, null until measured (a sample: run.measure)
        for key in ("anisotropy_batch_mean", "anisotropy_batch_std", "inter_sim_standardized",
                    "sample_abs_median", "massive_max_over_sample_median"):
            layer.setdefault(key, None)
        for key, null in measures.nulls().items():  # a dict-valued one: {key: null}
            layer.setdefault(key, null)
    result = {"layers": layers}
    if all(e is not None for e in spectra["centered_SxD"]):
        result["spectra"] = {k: np.stack(v) for k, v in spectra.items()}
    if token_stats:
        result["token"] = {"count_V": token[0], "intra_sim_SxV": token[1]}
    if group_names is None:
        return result, None
    result["groups"] = {}

    def dispatch_groups(s):
        if s in dispatched:
            return dispatched.pop(s)
        with jax.enable_x64(True):
            return _group_spectra(*state_args(s), np.float64(isoscore_zeta))

    # the first two states' reductions traced and dispatched here, the rest one ahead by finish_groups
    dispatched = {}
    for s in range(min(2, num_states) if per_group_m2 else 0):
        dispatched[s] = dispatch_groups(s)

    def finish_groups():  # where the second moments are split over devices, not on a thread: see below
        from isojax import faults
        eigs_GxS = [[None] * num_states for _ in range(num_groups)]  # groups with their own second moments
        shrunk_GxS = [[None] * num_states for _ in range(num_groups)]  # their IsoScore* covariances' eigenvalues
        if per_group_m2:
            groups_S = _read_states(dispatch_groups, num_states, on_cpu, top_ratios=True,
                                    before_read=lambda: faults.reached("sources_readout"))
            for s, groups in enumerate(groups_S):
                for g in range(num_groups):
                    eigs_GxS[g][s] = (groups[0][g][0], *groups[1][g], groups[2][g], groups[3][g])
                    shrunk_GxS[g][s] = groups[0][g][1]
        elif num_groups == 1:
            faults.reached("sources_readout")
            eigs_GxS[0] = [_whole_readout(whole) for whole in reduced]
        by_name = {}
        for g, gname in enumerate(group_names):
            glayers = []
            for s, name in enumerate(state_names):
                out = _population(n_GxS[g, s], sum_GxSxD[g, s], unit_sum_GxSxD[g, s], norm_GxS[g, s],
                                  eigs_GxS[g][s], isoscore_zeta, bf16, shrunk_D=shrunk_GxS[g][s])
                _log_nulls(f"{name} in {gname}", out)
                glayers.append({"name": name, **out})
            by_name[gname] = {"tokens": int(n_GxS[g, 0]), "layers": glayers}
        result["groups"].update(by_name)

    # a gather over devices from a thread could meet another thread's programs in another order
    if any(len(x.sharding.device_set) > 1 for x in (m2_HxSxDxD.hl, unit_m2_HxSxDxD.hl) if isinstance(x, jax.Array)):
        finish_groups()
        return result, None
    return result, finish_groups
