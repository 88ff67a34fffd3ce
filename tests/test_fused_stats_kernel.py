"""bench/fused_stats_kernel.py's fused_moments (issue 13's first Pallas attempt, slower than
XLA on an H100 and so not in the step: bench/RESULTS.md §10) in Pallas interpret mode on CPU, on
fresh random states, against stats' XLA path (kernels.xla_moments) and against float64 numpy;
and its Triton lowering (built on the host for CUDA, not compiled or run)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fused_stats_kernel as kernels  # noqa: E402

NAMES = ("sum", "m2", "unit_sum", "unit_m2", "norm_sum")


def make_state(seed, n, d, dtype, *, aniso=False, invalid=0.2, zero_rows=2):
    """x [n, d] with `invalid` of its rows padding that holds garbage (NaN, inf, 1e30, huge
    values), `zero_rows` valid all-zero rows, and for aniso x = c + 1e-3 noise (cos ~ 0.99999)."""
    rng = np.random.default_rng(seed)
    if aniso:
        x = rng.normal(size=d) * 2.0 + 1e-3 * rng.normal(size=(n, d))
    else:
        x = rng.normal(size=(n, d)) * rng.uniform(0.5, 3.0, size=d) + rng.normal(size=d)
    valid = rng.random(n) >= invalid
    x[rng.choice(np.flatnonzero(valid), zero_rows, replace=False)] = 0.0
    garbage = np.flatnonzero(~valid)
    x[garbage] = rng.choice([np.nan, np.inf, -np.inf, 1e30, 3e4], size=(len(garbage), d))
    return jnp.asarray(x, dtype), jnp.asarray(valid)


def numpy_moments(x_NxD, valid_N):
    """The five values in float64 from the (already rounded) input's valid rows."""
    x = np.asarray(x_NxD.astype(jnp.float32), np.float64)[np.asarray(valid_N)]
    norm = np.linalg.norm(x, axis=1)
    u = x / np.where(norm > 0, norm, 1.0)[:, None]

    def moments(a):
        s = a.sum(0)
        dev = a - s / max(len(a), 1)
        return s, dev.T @ dev

    (s, m2), (us, um2) = moments(x), moments(u)
    return s, m2, us, um2, norm.sum(), np.abs(x).sum(0), np.abs(u).sum(0)


def errors(got, ref):
    """Errors of the five values on their natural scales: sums per column by Sum |x|, M2 entries
    by sqrt(M2_ii M2_jj) (the Cauchy-Schwarz bound, so near-zero off-diagonals of a correlated
    M2 are not over-weighted), norm_sum relatively."""
    s, m2, us, um2, ns, abs_x, abs_u = ref
    got = [np.asarray(g, np.float64) for g in got]

    def gram_err(g, r):
        scale = np.sqrt(np.outer(np.diag(r), np.diag(r))) + 1e-30
        return np.max(np.abs(g - r) / scale)

    return dict(sum=np.max(np.abs(got[0] - s) / (abs_x + 1e-30)), m2=gram_err(got[1], m2),
                unit_sum=np.max(np.abs(got[2] - us) / (abs_u + 1e-30)), unit_m2=gram_err(got[3], um2),
                norm_sum=abs(got[4] - ns) / max(ns, 1e-30))


# float64 bounds (observed: float32 <= 4e-7, bf16 M2 <= 7e-3): float32 sums; bf16 deviations
# cost up to 2^-9 per product, less on average
TOL_F64 = {jnp.float32: dict(sum=2e-6, m2=1e-5, unit_sum=2e-6, unit_m2=1e-5, norm_sum=2e-6),
           jnp.bfloat16: dict(sum=2e-6, m2=2e-2, unit_sum=2e-6, unit_m2=2e-2, norm_sum=2e-6)}
# against the XLA path (observed <= 2e-6, bf16 M2 <= 2e-5): the same roundings, so only summation
# order and the odd bf16 flip of a deviation whose float32 value moved by an ulp
TOL_XLA = {jnp.float32: dict(sum=2e-6, m2=1e-5, unit_sum=2e-6, unit_m2=1e-5, norm_sum=2e-6),
           jnp.bfloat16: dict(sum=2e-6, m2=2e-4, unit_sum=2e-6, unit_m2=2e-4, norm_sum=2e-6)}

CASES = [  # seed, N, D, dtype, aniso, block_n, block_d, split_n
    (1, 300, 96, jnp.float32, False, 32, 32, 2),  # N not a multiple of the blocks, 3x3 tiles
    (2, 300, 96, jnp.bfloat16, False, 32, 32, 2),
    (3, 256, 128, jnp.float32, True, 16, 64, None),  # nearly parallel states
    (4, 256, 128, jnp.bfloat16, True, 16, 64, None),
    (5, 130, 384, jnp.bfloat16, False, 16, 128, 1),  # D = 3 * 128
    (6, 200, 256, jnp.float32, False, 64, 128, 4),
]


@pytest.mark.parametrize("seed,n,d,dtype,aniso,block_n,block_d,split_n", CASES)
def test_fused_moments_match_xla_and_float64(seed, n, d, dtype, aniso, block_n, block_d, split_n):
    x, valid = make_state(seed, n, d, dtype, aniso=aniso)
    fused = kernels.fused_moments(x, valid, interpret=True, block_n=block_n, block_d=block_d,
                                  split_n=split_n)
    xla = kernels.xla_moments(x, valid)
    assert all(np.isfinite(np.asarray(v)).all() for v in fused)
    for got, dt in zip(fused, (jnp.float32,) * 5):
        assert got.dtype == dt
    assert fused[1].shape == fused[3].shape == (d, d) and fused[0].shape == (d,)
    ref = numpy_moments(x, valid)
    ref_xla = (*(np.asarray(v, np.float64) for v in xla), *ref[5:])
    err_f64, err_xla = errors(fused, ref), errors(fused, ref_xla)
    for name in NAMES:
        assert err_f64[name] <= TOL_F64[dtype][name], (name, err_f64)
        assert err_xla[name] <= TOL_XLA[dtype][name], (name, err_xla)
    # the lower triangle is the mirror of the upper
    np.testing.assert_array_equal(np.asarray(fused[1]), np.asarray(fused[1]).T)


def test_errors_detect_one_missing_row():
    """The tolerances are tight enough to see one valid row (of ~200) left out."""
    x, valid = make_state(7, 256, 64, jnp.float32)
    dropped = valid.at[int(np.flatnonzero(np.asarray(valid))[5])].set(False)
    err = errors(kernels.fused_moments(x, dropped, interpret=True, block_n=32, block_d=32),
                 numpy_moments(x, valid))
    assert all(err[name] > 100 * TOL_F64[jnp.float32][name] for name in NAMES), err


def test_no_valid_rows_gives_zeros():
    x, _ = make_state(8, 64, 32, jnp.float32)
    out = kernels.fused_moments(x, jnp.zeros(64, bool), interpret=True, block_n=16, block_d=32)
    for v in out:
        np.testing.assert_array_equal(np.asarray(v), 0.0)


def test_bad_blocks_raise():
    x = jnp.zeros((64, 96), jnp.float32)
    with pytest.raises(ValueError):
        kernels.fused_moments(x, jnp.ones(64, bool), interpret=True, block_d=64)  # 96 % 64
    with pytest.raises(ValueError):
        kernels.fused_moments(x, jnp.ones(64, bool), interpret=True, block_n=24, block_d=32)


@pytest.mark.parametrize("dtype,d,block_d", [(jnp.bfloat16, 384, 128), (jnp.float32, 256, 64)])
def test_triton_lowering_builds(dtype, d, block_d):
    """The kernels lower to Triton IR for CUDA on this host (power-of-two tensors, supported
    ops); PTX is only built on a GPU."""
    x = jax.ShapeDtypeStruct((4096, d), dtype)
    valid = jax.ShapeDtypeStruct((4096,), jnp.bool_)
    f = jax.jit(lambda x, v: kernels.fused_moments(x, v, block_d=block_d))
    text = f.trace(x, valid).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
