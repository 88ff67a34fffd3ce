"""A fused kernel for the forward on Hopper GPUs: the MLP's first product with its bias and exact
GELU in the epilogue, gelu(x @ W + b), one Mosaic GPU (Pallas) kernel.

XLA runs that product on cuBLAS and the GELU as a separate elementwise pass, which reads and
writes the [N, 4D] activations once more (26 of 366 ms per pythia-1.4b batch). Here each output
tile goes from the float32 accumulator through bias and GELU to bf16 in registers; the
pre-activation never reaches memory. The kernel is adapted from jax's
`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` (persistent, warp-specialized: one
warpgroup loads tiles by TMA, two multiply with wgmma, each on half of the tile's columns). On an
H100 the step gains 3.4% at pythia-70m, 2.7% at 410m and nothing measurable at 1.4b, where cuBLAS's
product in the step is faster than this kernel by about what the GELU pass costs
(bench/RESULTS.md 10b).

Numbers: the accumulator plus the bias is rounded to bf16 once and GELU (model.fast_erf, in
float32) is applied to that, then rounded again, as PyTorch's bf16 Linear + GELU round. XLA's path
may round the product before adding the bias (on H100 the two differed on a few elements by one
bf16 ulp). `works` checks the kernel once per process against the float64 GELU
(`rounding_error`). Used where `applies` holds (model.DenseGelu): bf16 on an sm_90 GPU and shapes
that tile; elsewhere the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.model import gelu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shape and schedule. Each of the two compute warpgroups accumulates [tile_m, tile_n]
    (float32 registers); a CTA covers two such tiles (`cta`); output leaves in [epi_m, epi_n] pieces."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4  # tiles of A and B in flight (shared memory: stages x 48 KB at these tiles)
    epi_m: int = 64
    epi_n: int = 64
    grid_minor_n: bool = False  # the order tiles are visited in (jax's planar_snake)
    grid_tile_width: int = 8
    split_m: bool = False  # the two warpgroups take a CTA tile's rows (True) or columns (False)
    in_flight: int = 0  # wgmma groups left running when the next k-step's tiles are waited for

    @property
    def cta(self) -> tuple[int, int]:
        return (2 * self.tile_m, self.tile_n) if self.split_m else (self.tile_m, 2 * self.tile_n)


def available() -> bool:
    """An sm_90 (Hopper) GPU is the default device."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def rounding_error(out_MxN, x_MxK, w_KxN, bias_N, rounded_product: bool = False) -> float:
    """How far bf16 gelu(x @ w + bias) lies beyond what rounding allows, from float64 (<= 0: within):
    u = x @ w + bias rounded to bf16 (half an ulp: <= 2^-8 |u|), GELU (|GELU'| <= 1.13), the result
    rounded again. rounded_product: x @ w was rounded to bf16 before the bias was added (XLA's path
    may do that), one more half ulp of |x @ w| through GELU."""
    import math
    p = np.asarray(x_MxK, np.float64) @ np.asarray(w_KxN, np.float64)
    u = p + np.asarray(bias_N, np.float64)
    exact = u * 0.5 * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
    bound = 1.13 * (np.abs(u) + rounded_product * np.abs(p)) * 2.0 ** -8 + np.abs(exact) * 2.0 ** -8 + 1e-5
    return float(np.max(np.abs(np.asarray(out_MxN, np.float64) - exact) - bound))


@functools.cache
def works() -> str | None:
    """None where the kernel compiles and its result is right (rounding_error) on a small product
    here, else why not (a jax whose Mosaic GPU API moved, a driver that refuses): once per process."""
    if not available():
        return "needs an sm_90 (Hopper) GPU"
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (256, 128), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (128, 256), jnp.float32) / 16).astype(jnp.bfloat16)
    b = jax.random.normal(keys[2], (256,), jnp.float32).astype(jnp.bfloat16)
    try:
        got = jax.jit(dense_gelu)(x, w, b)
    except Exception as e:  # noqa: BLE001 - any failure means: use XLA's path
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if (beyond := rounding_error(got, x, w, b)) > 0:
        return f"its result is {beyond:.3g} beyond bf16 rounding of the float64 GELU"
    return None


def applies(m: int, k: int, n: int, dtype, tiles: Tiles = Tiles()) -> bool:
    """Whether dense_gelu runs [m, k] x [k, n] in dtype here."""
    cta_m, cta_n = tiles.cta
    return available() and jnp.dtype(dtype) == jnp.bfloat16 and m % cta_m == 0 and n % cta_n == 0 \
        and k % tiles.tile_k == 0


def _kernel(a_gmem, b_gmem, bias_gmem, out_gmem, tiles: Tiles, epilogue: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    m, k = a_gmem.shape
    n = b_gmem.shape[1]
    t = tiles
    cta_m, cta_n = t.cta
    m_iters, n_iters, k_iters = m // cta_m, n // cta_n, k // t.tile_k
    swizzle = plgpu.find_swizzle(t.tile_k * 2 * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(t.epi_n * 2 * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, t.tile_k), lambda kk: (0, kk), transforms=transforms,
                                      memory_space=plgpu.SMEM, delay_release=t.in_flight),
                      plgpu.BlockSpec((t.tile_k, cta_n), lambda kk: (kk, 0), transforms=transforms,
                                      memory_space=plgpu.SMEM, delay_release=t.in_flight)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=context)

    ignore = lambda *_, **__: None

    @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
                       out_smem=plgpu.SMEM((2, 2, t.epi_m, t.epi_n), jnp.bfloat16, transforms=out_transforms),
                       collective_axes="wg")
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
        def _tiles(info):
            (lin,) = info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters),
                                              MatmulDimension.N if t.grid_minor_n else MatmulDimension.M,
                                              t.grid_tile_width)
            rows, cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * cta_n, cta_n)
            # this warpgroup's part of the CTA tile
            wg_rows = pl.ds(wg * t.tile_m, t.tile_m) if t.split_m else slice(None)
            wg_cols = slice(None) if t.split_m else pl.ds(wg * t.tile_n, t.tile_n)
            wg_col0 = 0 if t.split_m else wg * t.tile_n

            def context(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
                def _acc(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for mi in range(t.tile_m // t.epi_m):
                        for ni in range(t.tile_n // t.epi_n):
                            sm, sn = slice(mi * t.epi_m, (mi + 1) * t.epi_m), slice(ni * t.epi_n, (ni + 1) * t.epi_n)
                            slot = (mi * (t.tile_n // t.epi_n) + ni) % 2
                            part = acc[sm, sn]
                            if epilogue:
                                n0 = n_idx * cta_n + wg_col0 + ni * t.epi_n
                                bias = plgpu.load(bias_gmem.at[pl.ds(n0, t.epi_n)], (), layout=plgpu.Layout.WGMMA.reduce(0),
                                                  optimized=False).astype(jnp.float32)
                                u = part + lax.broadcast_in_dim(bias, (t.epi_m, t.epi_n), [1])
                                part = gelu(u.astype(jnp.bfloat16), False)  # rounded once, as PyTorch
                            else:
                                part = part.astype(jnp.bfloat16)
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = part
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[rows, cols].at[wg_rows, wg_cols].at[sm, sn])

            def mma(idxs, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
                plgpu.wgmma_wait(t.in_flight)
                return acc_ref

            pipeline(mma, context)(a_gmem.at[rows, :], b_gmem.at[:, cols], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def dense_gelu(x_MxK, w_KxN, bias_N, tiles: Tiles = Tiles(), epilogue: bool = True):
    """gelu(x @ w + bias) in bf16 (epilogue=False: x @ w alone, for benchmarks); bf16 inputs."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x_MxK.shape
    n = w_KxN.shape[1]
    if m % tiles.cta[0] or n % tiles.cta[1] or k % tiles.tile_k:
        raise ValueError(f"[{m}, {k}] x [{k}, {n}] does not tile by {tiles}")
    sms = getattr(jax.devices()[0], "core_count", 132)
    call = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, epilogue=epilogue),
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(sms,), grid_names=("cluster_grid",), cluster=(1,), cluster_names=("cluster",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return call(x_MxK, w_KxN, bias_N)
