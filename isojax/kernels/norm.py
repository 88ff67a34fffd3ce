"""Both LayerNorms of a parallel-residual block (GPT-NeoX, Pythia) in one Pallas (Triton) kernel.

With `use_parallel_residual` the attention's and the MLP's LayerNorms read the same state x. XLA
runs them as two kernels, each reading x; here one kernel reads a block of rows once, computes the
float32 statistics once (two-pass variance, as model.LayerNorm) and writes both outputs:
1.5 passes over [N, D] in bf16 instead of 2 (measured: bench/RESULTS.md 10i).

Numbers: the same float32 operations as model.LayerNorm (mean, centred values, mean of squares,
rsqrt, scale and bias), rounded once to the output dtype; the sums run in another order than
XLA's, so an output may differ from XLA's by one rounding (tests/test_norm_kernel.py bounds it
against float64). Used where `applies` holds (model.layer_norm_pair, ForwardOptions.norm_kernel
"pallas", which isojax.run.measure chooses on GPUs): bf16 and a power-of-two width; elsewhere XLA's two
LayerNorms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32


def applies(d: int, dtype) -> bool:
    """Whether layer_norm_pair takes rows of width d in dtype (off a GPU it runs in Pallas'
    interpret mode: the tests; isojax.run.measure chooses it on GPUs only)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and 128 <= d <= 8192 and d & (d - 1) == 0


def rows_per_block(d: int) -> int:
    return max(1, 8192 // d)


def _kernel(x_ref, s1_ref, b1_ref, s2_ref, b2_ref, y1_ref, y2_ref, *, eps: float):
    x_RxD = x_ref[...].astype(_F32)
    d = x_RxD.shape[1]
    xc_RxD = x_RxD - jnp.sum(x_RxD, axis=1, keepdims=True) / d
    var_Rx1 = jnp.sum(xc_RxD * xc_RxD, axis=1, keepdims=True) / d
    xn_RxD = xc_RxD * lax.rsqrt(var_Rx1 + eps)
    y1_ref[...] = (xn_RxD * s1_ref[...].astype(_F32)[None, :] + b1_ref[...].astype(_F32)[None, :]).astype(y1_ref.dtype)
    y2_ref[...] = (xn_RxD * s2_ref[...].astype(_F32)[None, :] + b2_ref[...].astype(_F32)[None, :]).astype(y2_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def layer_norm_pair(x_NxD, scale1_D, bias1_D, scale2_D, bias2_D, *, eps: float, num_warps: int = 8,
                    interpret: bool | None = None):
    """(LayerNorm(x; scale1, bias1), LayerNorm(x; scale2, bias2)), both [N, D] in x's dtype; N a
    multiple of the block's rows (8192 / D). interpret None: Pallas' interpret mode off a GPU
    (the tests on CPU). 8 warps: the faster choice over the widths bench/bench_norm.py sweeps."""
    import jax.experimental.pallas as pl

    n, d = x_NxD.shape
    rows = rows_per_block(d)
    if n % rows:
        raise ValueError(f"{n} rows do not split into blocks of {rows}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    row_block = pl.BlockSpec((rows, d), lambda i: (i, 0))
    vector = pl.BlockSpec((d,), lambda i: (0,))
    out = jax.ShapeDtypeStruct((n, d), x_NxD.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps), grid=(n // rows,),
        in_specs=[row_block, vector, vector, vector, vector], out_specs=[row_block, row_block],
        out_shape=[out, out], interpret=interpret, name="isojax_layer_norm_pair", **params,
    )(x_NxD, scale1_D, bias1_D, scale2_D, bias2_D)


def reference(x_NxD, scale_D, bias_D, eps: float):
    """LayerNorm in float64 (the tests' truth)."""
    x = np.asarray(x_NxD, np.float64)
    xc = x - x.mean(-1, keepdims=True)
    return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps) * np.asarray(scale_D, np.float64) \
        + np.asarray(bias_D, np.float64)


def rounding_excess(out_NxD, want_NxD) -> float:
    """How far out lies beyond one bf16 rounding of the float64 LayerNorm (<= 0: within), allowing
    float32's error in the statistics (2^-16 of the largest output of each row)."""
    got, want = np.asarray(out_NxD, np.float64), np.asarray(want_NxD, np.float64)
    bound = np.abs(want) * 2.0 ** -8 + np.abs(want).max(-1, keepdims=True) * 2.0 ** -16
    return float(np.max(np.abs(got - want) - bound))


_WORKS: dict = {}


def works(d: int) -> str | None:
    """None where the kernel compiles here for width d and lands within rounding of float64 on a few
    rows, else why not (once per process and width)."""
    if d not in _WORKS:
        keys = jax.random.split(jax.random.key(d), 5)
        rows = 2 * rows_per_block(d)
        x = (3 + 2 * jax.random.normal(keys[0], (rows, d), _F32)).astype(jnp.bfloat16)
        s1, b1, s2, b2 = (jax.random.normal(k, (d,), _F32).astype(jnp.bfloat16) for k in keys[1:])
        try:
            y1, y2 = layer_norm_pair(x, s1, b1, s2, b2, eps=1e-5)
            excess = max(rounding_excess(y1, reference(x, s1, b1, 1e-5)), rounding_excess(y2, reference(x, s2, b2, 1e-5)))
            _WORKS[d] = None if excess <= 0 else f"its result is {excess:.3g} beyond bf16 rounding of float64"
        except Exception as e:  # noqa: BLE001 - any failure means: use XLA's LayerNorms
            _WORKS[d] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return _WORKS[d]
