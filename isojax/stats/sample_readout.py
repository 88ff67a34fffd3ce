"""Float64 read-outs of the sample (stats/sample.py: the same K uniformly sampled tokens at every
state, [K, D] each, where they lie): The Shape of Learning's anisotropy over batches, the median
|x| and standardized InterSim, the registered sample and pairs measures (isojax.stats.measures),
and linear CKA between every pair of states. On accelerators, a chunk of states per program and
every state dispatched before any is read (bench/RESULTS.md 15c).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import eigh_tridiagonal

from isojax.errors import UserError
from isojax.stats import geometry, measures


BATCH = 4096  # tokens per batch of The Shape of Learning's anisotropy
LANCZOS_STEPS = 64


def _top_eigenvalue(a_MxM, steps: int = LANCZOS_STEPS):
    """Largest eigenvalue of a symmetric PSD matrix: Lanczos with full reorthogonalization in
    float64, min(M, steps) steps from a fixed start. Exact to ~1e-11 relative even for the Gram of
    an isotropic 4096 x 2048 batch (tests/test_sample.py against numpy's SVD), at a fraction of a
    full eigendecomposition's cost per batch."""
    d = a_MxM.shape[0]
    m = min(d, steps)
    q = jnp.ones(d, a_MxM.dtype) / jnp.sqrt(d) + 1e-3 * jnp.sin(jnp.arange(d, dtype=a_MxM.dtype))
    q = q / jnp.linalg.norm(q)

    def step(j, carry):
        Q_DxK, alpha_K, beta_K = carry
        w = a_MxM @ Q_DxK[:, j]
        alpha = w @ Q_DxK[:, j]
        w = w - Q_DxK @ (Q_DxK.T @ w)  # full reorthogonalization, twice
        w = w - Q_DxK @ (Q_DxK.T @ w)
        beta = jnp.linalg.norm(w)
        nxt = jnp.where(beta > 1e-300, w / jnp.maximum(beta, 1e-300), 0.0)
        Q_DxK = Q_DxK.at[:, j + 1].set(nxt, mode="drop") if m > 1 else Q_DxK
        return Q_DxK, alpha_K.at[j].set(alpha), beta_K.at[j].set(beta)

    Q = jnp.zeros((d, m), a_MxM.dtype).at[:, 0].set(q)
    _, alpha, beta = jax.lax.fori_loop(0, m, step, (Q, jnp.zeros(m, a_MxM.dtype), jnp.zeros(m, a_MxM.dtype)))
    return eigh_tridiagonal(alpha, beta[:-1], eigvals_only=True)[-1]


@jax.jit
def _batch_anisotropy(x_BxNxD):
    """[B, 2]: (centered, uncentered) sigma_1^2 / sum sigma^2 of each batch of N states, from
    one float64 Gram per batch, the smaller of X^T X and X X^T, centered algebraically."""
    x = x_BxNxD.astype(jnp.float64)

    def one(x_NxD):
        n, d = x_NxD.shape
        if d <= n:  # X^T X; the centered one is X^T X - s s^T / n
            gram = x_NxD.T @ x_NxD
            s_D = x_NxD.sum(0)
            centered = gram - jnp.outer(s_D, s_D) / n
        else:  # X X^T; centered: H X X^T H with H = I - 1 1^T / n
            gram = x_NxD @ x_NxD.T
            r_N = gram.sum(1)
            centered = gram - r_N[:, None] / n - r_N[None, :] / n + r_N.sum() / (n * n)
        both_2xMxM = jnp.stack([centered, gram])
        return jax.vmap(_top_eigenvalue)(both_2xMxM) / jnp.trace(both_2xMxM, axis1=1, axis2=2)

    return jax.vmap(one)(x)  # the 2B Lanczos runs side by side: their steps are latency, not work


SAMPLE_CHUNK_BYTES = 2 * 2**30  # float64 temporaries of one of sample_metrics' programs, at most about


def sample_chunk(count: int, d: int, states: int) -> int:
    """States per program of sample_metrics: each holds about three float64 copies of its
    [count, d] points (the cast, |x| and its sort for the median; standardized InterSim's z)."""
    return max(1, min(states, SAMPLE_CHUNK_BYTES // max(1, 3 * 8 * count * d)))


@functools.partial(jax.jit, static_argnums=1)
def _states_readout(x_CxKxD: tuple, batches: int):
    """A chunk of states' sample read-outs in one program (float64, x64 on): ([C, batches, 2]
    _batch_anisotropy of each state's first batches x BATCH points, or None without a batch,
    [C] median |x|, [C] InterSim of the standardized points). Every batch's Lanczos runs side by side."""
    ratios = None
    if batches:
        x = jnp.concatenate([x[:batches * BATCH].reshape(batches, BATCH, -1) for x in x_CxKxD])
        ratios = _batch_anisotropy(x).reshape(len(x_CxKxD), batches, 2)
    return (ratios, jnp.stack([geometry.median_abs(x) for x in x_CxKxD]),
            jnp.stack([geometry.inter_sim_standardized(x) for x in x_CxKxD]))


@jax.jit
def _cross_matrix(x_SxKxD: tuple):
    """[S, S] geometry.centered_cross of every pair of states in one program (float64, x64 on):
    the pairs i >= j one after another (a loop over the stacked float32 points: one pair's
    float64 temporaries at a time), mirrored."""
    x = jnp.stack(x_SxKxD)
    num = len(x_SxKxD)
    i_P, j_P = np.tril_indices(num)
    cross_P = jax.lax.map(lambda ij: geometry.centered_cross(x[ij[0]], x[ij[1]]), (i_P, j_P))
    return jnp.zeros((num, num), cross_P.dtype).at[i_P, j_P].set(cross_P).at[j_P, i_P].set(cross_P)


def sample_cka(states, count: int, state_names: list[str]) -> dict:
    """cka.json: linear CKA (geometry.cka_matrix) between every pair of states on the sample,
    {"layers": names, "matrix": [S][S], "tokens": K}: every pair's ||X^T Y||_F^2 (centered) in
    float64 in one program where the states lie (_cross_matrix), read once."""
    with jax.enable_x64(True):
        cross_SxS = np.asarray(_cross_matrix(tuple(states(i) for i in range(len(state_names)))), np.float64)
    matrix = geometry.cka_matrix(cross_SxS)
    if any(v is None for row in matrix for v in row):
        from isojax.log import log
        log(f"linear CKA is null for the states whose {count:,} sampled tokens do not vary")
    return {"layers": list(state_names), "matrix": matrix, "tokens": count}


def massive_max_over_sample_median(layer: dict) -> float | None:
    """massive_max (the corpus-wide streamed maximum) / the sample's median |x| (sample_abs_median);
    None without either. Not Sun et al.'s per-sequence ratio (stats/sentences.py); `massive_ratio` before."""
    top, median = layer.get("massive_max"), layer.get("sample_abs_median")
    return float(top / median) if top is not None and median else None


def _chunks(states, count: int, num: int):
    """states(0), ..., states(num - 1) in lists of sample_chunk states, each state asked for once."""
    xs = [states(0)]
    size = sample_chunk(count, xs[0].shape[-1], num)
    for s in range(1, num):
        if len(xs) == size:
            yield xs
            xs = []
        xs.append(states(s))
    yield xs


PROGRESS_AFTER_S = 5.0  # sample_metrics logs a line per layer once it has run this long


def sample_metrics(states, count: int, state_names: list[str], intrinsic: bool, k: int = 20,
                   discard_fraction: float = 0.1, extra: tuple[str, ...] = ()) -> list[dict]:
    """Per state, from the uniform sample (stats/sample.py): anisotropy over batches of BATCH sampled
    tokens (mean and std, ddof=1, of sigma_1^2 / sum sigma^2, centered and uncentered; The Shape
    of Learning section 2.2: shuffled, then batched) and, if `intrinsic`, the intrinsic dimension
    (isojax.stats.intrinsic): null where fewer than half the sampled points remain once exact duplicates
    are dropped (intrinsic.MIN_KEPT_SAMPLE); sample_abs_median (median |x| over the sample's entries,
    for massive_max_over_sample_median) and inter_sim_standardized (geometry), on the devices where
    the sample lies. states(s) -> [count, D] in key order (random).
    What is left out or dropped is logged per layer; once the phase has taken PROGRESS_AFTER_S
    (the neighbour searches on CPU: a minute for 4,096 tokens), a line per layer shows progress.
    extra: the registered measures off by default that the run turns on (--measure)."""
    import time

    from isojax.stats import intrinsic as ids
    from isojax.log import log
    out = []
    batches = count // BATCH
    if batches < 2:
        log(f"anisotropy_batch_std is null: the sample of {count:,} tokens makes {batches} batch"
            f"{'' if batches == 1 else 'es'} of {BATCH:,} (two are needed; --sample-states {2 * BATCH:,} or more)"
            + ("" if batches else "; anisotropy_batch_mean is null too"))
    start = time.perf_counter()
    num = len(state_names)
    pending, previous = [], None  # every state dispatched before any is read: one wait, not one a state
    for xs in _chunks(states, count, num):
        with jax.enable_x64(True):
            pending.append(_states_readout(tuple(xs), batches))
        for x in xs:
            pending.append(measures.sample_dispatch(previous, x, extra))  # isojax.stats.measures
            previous = x
    del xs, previous
    read = jax.device_get(pending)
    chunks = [r for r in read if isinstance(r, tuple)]
    ratios_SxBx2 = np.concatenate([c[0] for c in chunks]) if batches else None
    median_S, standardized_S = (np.concatenate([c[i] for c in chunks]) for i in (1, 2))
    measured = [r for r in read if isinstance(r, dict)]
    for s, _ in enumerate(state_names):
        m: dict = {"sample_tokens": count, "anisotropy_batches": batches,
                   "sample_abs_median": float(median_S[s]), "inter_sim_standardized": float(standardized_S[s])}
        if not np.isfinite(m["inter_sim_standardized"]):
            m["inter_sim_standardized"] = None
            log(f"inter_sim_standardized of {state_names[s]} is null: {count:,} sampled tokens "
                + ("(two are needed)" if count < 2 else "with a token equal to the sample's mean"))
        if batches:
            ratios = ratios_SxBx2[s]
            for j, key in enumerate(("anisotropy_batch", "anisotropy_uncentered_batch")):
                m[f"{key}_mean"] = float(ratios[:, j].mean())
                m[f"{key}_std"] = float(ratios[:, j].std(ddof=1)) if batches > 1 else None
        else:
            m.update(anisotropy_batch_mean=None, anisotropy_batch_std=None,
                     anisotropy_uncentered_batch_mean=None, anisotropy_uncentered_batch_std=None)
        said = []
        if intrinsic:
            notes: list[tuple] = []
            try:
                m["intrinsic_dimension"] = ids.intrinsic_dimensions(
                    states(s), k=k, discard_fraction=discard_fraction, min_kept=ids.MIN_KEPT_SAMPLE, notes=notes)
            except UserError as e:  # e.g. the embedding layer: one row per token type
                said.append(f"null ({e})")
                m["intrinsic_dimension"] = {"twonn": None, "mle": None, "mom": None}
            drops: dict[tuple, list[str]] = {}  # TwoNN and MLE drop the same points: one clause
            for name, dropped, of, why in notes:
                drops.setdefault((dropped, of, why), []).append(name)
            said += [f"{' and '.join(names)} left out {d:,} of {of:,} points {why}"
                     for (d, of, why), names in drops.items()]
        m.update(measures.sample_values(measured[s], state_names[s]))
        out.append(m)
        elapsed = time.perf_counter() - start
        progress = f" [{s + 1}/{len(state_names)} states, {elapsed:.0f} s]" if elapsed > PROGRESS_AFTER_S else ""
        if said:
            log(f"intrinsic dimension of {state_names[s]}: {'; '.join(said)}{progress}")
        elif progress:
            log(f"sample metrics of {state_names[s]} done{progress}")
    return out


def sample_programs(sample_count: int, d: int, num_states: int, on, extra: tuple[str, ...] = ()) -> list:
    """Lowerings (thunks: call, then .compile()) of sample_metrics' chunks of states, the measures'
    and sample_cka's matrix for samples of [sample_count, d] committed with sharding `on`
    (stats.finalize.compile_ahead compiles them; x64 on)."""
    x = jax.ShapeDtypeStruct((sample_count, d), np.float32, sharding=on)
    size = sample_chunk(sample_count, d, num_states)
    programs = [lambda k=k: _states_readout.lower((x,) * k, sample_count // BATCH)
                for k in {size, num_states - size * (-(-num_states // size) - 1)}]
    return programs + [lambda: _cross_matrix.lower((x,) * num_states), *measures.sample_programs(x, extra)]
