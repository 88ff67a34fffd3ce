"""A run's results (Results, what isojax.measure returns) and writing them: metrics.json, layers.csv, per-token
zarr arrays, spectra, manifest, plots. Everything is written into a staging folder and committed into OUT in one
step (isojax.run.outdir), so a failed or killed run never damages earlier results."""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from isojax import storage
from isojax.stats import measures
from isojax.run.config import MeasureConfig
from isojax.run.timings import BESIDE, Timings, in_background


@dataclasses.dataclass
class Results:
    """What a run measured. metrics: metrics.json's document; manifest: provenance and timings;
    final: finalize's output (layers, groups, spectra, per-token arrays)."""

    metrics: dict
    manifest: dict
    final: dict
    state_names: list[str]
    timings: Timings
    token_sums: object = None  # s -> [V, D] float64 per-token unit sums (save_token_sums=True)
    config: MeasureConfig | None = None  # the run's config, with the dtype, mesh and kernels it chose
    # the per-source metrics (metrics["sources"], final["groups"]) still being read out on a thread
    # beside (run/measure.py start_measure): a Future, None once they are in
    pending: object = None

    def wait(self) -> None:
        """Wait for the per-source metrics (their error, if they failed, raised here): the main
        thread's wait counted as "finalize"."""
        if self.pending is not None:
            with self.timings("finalize"):
                self.pending.result()
            self.pending = None

    @property
    def layers(self) -> list[dict]:
        return self.metrics["layers"]

    @property
    def intra_sim_SxV(self) -> np.ndarray | None:
        """Per-token IntraSim of every state (NaN where a token was seen fewer than 2 times)."""
        token = self.final.get("token")
        return None if token is None else token["intra_sim_SxV"]

    @property
    def token_count_V(self) -> np.ndarray | None:
        token = self.final.get("token")
        return None if token is None else token["count_V"]

    @property
    def spectra(self) -> dict:
        return self.final.get("spectra", {})

    def save(self, out, *, overwrite: bool = False, plots: bool = True, parquet: bool = False,
             drawer=None) -> Path:
        """Write the results into `out` (staged, then committed in one step; isojax.run.outdir):
        refused where isojax's results are already, unless overwrite; the user's files in `out`
        are never touched. `parquet`: layers.parquet beside layers.csv. `drawer`: a process pool
        (FigureProcess) that draws the figures, once the per-source metrics are in (detach)."""
        from isojax.run import outdir
        out = storage.path(out)
        names = result_names(self.final, plots, parquet)
        with outdir.claim(out, overwrite=overwrite, names=names, flag="overwrite=True"):
            self.manifest["timings"] = self.timings
            write_results(out, self.metrics, self.manifest, self.final, self.state_names, self.token_sums,
                          plots=plots, timings=self.timings, parquet=parquet, pending=self.pending, drawer=drawer)
        self.pending = None
        self.manifest["seconds_wall"] = time.time() - self.timings.start
        return out

    def detach(self) -> bool:
        """Wait for the per-source read-out and copy what `save` still reads from the devices (the
        sample's states) to the host, so that saving needs neither the devices nor the run's
        accumulators: a sweep saves a checkpoint on a thread while the next one is measured
        (run/sweep.py). False (nothing changed but the wait) where the per-token unit sums are to be
        saved: [S, V, D] float64, too large to hold on the host beside the next checkpoint."""
        self.wait()
        if self.token_sums is not None:
            return False
        states = self.final.get("sample")
        if states is not None:
            held = [np.asarray(states(s)) for s in range(len(self.state_names))]  # [K, D] float32 each
            self.final["sample"] = held.__getitem__
        return True

    def join_save(self) -> None:
        """On the processes other than 0 of a multi-host run: take part, in the same order, in the
        gathers across processes that `save` makes on process 0 (per-token sums, the sample)."""
        self.wait()
        for gather in (self.token_sums, self.final.get("sample")):
            for s in range(len(self.state_names) if gather is not None else 0):
                gather(s)

    def plot(self, out_dir) -> list[Path]:
        from isojax.plots import plot_metrics
        return plot_metrics(self.metrics, Path(out_dir))


def output_names(*, plots: bool, parquet: bool, tokens: bool, samples: bool, cka: bool) -> set[str]:
    """Every name write_results writes in OUT, by what the results hold: the one list of them (the
    pre-check before the model loads, the claim before the write; write_results refuses a name not
    in it)."""
    return ({"metrics.json", "layers.csv", "spectra.npz", "manifest.json"} | ({"plots"} if plots else set())
            | ({"layers.parquet"} if parquet else set()) | ({"tokens.zarr"} if tokens else set())
            | ({"samples.zarr"} if samples else set()) | ({"cka.json"} if cka else set()))


def result_names(final: dict, plots: bool, parquet: bool = False) -> set[str]:
    """The names write_results will write for these results."""
    return output_names(plots=plots, parquet=parquet, tokens=final.get("token") is not None,
                        samples=final.get("sample") is not None, cka=final.get("cka") is not None)


def planned_result_names(config: MeasureConfig, *, plots: bool, parquet: bool, on_accel: bool) -> set[str]:
    """The names config's run may write, known before the model loads (the per-token arrays with
    token stats; the sample's states with sample_states; CKA with any sample: on accelerators the
    default one unless --no-sample)."""
    sample = config.stats.sample_states
    return output_names(plots=plots, parquet=parquet, tokens=config.stats.token_stats, samples=bool(sample),
                        cka=bool(sample) or (sample is None and on_accel))


def output_bytes(cfg, *, token_stats: bool, save_token_sums: bool, sample_states: int) -> int:
    """An upper bound of the bytes a run's results take in --out (uncompressed; the figures and
    JSON files within the 64 MB added): per-token counts and IntraSim [V] + [S, V], unit sums
    [S, V, D] float64 with --save-token-sums, the sample [S, K, D] float32, three spectra [S, D]."""
    S, V, D = cfg.num_states, cfg.vocab_size, cfg.hidden_size
    tokens = 8 * V * (1 + S) + (8 * S * V * D if save_token_sums else 0) if token_stats else 0
    return tokens + 4 * S * sample_states * D + 3 * 8 * S * D + (64 << 20)


def planned_output_bytes(cfg, config: MeasureConfig, on_accel: bool) -> int:
    """output_bytes of config's run of a model of cfg's shapes, with the sample its plan keeps
    (run/plan.py run_sample) known before the corpus is read: the CLI's free-space check."""
    from isojax.run.plan import run_sample
    return output_bytes(cfg, token_stats=config.stats.token_stats, save_token_sums=config.stats.save_token_sums,
                        sample_states=run_sample(cfg, config, on_accel))


def json_safe(x):
    """JSON-safe: NaN/inf -> null, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _band_column(prefix: str, band: dict) -> str:
    """inter_sim_pos_0 for the band [0, 1), inter_sim_pos_1_16 for [1, 16), inter_sim_pos_128_ for
    [128, end)."""
    lo, hi = band.get("lo"), band.get("hi")
    return f"{prefix}_{lo}" if hi is not None and hi == lo + 1 else f"{prefix}_{lo}_{'' if hi is None else hi}"


# Issue 45 changed these: alpha_req's fit (ranks 11-100, weights 1/k), IsoScore*'s C0 and zeta,
# effective_rank's floor (the unfloored one counted float32 noise on rank-deficient states).
BEFORE_FLOOR = ("alpha_req", "isoscore_star", "effective_rank")
# and renamed these: the streamed corpus maximum over the sample's median is not Sun et al.'s ratio
RENAMED = {"massive_ratio": "massive_max_over_sample_median"}


def flat_layer(layer: dict) -> dict:
    """A layer's scalar metrics as one flat row (layers.csv, sweep.csv, isojax.load, the report):
    dicts of scalars flattened (intrinsic_dimension -> intrinsic_dimension_twonn, ...); the top
    rogue dimensions as rogue_dim_1, rogue_share_1, rogue_dim_2, ...; InterSim by position band as
    inter_sim_pos_0, inter_sim_pos_1_16, inter_sim_pos_16_128, inter_sim_pos_128_ (band [lo, hi),
    `_` alone: to the end); other lists (IntraSim by frequency band) are left to metrics.json.
    A layer written before the spectral floor (no `null_eigenvalues`) reads its measures that have
    changed definition since (BEFORE_FLOOR) as null: n/a, not the older quantity under the new name;
    a renamed measure (RENAMED) is read under its new name. massive_dims (the sentence probe's) as one
    string "dim:count dim:count ..." (most massive activations first). Every registered measure
    (isojax.stats.measures) the layer lacks (results of an older isojax) is null (a dict-valued one:
    each of its columns, gride_2, ...)."""
    row = {}
    if "null_eigenvalues" not in layer:
        layer = {**layer, **{k: None for k in BEFORE_FLOOR if k in layer}}
    for k, v in layer.items():
        k = RENAMED.get(k, k)
        if k == "massive_dims" and isinstance(v, list):
            row[k] = " ".join(f"{d.get('dim')}:{d.get('count')}" for d in v if isinstance(d, dict))
        elif isinstance(v, dict):
            row.update({f"{k}_{sub}": x for sub, x in v.items() if not isinstance(x, (list, dict))})
        elif k == "rogue_dims" and isinstance(v, list):
            for i, d in enumerate((d for d in v if isinstance(d, dict)), 1):
                row.update({f"rogue_dim_{i}": d.get("dim"), f"rogue_share_{i}": d.get("share")})
        elif k == "inter_sim_by_position" and isinstance(v, list):
            row.update({_band_column("inter_sim_pos", b): b.get("inter_sim") for b in v if isinstance(b, dict)})
        elif not isinstance(v, list):
            row[k] = v
    for k in measures.dict_valued():  # a dict-valued one read as null (older results): its columns
        if k in row and row[k] is None:
            del row[k]
    return {**row, **{k: None for k in measures.columns() if k not in row}}


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for row in rows:
            w.writerow(["" if row.get(k) is None else row.get(k) for k in keys])


def write_parquet(path: Path, rows: list[dict]) -> None:
    """The rows of a CSV as a Parquet table (--format parquet): the same columns in the same
    order, a missing or null value null, each column typed by pyarrow from its values (ints that
    meet floats become floats)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    keys = list(dict.fromkeys(k for row in rows for k in row))
    columns = {}
    for k in keys:
        values = [row.get(k) for row in rows]
        if any(isinstance(v, float) for v in values) and all(v is None or isinstance(v, (int, float))
                                                           and not isinstance(v, bool) for v in values):
            values = [None if v is None else float(v) for v in values]
        columns[k] = pa.array(values)
    pq.write_table(pa.table(columns), path)


def write_layers_csv(path: Path, layers: list[dict]) -> None:
    """One row per state (flat_layer)."""
    write_csv(path, [flat_layer(layer) for layer in layers])


CHUNK_BYTES = 1 << 22  # the largest chunk of an array written one state at a time: several compress in parallel


def _open_zarr(path: Path, dtype: str, shape: tuple, per_state: bool = False):
    """per_state: for arrays [S, N, D] written one state at a time, chunks of one state (of at most
    CHUNK_BYTES), so that each chunk is compressed once; tensorstore's default chunks span every
    state, each compressed again at every state (17.5 s instead of 0.9 s for a [26, 4096, 1024]
    float32 sample on 2 cores). Readers take the chunks from the array's metadata."""
    import tensorstore as ts
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    if per_state:
        row_bytes = int(np.prod(shape[2:])) * np.dtype(dtype).itemsize
        spec["metadata"] = {"chunks": [1, max(1, min(shape[1], CHUNK_BYTES // max(1, row_bytes))), *shape[2:]]}
    return ts.open(spec, create=True, dtype=dtype, shape=shape).result()


def write_zarr(path: Path, array: np.ndarray) -> None:
    _open_zarr(path, array.dtype.name, array.shape).write(array).result()


def write_token_sums(path: Path, state_sums, num_states: int) -> None:
    """The per-token unit sums [S, V, D] in float64, written one state at a time (all at once in
    float64 they would double the host memory of the accumulators). state_sums(s) -> [V, D]."""
    first = state_sums(0)
    store = _open_zarr(path, "float64", (num_states, *first.shape), per_state=True)
    for s in range(num_states):
        store[s].write(first if s == 0 else state_sums(s)).result()


def _write_data(stage: Path, metrics: dict, final: dict, state_names: list[str], token_sums,
                parquet: bool = False) -> None:
    """Every file but metrics.json and the manifest: none depends on the per-source metrics."""
    write_layers_csv(stage / "layers.csv", json_safe(metrics["layers"]))
    if parquet:
        write_parquet(stage / "layers.parquet", [flat_layer(layer) for layer in json_safe(metrics["layers"])])
    spectra = final.get("spectra", {})
    np.savez(stage / "spectra.npz", state_names=np.array(state_names), **{k: np.asarray(v) for k, v in spectra.items()})
    token = final.get("token")
    if token is not None:
        for name, values in token.items():  # count, intra_sim, the step measures' per-token arrays (base.Step.tokens)
            write_zarr(stage / "tokens.zarr" / name.removesuffix("_V").removesuffix("_SxV"),
                       np.asarray(values, np.int64 if name == "count_V" else np.float64))
        if token_sums is not None:
            write_token_sums(stage / "tokens.zarr" / "unit_sum", token_sums, len(state_names))
    if final.get("cka") is not None:  # linear CKA between the states on the sample
        (stage / "cka.json").write_text(json.dumps(json_safe(final["cka"]), indent=1) + "\n")
    states = final.get("sample")
    if states is not None:  # the uniform sample, [S, K, D] float32, one state at a time
        first = np.asarray(states(0))
        store = _open_zarr(stage / "samples.zarr" / "states", "float32", (len(state_names), *first.shape),
                           per_state=True)
        for s in range(len(state_names)):
            store[s].write(first if s == 0 else np.asarray(states(s))).result()
        if final.get("sample_keys") is not None:  # which tokens: each one's key, a hash of its sequence and position
            write_zarr(stage / "samples.zarr" / "keys", np.asarray(final["sample_keys"], np.uint32))
        if final.get("sample_tokens") is not None:  # and each one's sequence id, position and token id
            for name, values in final["sample_tokens"].result().items():
                write_zarr(stage / "samples.zarr" / name, values)


def _plot(metrics: dict, plot_dir: Path, timings, pending=None) -> list[Path]:
    """The figures of the whole population, then, once `pending` (the per-source metrics' Future,
    or None) is done, those of the sources."""
    from isojax import faults
    from isojax.plots import plot_metrics
    with timings.beside("plots"):
        faults.reached("plots_drawing")
        drawn = plot_metrics(metrics, plot_dir, sources=False)
    if pending is not None:
        pending.result()
    with timings.beside("plots"):
        return drawn + plot_metrics(metrics, plot_dir, layers=False)


class FigureProcess:
    """A process of its own that draws run figures (plot_metrics): a sweep's per-checkpoint figures,
    drawn while the next checkpoint loops, without taking the main process's GIL from the loop's
    host work (drawn on a thread they slowed 410m loops from 2.9-3.0 s to 3.5-3.9 s on an H200,
    bench/RESULTS.md 15). Started (spawned, importing matplotlib) when made; `close` ends it."""

    def __init__(self):
        import multiprocessing
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.pool.submit(_import_plots)

    def draw(self, metrics: dict, plot_dir: Path) -> concurrent.futures.Future:
        """Future of (paths drawn, start and end time.time() of the drawing)."""
        return self.pool.submit(_draw, metrics, str(plot_dir))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _import_plots() -> None:
    import isojax.plots  # noqa: F401 -- matplotlib loaded before the first figure is asked for


def _draw(metrics: dict, plot_dir: str) -> tuple[list[str], float, float]:
    start = time.time()
    from isojax.plots import plot_metrics
    return [str(p) for p in plot_metrics(metrics, Path(plot_dir))], start, time.time()


def write_results(out: Path, metrics: dict, manifest: dict, final: dict, state_names: list[str],
                  token_sums=None, plots: bool = True, timings=None, parquet: bool = False, pending=None,
                  drawer: FigureProcess | None = None) -> list[str]:
    """Stage every file, then commit them into `out` in one step (isojax.run.outdir.staged: isojax's
    earlier results there are replaced, the user's files are left alone).
    `token_sums`: s -> the per-token unit sums of state s, [V, D] float64 (Runner.token_sums), or None.
    `timings` (run.timings.Timings): gets the seconds of "write" and "plots"; the manifest, written last,
    gets them and the wall time. `parquet`: layers.parquet beside layers.csv (--format parquet).
    `pending`: the Future of the per-source metrics (metrics["sources"]) still being read out, or
    None: the files and figures that do not need them are made first, and the wait for them is
    counted as "finalize"; their error, if they failed, is raised here, and nothing is committed.
    `drawer` (FigureProcess, with pending None): the figures are drawn in its process, not on a thread."""
    from isojax.run import outdir
    timings = timings if timings is not None else Timings()
    if not storage.is_remote(out):
        out.mkdir(parents=True, exist_ok=True)
    drawing = None
    with outdir.staged(out) as stage:
        try:
            if plots:  # drawn while the data is written; "plots" counts only the wait for them after
                (stage / "plots").mkdir()
                if drawer is not None:
                    assert pending is None, "the figure process draws once the per-source metrics are in"
                    drawing = drawer.draw(json_safe(metrics), stage / "plots")
                else:
                    drawing = in_background(lambda: _plot(metrics, stage / "plots", timings, pending))
            with timings("write"):
                _write_data(stage, metrics, final, state_names, token_sums, parquet)
            if pending is not None:
                with timings("finalize"):
                    pending.result()
            with timings("write"):
                (stage / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=1) + "\n")
            if drawing is not None:
                with timings("plots"):
                    drawn = drawing.result()
                if drawer is not None:  # the figure process's span, as a thread's would be
                    paths, begun, ended = drawn
                    drawn = [Path(p) for p in paths]
                    timings.timeline.append(["plots" + BESIDE, round(begun - timings.start, 3),
                                             round(ended - timings.start, 3)])
                manifest["plots"] = [str(p.relative_to(stage)) for p in drawn]
            manifest["timings"] = dict(timings)
            manifest["timeline"] = getattr(timings, "timeline", [])
            manifest["seconds_wall"] = time.time() - timings.start
            (stage / "manifest.json").write_text(json.dumps(json_safe(manifest), indent=1) + "\n")
            written = sorted(p.name for p in stage.iterdir())
            unlisted = set(written) - result_names(final, plots, parquet)
            if unlisted:  # a new result file must be in output_names, so that it is checked before any work
                raise RuntimeError(f"write_results wrote {sorted(unlisted)}, which output_names does not list")
            return written
        finally:
            if drawing is not None:  # on a failure, the figures finish before their folder goes
                concurrent.futures.wait([drawing])
