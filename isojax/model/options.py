"""Trace-time settings of the statistics: one frozen, hashable object handed to the step.

Everything here changes what is compiled, never what is measured: every setting gives the same
metrics within the float32 error bounds of README "Precision" (tests/test_stats.py runs the
non-default ones against float64). Shapes (groups, vocabulary, centered pass) come from the
accumulators themselves, not from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class StatsOptions:
    # How one batch's id-sorted rows are summed per token: "scan" (a segmented associative scan:
    # no float atomics, error <= log2(N) ulps, but XLA's GPU compiler took minutes over its
    # log2(N) levels), "scatter" (segment_sum, a float32 scatter-add: one pass; hot tokens
    # contend and the error grows with a token's count in the batch), or "auto": scatter on GPUs
    # (bench/RESULTS.md), scan elsewhere (TPUs serialize scatter-adds; not measured on a TPU).
    segment_sum: str = "auto"
    # Column block width of the batch Gram: for D >= 2 * gram_block (and a multiple of it) only
    # the blocks on and above the diagonal are multiplied.
    gram_block: int = 512
    # Float32 Gram products: "highest" (true float32, no TF32) or "bf16x6" (six bf16 tensor-core
    # passes, ~float32 accuracy; bench_stats_kernel.py measures both). bf16 states always take
    # the bf16 tensor-core Gram.
    gram_precision: str = "highest"
    # Distinct tokens per gather/scatter round of the per-token update on one device.
    token_chunk: int = 4096
    # With the vocabulary sharded: rows each device sends per exchange round, exchange_rows /
    # shards to every owner (a round pads to that; more distinct tokens per owner take more
    # rounds). None: a quarter of the device's batch, which holds the ~15k distinct tokens of a
    # 65k-token batch of text in one round.
    exchange_rows: int | None = None
    # Widest states whose per-token segment sum tells XLA that the ids are sorted: the hint pays
    # at narrow widths and costs at wide ones (bench/RESULTS.md).
    sorted_scatter_max_d: int = 1024
    # The per-token accumulators are split over `token_shards` devices along the mesh axes
    # `token_axes` (device k owns token ids k, k + shards, ...); 1: one device holds them all.
    token_shards: int = 1
    token_axes: tuple[str, ...] = ()
    # The second moments (Grams) are split by rows over `gram_shards` devices of the mesh axis
    # `gram_axis` ("model"): those devices pool their rows into one population, and each keeps
    # D / gram_shards rows of its [D, D] Grams (a reduce-scatter per state). 1: every device
    # keeps whole Grams of its own rows.
    gram_shards: int = 1
    gram_axis: str | None = None

    def __post_init__(self):
        if self.segment_sum not in ("auto", "scan", "scatter"):
            raise ValueError(f"segment_sum must be auto, scan or scatter, not {self.segment_sum!r}")
        if self.gram_precision not in ("highest", "bf16x6"):
            raise ValueError(f"gram_precision must be highest or bf16x6, not {self.gram_precision!r}")
        if self.token_shards > 1 and not self.token_axes:
            raise ValueError("token_shards > 1 needs the mesh axes the tokens are sharded over")
        if self.gram_shards > 1 and not self.gram_axis:
            raise ValueError("gram_shards > 1 needs the mesh axis the Grams are split over")

    def segment_sum_mode(self) -> str:
        if self.segment_sum != "auto":
            return self.segment_sum
        return "scatter" if jax.default_backend() == "gpu" else "scan"

    def gram_dot_precision(self):
        if self.gram_precision == "bf16x6":
            return jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
        return jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Trace-time settings of the forward (GPT-NeoX states do not depend on them beyond the
    tolerances README "bfloat16" documents)."""

    # "xla" (plain attention, the exact reference), "cudnn" (jax.nn.dot_product_attention's
    # cuDNN kernel, bf16/fp16 only), "pallas" (Pallas flash attention for TPUs, with segment ids;
    # rows a multiple of 128), "packed" (isojax.kernels.packed_attention: a Pallas kernel for GPUs that
    # reads the fused projection, rotates q and k itself and skips the key blocks outside each
    # query block's sequences) or "auto" (jax picks)
    attention: str = "xla"
    # Exact GELU of bf16 activations in float32 with a cheap rational erf (model.ops.gelu); False:
    # jax's erf (bench/breakdown.py measures the difference)
    fast_gelu: bool = True
    # Tell cuDNN that the (already causal) mask is causal, so it skips the blocks above the
    # diagonal
    cudnn_causal: bool = True
    # The MLP's first product with bias and GELU: "xla" (cuBLAS, then an elementwise pass) or
    # "mosaic" (one Hopper kernel with GELU in its epilogue, isojax.kernels.mlp; where it does not
    # apply, XLA's)
    mlp_kernel: str = "xla"
    # A parallel-residual block's two LayerNorms: "xla" (two kernels) or "pallas" (one Triton
    # kernel reading the state once, isojax.kernels.norm; where it does not apply, XLA's)
    norm_kernel: str = "xla"
    # Sharding the activations [B, T, D] keep between blocks (rows over every device, so that
    # XLA gathers sharded weights rather than splitting activations); None on one device
    activation_sharding: Any = None

    def __post_init__(self):
        if self.attention not in ("xla", "cudnn", "pallas", "packed", "auto"):
            raise ValueError(f"attention must be xla, cudnn, pallas, packed or auto, not {self.attention!r}")
        if self.mlp_kernel not in ("xla", "mosaic"):
            raise ValueError(f"mlp_kernel must be xla or mosaic, not {self.mlp_kernel!r}")
        if self.norm_kernel not in ("xla", "pallas"):
            raise ValueError(f"norm_kernel must be xla or pallas, not {self.norm_kernel!r}")

    def devices(self) -> int:
        return 1 if self.activation_sharding is None else self.activation_sharding.mesh.size

    def per_device(self, fn, sharded, replicated):
        """fn(*sharded, *replicated) on each device's rows (shard_map over the activation
        sharding; the leading axis of every `sharded` array is the rows'); a kernel XLA cannot
        partition would otherwise be gathered onto every device."""
        if self.activation_sharding is None:
            return fn(*sharded, *replicated)
        P = jax.sharding.PartitionSpec
        spec = self.activation_sharding.spec
        row_spec = lambda x: P(spec[0], *([None] * (x.ndim - 1)))
        return jax.shard_map(fn, mesh=self.activation_sharding.mesh,
                             in_specs=tuple(map(row_spec, sharded)) + (P(),) * len(replicated),
                             out_specs=spec if len(spec) else P(), check_vma=False)(*sharded, *replicated)

    def constrain(self, x):
        if self.activation_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)
