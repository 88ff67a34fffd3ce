"""Trace-time settings of the statistics: one frozen, hashable object handed to the step.

Everything here but skip_positions and step_measures changes what is compiled, never what is measured: every such
setting gives the same metrics within the float32 error bounds of README "Precision"
(tests/test_stats.py runs the non-default ones against float64). Shapes (groups, vocabulary, centered pass) come from the
accumulators themselves, not from here.
"""

from __future__ import annotations

import dataclasses

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
    # rounds). None: a quarter of a device batch of up to 65,536 tokens (the ~15k distinct tokens
    # of a 65k-token batch of text in one round), beyond that growing as n^0.6 like the distinct
    # tokens themselves (token_sums.exchange_cap), never more than an owner holds.
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
    # The first skip_positions positions of every sequence are left out of every statistic (they
    # stay in the forward): the step masks them out of the rows its statistics count. Unlike the
    # settings above, this one changes what is measured (--skip-positions).
    skip_positions: int = 0
    # The step measures on (stats/measures: base.Step), as (module name, setting > 0) pairs in the
    # registry's order (measures.step_settings); (): none, and the step's program is the one without
    # any. Changes what is measured.
    step_measures: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if self.segment_sum not in ("auto", "scan", "scatter"):
            raise ValueError(f"segment_sum must be auto, scan or scatter, not {self.segment_sum!r}")
        if self.gram_precision not in ("highest", "bf16x6"):
            raise ValueError(f"gram_precision must be highest or bf16x6, not {self.gram_precision!r}")
        if self.token_shards > 1 and not self.token_axes:
            raise ValueError("token_shards > 1 needs the mesh axes the tokens are sharded over")
        if not isinstance(self.skip_positions, int) or self.skip_positions < 0:
            raise ValueError(f"skip_positions must be a non-negative integer, not {self.skip_positions!r}")
        if not all(isinstance(name, str) and isinstance(setting, int) and setting > 0
                   for name, setting in self.step_measures):
            raise ValueError(f"step_measures must be (name, positive integer) pairs, not {self.step_measures!r}")
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
