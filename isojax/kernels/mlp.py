"""Fused kernels for the forward on Hopper GPUs, one Mosaic GPU (Pallas) kernel each: the MLP's
first product with its bias and exact GELU in the epilogue, gelu(x @ W + b) (dense_gelu), and the
gated MLP's two first products with SiLU and their product in the epilogue,
silu(x @ W_gate) * (x @ W_up) (dense_swiglu: Llama, Mistral, Qwen2, OLMo, OLMo-2).

XLA runs that product on cuBLAS and the GELU as a separate elementwise pass, which reads and
writes the [N, 4D] activations once more. Here each output
tile goes from the float32 accumulator through bias and GELU to bf16 in registers; the
pre-activation never reaches memory. The kernel is persistent and warp-specialized, after jax's
`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` (one warpgroup loads tiles by TMA, two
multiply with wgmma), but with a ping-pong schedule in place of that kernel's cooperative one: each
compute warpgroup owns whole output tiles and the two take turns, so one's epilogue (bias, GELU,
store) runs while the other's products keep the tensor cores busy (gains measured in
bench/RESULTS.md 10b and 10g).

Numbers: the accumulator plus the bias is rounded to bf16 once and GELU (isojax.numerics.fast_erf, in
float32) is applied to that, then rounded again, as PyTorch's bf16 Linear + GELU round. XLA's path
may round the product before adding the bias, so the two may differ by one bf16 ulp. The gated
kernel rounds as PyTorch's bf16 Llama MLP: each product to bf16, SiLU in float32 (x / (1 + e^-x))
rounded, their product rounded. `works` checks a kernel once per process against float64
(`rounding_error`, `gated_rounding_error`). Used where `applies` holds (model.layers: DenseGelu,
feed_forward): bf16 on an sm_90 GPU and shapes that tile; elsewhere the XLA path. Both run on CPU
in Mosaic GPU's interpret mode (interpret=True: the tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.numerics import gelu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shape and schedule (_kernel). Each compute warpgroup accumulates whole [tile_m, tile_n]
    tiles of the product in float32 registers (the gated kernel: tile_n / 2 columns of x @ W_gate
    beside the same of x @ W_up, for an output tile of [tile_m, tile_n / 2]); the memory warpgroup
    keeps `stages` k-steps of A and B in shared memory (32 KB each at these tiles); output leaves
    in [epi_m, epi_n] pieces."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    epi_m: int = 64
    epi_n: int = 64
    grid_minor_n: bool = True  # the order tiles are visited in (jax's planar_snake)
    grid_tile_width: int = 8
    in_flight: int = 1  # 0 or 1: wgmma groups left running when the next k-step's tiles are waited for




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


def gated_rounding_error(out_MxN, x_MxK, wg_KxN, wu_KxN) -> float:
    """How far bf16 silu(x @ wg) * (x @ wu) lies beyond what rounding allows, from float64 (<= 0:
    within): g and u rounded to bf16 (half an ulp each, |SiLU'| <= 1.1), SiLU rounded, the product
    rounded: |error| <= (1.1 |g| |u| + |silu(g)| |u|) 2^-8 + |silu(g)| |u| 2^-7 + float32's 1e-6, and
    the float32 sums' own error through SiLU and the product."""
    x, wg, wu = (np.asarray(a, np.float64) for a in (x_MxK, wg_KxN, wu_KxN))
    g, u = x @ wg, x @ wu
    s = g / (1 + np.exp(-g))
    exact = s * u
    # float32 sums of k products: |error| <= k 2^-24 sum |x w| (the accumulators' order is free)
    eg, eu = (x.shape[1] * 2.0 ** -24 * (np.abs(x) @ np.abs(w)) for w in (wg, wu))
    bound = (1.1 * np.abs(g) * np.abs(u) + np.abs(s) * np.abs(u)) * 2.0 ** -8 + np.abs(exact) * 2.0 ** -7 + 1e-6 \
        + 1.1 * np.abs(u) * eg + np.abs(s) * eu
    return float(np.max(np.abs(np.asarray(out_MxN, np.float64) - exact) - bound))


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


@functools.cache
def works(gated: bool = False) -> str | None:
    """None where the kernel (gated: dense_swiglu, else dense_gelu) compiles and its result is right
    (rounding_error) on a small product here, else why not (a jax whose Mosaic GPU API moved, a
    driver that refuses): once per process."""
    if not available():
        return "needs an sm_90 (Hopper) GPU"
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (256, 128), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (128, 256), jnp.float32) / 16).astype(jnp.bfloat16)
    b = jax.random.normal(keys[2], (256,), jnp.float32).astype(jnp.bfloat16)
    try:
        if gated:
            w2 = (jax.random.normal(keys[2], (128, 256), jnp.float32) / 16).astype(jnp.bfloat16)
            beyond = gated_rounding_error(jax.jit(dense_swiglu)(x, w, w2), x, w, w2)
        else:
            beyond = rounding_error(jax.jit(dense_gelu)(x, w, b), x, w, b)
    except Exception as e:  # noqa: BLE001 - any failure means: use XLA's path
        return _why(e)
    if beyond > 0:
        return f"its result is {beyond:.3g} beyond bf16 rounding of float64"
    return None


def tiles(m: int, k: int, n: int, gated: bool = False) -> bool:
    """Whether [m, k] x [k, n] tiles for dense_gelu (gated: dense_swiglu) on any machine."""
    t = Tiles()
    return m % t.tile_m == 0 and n % (t.tile_n // (1 + gated)) == 0 and k % t.tile_k == 0


def applies(m: int, k: int, n: int, dtype, gated: bool = False, hopper: bool | None = None) -> bool:
    """Whether dense_gelu (gated: dense_swiglu) runs [m, k] x [k, n] in dtype here (hopper: on the
    GPU lowered for, a Hopper or not; None: this machine's)."""
    return (available() if hopper is None else hopper) and jnp.dtype(dtype) == jnp.bfloat16 and tiles(m, k, n, gated)


def _silu_product(g, u):
    """PyTorch's bf16 silu(g) * u from float32 products: g, u rounded; SiLU in float32, rounded;
    the product rounded."""
    bf = jnp.bfloat16
    g, u = g.astype(bf).astype(jnp.float32), u.astype(bf).astype(jnp.float32)
    s = (g / (1.0 + jnp.exp(-g))).astype(bf).astype(jnp.float32)
    return (s * u).astype(bf)


def _store_tile(acc, out_smem, out_gmem, bias_gmem, n0, t: Tiles, epilogue: str):
    """One warpgroup's [tile_m, tile_n] float32 accumulator -> the epilogue ("gelu": + bias, GELU;
    "silu_product": silu(left half) * right half; "none") -> bf16 -> out_gmem (its [tile_m, w]
    view, w = tile_n or tile_n / 2), in [epi_m, epi_n] pieces through the two slots of out_smem; n0:
    the tile's first output column (for the bias)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    halves = 2 if epilogue == "silu_product" else 1
    w = t.tile_n // halves
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for mi in range(t.tile_m // t.epi_m):
        for ni in range(w // t.epi_n):
            sm, sn = slice(mi * t.epi_m, (mi + 1) * t.epi_m), slice(ni * t.epi_n, (ni + 1) * t.epi_n)
            slot = (mi * (w // t.epi_n) + ni) % 2
            parts = [acc[sm, h * w + ni * t.epi_n:h * w + (ni + 1) * t.epi_n] for h in range(halves)]
            if epilogue == "gelu":
                bias = plgpu.load(bias_gmem.at[pl.ds(n0 + ni * t.epi_n, t.epi_n)], (),
                                  layout=plgpu.Layout.WGMMA.reduce(0), optimized=False).astype(jnp.float32)
                u = parts[0] + lax.broadcast_in_dim(bias, (t.epi_m, t.epi_n), [1])
                part = gelu(u.astype(jnp.bfloat16), False)  # rounded once, as PyTorch
            elif epilogue == "silu_product":
                part = _silu_product(*parts)
            else:
                part = parts[0].astype(jnp.bfloat16)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[slot] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[slot], out_gmem.at[sm, sn])


def _transforms(cols: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    swizzle = plgpu.find_swizzle(cols * 2 * 8)
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def _tile_origin(lin, m_iters, n_iters, t: Tiles):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension
    return plgpu.planar_snake(lin, (m_iters, n_iters), MatmulDimension.N if t.grid_minor_n else MatmulDimension.M,
                              t.grid_tile_width)


def _kernel(*refs, tiles: Tiles, epilogue: str, sms: int):
    """refs: A [m, k], B [k, n] (for "silu_product" [k, 2n]: W_gate's and W_up's columns in
    alternate blocks of tile_n / 2, interleave(), so that one B tile holds both halves of an output
    tile and each k-step is one product), the bias [n] for "gelu", the output [m, n]. CTA c takes tiles c, c + sms, c + 2 sms, ... (in planar_snake order); its j-th
    goes to compute warpgroup j % 2, and the warpgroups take turns (the `turn` barriers): one issues
    its tile's products once the other has issued its own, then runs its epilogue while the other
    multiplies. Warpgroup 2 loads k-step kk of tile j, the CTA's step g = j * k_iters + kk, into slot
    g % stages of one ring. Barriers are kept per compute warpgroup, [2, stages]: full[j % 2, slot]
    counts the step's copies, and free[j % 2, slot] is where warpgroup j % 2 releases the slot, so
    the loader waits on free[(owner of step g - stages), slot] before reusing it. Every warpgroup
    thus waits on each completion of its barriers in order, as barrier_wait's per-thread phase bits
    require."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    halves = 2 if epilogue == "silu_product" else 1
    a_gmem, b_gmem, out_gmem = refs[0], refs[1], refs[-1]
    bias_gmem = refs[2] if epilogue == "gelu" else None
    m, k = a_gmem.shape
    n = out_gmem.shape[1]
    t = tiles
    w = t.tile_n // halves  # output columns per tile
    m_iters, n_iters, k_iters = m // t.tile_m, n // w, k // t.tile_k
    cta = lax.axis_index("cluster_grid")
    cta_tiles = (m_iters * n_iters - cta + sms - 1) // sms  # tiles of this CTA (all CTAs: < sms apart)

    def barrier(g):
        """Index into full and free of the CTA's step g: (owner, slot)."""
        return lax.rem(g // k_iters, 2) * t.stages + lax.rem(g, t.stages)

    def body(a_smem, b_smem, out_smem, full, free, turn):
        wg = lax.axis_index("wg")

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def tile(i, carry):
                j = 2 * i + wg
                m_idx, n_idx = _tile_origin(cta + j * sms, m_iters, n_iters, t)
                pl.when(j > 0)(lambda: plgpu.barrier_wait(turn.at[wg]))

                def steps(acc_ref):
                    def step(kk, carry):
                        g = j * k_iters + kk
                        plgpu.barrier_wait(full.at[barrier(g)])
                        slot = lax.rem(g, t.stages)
                        plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot])
                        plgpu.wgmma_wait(t.in_flight)
                        if t.in_flight:  # the previous step's products are done: its slot is free
                            pl.when(kk > 0)(lambda: plgpu.barrier_arrive(free.at[barrier(g - 1)]))
                        else:
                            plgpu.barrier_arrive(free.at[barrier(g)])
                        return carry
                    lax.fori_loop(0, k_iters, step, None)
                    plgpu.barrier_arrive(turn.at[1 - wg])  # all issued: the other warpgroup's turn
                    if t.in_flight:
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[barrier(j * k_iters + k_iters - 1)])
                    return acc_ref[...]

                acc = pl.run_scoped(steps, plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
                view = out_gmem.at[pl.ds(m_idx * t.tile_m, t.tile_m), pl.ds(n_idx * w, w)]
                _store_tile(acc, out_smem.at[wg], view, bias_gmem, n_idx * w, t, epilogue)
                return carry

            lax.fori_loop(0, (cta_tiles - wg + 1) // 2, tile, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def tile(j, carry):
                m_idx, n_idx = _tile_origin(cta + j * sms, m_iters, n_iters, t)
                rows, cols = pl.ds(m_idx * t.tile_m, t.tile_m), pl.ds(n_idx * t.tile_n, t.tile_n)

                def step(kk, carry):
                    g = j * k_iters + kk
                    pl.when(g >= t.stages)(lambda: plgpu.barrier_wait(free.at[barrier(g - t.stages)]))
                    slot, ks = lax.rem(g, t.stages), pl.ds(kk * t.tile_k, t.tile_k)
                    plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], full.at[barrier(g)])
                    plgpu.copy_gmem_to_smem(b_gmem.at[ks, cols], b_smem.at[slot], full.at[barrier(g)])
                    return carry
                return lax.fori_loop(0, k_iters, step, carry)

            lax.fori_loop(0, cta_tiles, tile, None)

    pl.run_scoped(
        body,
        plgpu.SMEM((t.stages, t.tile_m, t.tile_k), jnp.bfloat16, transforms=_transforms(t.tile_k)),
        plgpu.SMEM((t.stages, t.tile_k, t.tile_n), jnp.bfloat16, transforms=_transforms(t.tile_k)),
        plgpu.SMEM((2, 2, t.epi_m, t.epi_n), jnp.bfloat16, transforms=_transforms(t.epi_n)),
        plgpu.Barrier(num_arrivals=2, num_barriers=2 * t.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * t.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        collective_axes="wg")


def _call(operands, m: int, k: int, n: int, tiles: Tiles, epilogue: str, interpret: bool):
    """The kernel on operands (A, the B's, the bias) -> [m, n] bf16; interpret: Mosaic GPU's
    interpret mode (on CPU, with 4 CTAs)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if m % tiles.tile_m or n % (tiles.tile_n // (1 + (epilogue == "silu_product"))) or k % tiles.tile_k:
        raise ValueError(f"[{m}, {k}] x [{k}, {n}] does not tile by {tiles}")
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # no public name yet
        extra = dict(interpret=InterpretGPUParams())
    sms = 4 if interpret else getattr(jax.devices()[0], "core_count", 132)
    call = plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, epilogue=epilogue, sms=sms),
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(sms,), grid_names=("cluster_grid",), cluster=(1,), cluster_names=("cluster",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **extra)
    return call(*operands)


def dense_gelu(x_MxK, w_KxN, bias_N, tiles: Tiles = Tiles(), epilogue: bool = True, interpret: bool = False):
    """gelu(x @ w + bias) in bf16 (epilogue=False: x @ w alone, for benchmarks); bf16 inputs."""
    (m, k), n = x_MxK.shape, w_KxN.shape[1]
    if epilogue:
        return _call((x_MxK, w_KxN, bias_N), m, k, n, tiles, "gelu", interpret)
    return _call((x_MxK, w_KxN), m, k, n, tiles, "none", interpret)


def interleave(wg_KxN, wu_KxN, block: int):
    """[k, 2n]: W_gate's and W_up's columns in alternate blocks of `block` (gate block j, then up
    block j), one copy of the weights (1-2% of the product's time at the Llama family's shapes)."""
    k, n = wg_KxN.shape
    return jnp.stack([wg_KxN.reshape(k, n // block, block), wu_KxN.reshape(k, n // block, block)],
                     axis=2).reshape(k, 2 * n)


def dense_swiglu(x_MxK, wg_KxN, wu_KxN, tiles: Tiles = Tiles(), interpret: bool = False):
    """silu(x @ wg) * (x @ wu) in bf16, rounded as PyTorch's bf16 Llama MLP; bf16 inputs."""
    (m, k), n = x_MxK.shape, wg_KxN.shape[1]
    if n % (tiles.tile_n // 2):
        raise ValueError(f"[{m}, {k}] x [{k}, {n}] does not tile by {tiles}")
    b_Kx2N = interleave(wg_KxN, wu_KxN, tiles.tile_n // 2)
    return _call((x_MxK, b_Kx2N), m, k, n, tiles, "silu_product", interpret)
