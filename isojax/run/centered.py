"""The second pass of a --centered run: cosines of x - mean(x), the mean from the first pass's
merged accumulators in float64, on a Runner of the first pass's module, params and mesh; its one
measure is stats/measures/centered_inter_sim.py."""

from __future__ import annotations

from isojax.log import log


def centered_pass(final: dict, acc, runner, cache, rows: int, row_len: int, local, timings, progress: bool) -> dict:
    """final with each layer's centered_inter_sim: acc, the first pass's merged accumulators
    (Runner.merged_layers); the cache's batches packed again as the first pass packed them."""
    from isojax.data import pack_batches
    from isojax.device.runner import CENTERED
    from isojax.run.loop import consume
    from isojax.stats.measures import centered_inter_sim
    centers_SxD = acc.means()
    log("second pass for centered InterSim")
    second = runner.second_pass(centers_SxD, len(cache.source_names))
    with timings("loop"):
        consume(second, pack_batches(cache, rows=rows, row_len=row_len, row_subset=local),
                {"tokens": 0, "sequences": 0, "batches": 0}, final["layers"][0]["count"], progress=progress,
                desc="centered")
    with timings("finalize"):
        merged = second.merged_layers()
        again = centered_inter_sim.readout(second.step_sums(merged)[CENTERED], merged.layer_count())
    for layer, other in zip(final["layers"], again, strict=True):
        layer.update(other)
    return final
