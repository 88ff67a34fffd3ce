"""`isojax.measure(model, data, **options) -> Results`: the whole extract job as a library call.
Length: one run's orchestration (measure, _measure, the centered pass), read top down; memory planning
lives in device/memory.py, kernel choice in kernels/select.py.

    results = isojax.measure("pythia-160m", ["enron.jsonl.zst"], revision="step143000", max_tokens=10**7)
    results.layers[-1]["inter_sim"]        # metrics.json's layers
    results.save("out/160m")              # metrics.json, layers.csv, tokens.zarr, spectra.npz, plots/
    results.plot("plots/")

`python -m isojax.extract` is a thin command line over it. Every process of a multi-host run
calls measure (the devices need them all); only process 0 should save.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from pathlib import Path

import numpy as np

from isojax import storage
from isojax.errors import UserError
from isojax.stats.finalize import massive_ratio, sample_cka, sample_metrics
from isojax.device.memory import check_fits, choose_mesh, defaults_platform
from isojax.kernels.select import check_mlp_kernel, check_norm_kernel
from isojax.log import log
from isojax.run.config import KernelConfig, MeasureConfig
from isojax.run.loop import consume, resume
from isojax.run.plan import StepPlan, plan_in_background, run_max_tokens, step_module
from isojax.run.timings import Timings, in_background
from isojax.steps import TRAINED

DEFAULT_MODEL = "pythia-70m"


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

    def save(self, out, *, overwrite: bool = False, plots: bool = True, parquet: bool = False) -> Path:
        """Write the results into `out` (staged, then committed in one step; isojax.run.outdir):
        refused where isojax's results are already, unless overwrite; the user's files in `out`
        are never touched. `parquet`: layers.parquet beside layers.csv."""
        from isojax.run import outdir
        from isojax.run.results import result_names, write_results
        out = storage.path(out)
        names = result_names(self.final, plots, parquet)
        with outdir.claim(out, overwrite=overwrite, names=names, flag="overwrite=True"):
            self.manifest["timings"] = self.timings
            write_results(out, self.metrics, self.manifest, self.final, self.state_names, self.token_sums,
                          plots=plots, timings=self.timings, parquet=parquet)
        self.manifest["seconds_wall"] = time.time() - self.timings.start
        return out

    def join_save(self) -> None:
        """On the processes other than 0 of a multi-host run: take part, in the same order, in the
        gathers across processes that `save` makes on process 0 (per-token sums, the sample)."""
        for gather in (self.token_sums, self.final.get("sample")):
            for s in range(len(self.state_names) if gather is not None else 0):
                gather(s)

    def plot(self, out_dir) -> list[Path]:
        from isojax.plots import plot_metrics
        return plot_metrics(self.metrics, Path(out_dir))


def use_compilation_cache() -> None:
    """Keep compiled programs under the isojax cache (ISOJAX_CACHE/xla): a second run of the same
    model and batch shape skips XLA's compiles, the small float64 read-outs included (on 2 CPU
    cores they were a third of the demo's time after the loop). JAX_COMPILATION_CACHE_DIR, if set,
    wins. Not in multi-process runs: JAX writes the cache from process 0 only, so a later run finds
    the step in process 0's cache alone, unless every process shares one directory; process 0 then
    skips the compile the others do, and XLA, which shards GPU autotuning over the processes of a
    compile, can wait on it forever (bench/RESULTS.md 7e)."""
    import jax

    from isojax.hf.loading import cache_root
    if jax.config.jax_compilation_cache_dir:
        return
    if jax.process_count() > 1:
        log("multi-process run: no persistent compilation cache (set JAX_COMPILATION_CACHE_DIR to one "
            "directory all processes share to keep one)")
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def peek_config(name: str):
    """The model's config without loading weights, where that is cheap (presets, local dirs)."""
    from isojax.hf.family import read_hf_config
    from isojax.hf.family.presets import base_preset, preset
    if name.startswith("random:") or base_preset(name):
        return preset(name.removeprefix("random:"))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return read_hf_config(path)
    return None


def load(model, revision, dtype: str, attention: str, mesh):
    from isojax.hf.loading import LoadedModel, load_model, place
    if isinstance(model, LoadedModel):
        model.params = place(model.params, dtype, mesh)
        model.dtype, model.attention_impl = dtype, attention
        return model
    if model is not None:
        return load_model(model, revision=revision, dtype=dtype, attention_impl=attention, mesh=mesh)
    try:
        return load_model(DEFAULT_MODEL, revision=revision, dtype=dtype, attention_impl=attention, mesh=mesh)
    except UserError as e:  # offline and not cached: the demo runs on random weights, saying why
        from isojax.hf.network import hub_reachable
        if hub_reachable():  # the hub answered: its refusal (unknown revision, an error) is the user's to see
            raise
        log(f"could not load {DEFAULT_MODEL} ({e})")
        log("*" * 72)
        log(f"WARNING: RANDOM WEIGHTS of {DEFAULT_MODEL}'s shapes: the results describe an untrained model")
        log("*" * 72)
        return load_model(f"random:{DEFAULT_MODEL}", dtype=dtype, attention_impl=attention, mesh=mesh)


def make_runner(model, mesh, *, token_stats: bool, num_groups: int, centers_SxD=None, sample_size: int = 0,
                skip_positions: int = 0):
    """A Runner whose activations stay split by rows over every device."""
    from isojax.device.runner import Runner
    from isojax.stats.options import StatsOptions
    return Runner(step_module(model.module, mesh), model.params, mesh, token_stats=token_stats, num_groups=num_groups,
                  centers_SxD=centers_SxD, sample_size=sample_size, options=StatsOptions(skip_positions=skip_positions))


def check_skip_positions(tokens, skip: int) -> None:
    """Refuse skip_positions that leave out every token: no sequence (window) longer than it. From
    the cache's lengths; on a first run, from the sequences tokenized so far, waiting only until
    one is longer than `skip` (or the whole corpus is tokenized)."""
    from isojax.data import TokenStream
    if not skip:
        return
    seen, longest, finished = 0, 0, not isinstance(tokens, TokenStream)
    cache = tokens
    while True:
        if not finished:
            cache, finished = tokens.wait(seen)
        lengths = np.diff(cache.offsets[seen:cache.n_sequences + 1])
        longest = max(longest, int(lengths.max()) if lengths.size else 0)
        if longest > skip or finished:
            break
        seen = cache.n_sequences
    if longest <= skip:
        raise UserError(f"skip_positions {skip} leaves out every token: the longest sequence is {longest} tokens "
                        "long (--skip-positions must be less than that)")


def tokenizer_without_weights(model, cfg):
    """(tokenizer, description) where it is found without loading the weights (random presets,
    local checkpoint directories, a LoadedModel), so that tokenizing starts while they load; else None."""
    from isojax.hf.family.presets import hub_id
    from isojax.hf.loading import LoadedModel
    from isojax.hf.tokenizer import load_tokenizer
    if isinstance(model, LoadedModel):
        return model.tokenizer, model.source["tokenizer"]
    if model is None or cfg is None:
        return None
    if model.startswith("random:"):
        return load_tokenizer(None, cfg, hub_repo=hub_id(cfg.name))
    path = Path(model).expanduser()
    return load_tokenizer(path, cfg) if path.is_dir() else None


def row_length(cfg, unit: str, seq_len) -> int:
    row_len = seq_len or (512 if unit == "sentence" else cfg.max_position_embeddings)
    if row_len > cfg.max_position_embeddings:
        raise UserError(f"seq_len must be in [1, {cfg.max_position_embeddings}] (the model's context)")
    return row_len


def open_tokens(corpus, tokenizer, row_len: int, progress: bool):
    """The corpus's token cache, or a TokenStream building it (a first run) that the devices
    follow. A hub dataset is tokenized first: knowing its sources up front (Corpus.labels)
    would cost a second download. In a multi-process run each process reads only its share
    (data/shares.py), where the corpus allows (Corpus.shareable)."""
    import jax

    from isojax.data import stream_tokens, tokenize_corpus
    from isojax.data.shares import HostShare
    from isojax.hf.loading import cache_root
    where = dict(cache_dir=cache_root() / "tokens", max_len=row_len)
    if jax.process_count() > 1 and corpus.shareable():
        return HostShare(corpus, tokenizer, progress=progress, **where)
    if any(inp.kind == "hub" for inp in corpus.inputs):
        return tokenize_corpus(corpus, tokenizer, progress=progress, **where)
    return stream_tokens(corpus, tokenizer, **where)


def measure(model=None, data=None, **kwargs) -> Results:
    """Measure every hidden state of `model` over `data` (README "A real run"): measure(config), one
    MeasureConfig (isojax.run.config), or measure(model, data, **kwargs) with MeasureConfig.build's
    keyword arguments.

    model: preset, random:<preset>, directory, hub id or a LoadedModel; None: pythia-70m
    (random weights of its shapes offline). data: paths or hub: specs; None: CPython's bundled
    documentation (on CPU the first CPU_DEFAULT_MAX_TOKENS tokens unless max_tokens). mesh:
    {"data": N, "model": M} or None (chosen from the devices' memory). sample_states: keep a
    uniform sample of K tokens' states (stats/sample.py) for intrinsic dimension (k = intrinsic_k
    neighbours) and batch anisotropy, written to samples.zarr; None: on accelerators a default
    sample for the batch anisotropy only (default_sample_size), on CPU none; 0: none.

    A first run (no token cache yet) tokenizes while the devices measure: the batches follow
    the growing cache (data.TokenStream) and are those a later, cached run packs."""
    import jax

    from isojax.data import TokenStream, load_corpus

    if isinstance(model, MeasureConfig):
        if data is not None or kwargs:
            raise TypeError("measure(config) takes no other arguments")
        config = model
    else:
        config = MeasureConfig.build(model, data, **kwargs)
    model, revision, dtype = config.model.model, config.model.revision, config.model.dtype
    data, unit, sources = config.data.data, config.data.unit, config.data.sources
    seq_len, batch_tokens, max_tokens = config.data.seq_len, config.data.batch_tokens, config.data.max_tokens
    token_stats, intrinsic_k = config.stats.token_stats, config.stats.intrinsic_k
    attention, mlp_kernel, norm_kernel = config.kernels.attention, config.kernels.mlp, config.kernels.norm
    mesh, checkpoint_every_tokens, progress = config.devices.mesh, config.checkpoint.every_tokens, config.progress
    timings = Timings()
    use_compilation_cache()
    on_accel = defaults_platform() != "cpu"
    dtype = dtype or ("bfloat16" if on_accel else "float32")
    if attention in ("cudnn", "packed") and dtype != "bfloat16":
        raise UserError(f"attention {attention} needs dtype bfloat16 (its kernel has no float32 version)")
    if attention == "packed" and jax.default_backend() != "gpu":
        raise UserError("attention packed is a GPU kernel; this run has no GPU")
    with timings("compile"):
        check_mlp_kernel(mlp_kernel, dtype)
        check_norm_kernel(norm_kernel, dtype)
    auto_attention = attention == "auto"
    if auto_attention:  # packed (else cuDNN) on GPUs in bf16, Pallas flash attention on TPUs, else plain
        attention = {"gpu": "packed" if dtype == "bfloat16" else "xla", "tpu": "pallas"}.get(jax.default_backend(), "xla")
    for name, value in (("max_tokens", max_tokens), ("max_tokens_per_source", config.data.max_tokens_per_source),
                        ("batch_tokens", batch_tokens), ("seq_len", seq_len),
                        ("checkpoint_every_tokens", checkpoint_every_tokens), ("intrinsic_k", intrinsic_k)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise UserError(f"{name} must be a positive integer, not {value!r}")
    if not isinstance(config.stats.isoscore_zeta, (int, float)) or not 0 <= config.stats.isoscore_zeta <= 1:
        raise UserError(f"isoscore_zeta must be a number from 0 to 1, not {config.stats.isoscore_zeta!r}")
    skip = config.stats.skip_positions
    if not isinstance(skip, (int, np.integer)) or skip < 0:
        raise UserError(f"skip_positions must be a non-negative integer, not {skip!r}")
    corpus = load_corpus(data, unit=unit, sources=sources, max_tokens=run_max_tokens(config, on_accel),
                         max_tokens_per_source=config.data.max_tokens_per_source)  # checks every path first
    with timings("load"):
        name = model if isinstance(model, str) or model is None else None
        early = peek_config(name or DEFAULT_MODEL) if name is not None or model is None else model.config
        mesh = choose_mesh(early, config, dtype, corpus, row_length(early, unit, seq_len) if early is not None else 0)
        found = tokenizer_without_weights(model, early)
    tokens, planned = None, None
    plan_for = lambda cfg, row_len: plan_in_background(cfg, config, dtype=dtype, attention=attention,
                                                       auto_attention=auto_attention, mesh=mesh, row_len=row_len,
                                                       corpus=corpus, tokens=tokens)
    try:
        if found is not None:  # tokenizing starts now, and the step's compile, while the weights load
            with timings("tokenize"):
                tokens = open_tokens(corpus, found[0], row_length(early, unit, seq_len), progress)
            planned = plan_for(early, row_length(early, unit, seq_len))
        with timings("load"):
            loaded = load(model, revision, dtype, attention, mesh)
        if found is not None:
            loaded.source["tokenizer"] = found[1]
        row_len = row_length(loaded.config, unit, seq_len)
        if tokens is None:
            with timings("tokenize"):
                tokens = open_tokens(corpus, loaded.tokenizer, row_len, progress)
        with timings("compile"):  # what is left of the plan: the part that did not overlap the load
            waited = time.time()
            plan = planned.result() if planned is not None else None
            # not known before the weights (hub ids), or not these shapes (peek_config leaves the name out)
            if plan is None or dataclasses.replace(plan.cfg, name=loaded.config.name) != loaded.config:
                plan = plan_for(loaded.config, row_len).result()
            plan.seconds["waited"] = time.time() - waited
        return _measure(loaded, corpus, tokens, timings, config, plan, row_len=row_len, mesh=mesh)
    finally:
        if isinstance(tokens, TokenStream):  # nothing once finished; after an error, stops the build
            tokens.cancel()


def _measure(loaded, corpus, tokens, timings, config: MeasureConfig, step: StepPlan, *, row_len, mesh) -> Results:
    """measure() once the weights are loaded, the tokens cached or streaming and the step planned."""
    import jax

    from isojax.device import ahead
    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    from isojax.data import TokenStream, pack_batches, plan_stats
    from isojax.stats import finalize as finalize_lib
    from isojax.stats.finalize import finalize
    from isojax.run.manifest import build_manifest, build_metrics

    unit, sources = config.data.unit, config.data.sources
    token_stats, centered = config.stats.token_stats, config.stats.centered
    save_token_sums, intrinsic_k = config.stats.save_token_sums, config.stats.intrinsic_k
    intrinsic = bool(config.stats.sample_states)
    rows, labels, max_tokens, sample_states = step.rows, step.labels, step.max_tokens, step.sample_states
    checkpoint_dir, checkpoint_every_tokens = config.checkpoint.directory, config.checkpoint.every_tokens
    resume_run, progress = config.checkpoint.resume, config.progress
    cfg, dtype = loaded.config, loaded.dtype
    n_dev = mesh.size
    # a local directory may hold trained or random weights: only a hub checkpoint is known to be trained
    weights = "weights from a local checkpoint" if loaded.weights == TRAINED and loaded.source.get("path") \
        and Path(str(loaded.source["name"])).expanduser().is_dir() else f"{loaded.weights} weights"
    log(f"model {loaded.source['name']} ({weights}, {cfg.num_layers} layers, d={cfg.hidden_size}), "
        f"{dtype}, devices: {n_dev} x {mesh.devices.flat[0].device_kind}, processes: {jax.process_count()}")
    loaded.attention_impl, loaded.mlp_impl, loaded.norm_impl = step.attention, step.mlp, step.norm
    # chosen once, by the step's plan: the step receives these, and Results.config records them
    config = config.replace(model={"dtype": dtype}, devices={"mesh": dict(mesh.shape)},
                            kernels=KernelConfig(loaded.attention_impl, loaded.mlp_impl, loaded.norm_impl))
    streamed = isinstance(tokens, TokenStream)
    finished = lambda: tokens.result() if streamed else tokens
    # the padding fraction, from the plan of the finished cache, computed while the devices work
    plan = in_background(lambda: plan_stats(finished(), rows=rows, row_len=row_len))
    size = "tokenizing while the devices measure (first run)" if streamed else \
        f"{tokens.n_tokens:,} tokens in {tokens.n_sequences:,} {unit}s"
    log(f"corpus {corpus.describe()}: {size}, sources: {', '.join(labels)}; rows {rows} x {row_len}, "
        f"attention {loaded.attention_impl}, MLP {loaded.mlp_impl}, LayerNorms {loaded.norm_impl}")
    num_groups = len(labels)
    skip = int(config.stats.skip_positions)
    check_skip_positions(tokens, skip)
    check_fits(cfg, token_stats, dtype, num_groups, mesh, rows * row_len // n_dev, verbose=True,
               sample_size=sample_states)
    with timings("compile"):  # the step's setup: parameters placed, accumulators allocated (their init compiles)
        runner = make_runner(loaded, mesh, token_stats=token_stats, num_groups=num_groups, sample_size=sample_states,
                             skip_positions=skip)
    if ahead.matches(ahead.runner_signature(runner, rows, row_len), step.signature):
        runner.use_compiled(step.executable)
    else:  # e.g. a checkpoint whose parameter tree is not its config's: the step compiles at its first batch
        log("the step compiled ahead does not take these parameters: compiling it again")
    s = step.seconds
    log(f"step planned beside the load in {s['total']:.1f} s (compile {s['compile']:.1f} s, kernels "
        f"{s['kernels']:.1f} s, sample's tokens {s['tokens']:.1f} s), {s['waited']:.1f} s of it waited for")
    settings = {"model_checksum": loaded.source["checksum"], "corpus": tokens.fingerprint, "rows": rows,
                "row_len": row_len, "dtype": dtype, "token_stats": token_stats, "max_tokens": max_tokens,
                "devices": n_dev, "processes": jax.process_count(), "mesh": dict(mesh.shape),
                "sample_states": sample_states, "skip_positions": skip}
    cursor, done = None, {"tokens": 0, "sequences": 0, "batches": 0}
    if resume_run:
        cursor, done = resume(runner, storage.path(checkpoint_dir), settings, done)
    elif checkpoint_dir is not None and parallel.is_main_process():
        checkpointing.clear(storage.path(checkpoint_dir))

    def total():  # None while tokenizing: the bar shows count and rate
        if streamed and not tokens.done():
            return None
        return finished().n_tokens  # a budget's tokens only: the cache holds no more (Corpus.budget)

    local = parallel.local_rows(mesh, rows) if jax.process_count() > 1 else None
    # with a checkpoint directory, SIGTERM (preemption) checkpoints too, periodic checkpoints or not
    checkpointer = checkpointing.Checkpointer(storage.path(checkpoint_dir)) if checkpoint_dir is not None else None
    if checkpoint_every_tokens:
        checkpointer.reserve(runner.acc)
    # matplotlib loads while the devices work (0.3-0.9 s of the demo's after-loop time otherwise)
    in_background(lambda: importlib.import_module("isojax.plots"))
    # and, on accelerators, the float64 read-outs compile once the step has (a first run's finalize
    # took ~3 s longer than a cached run's, compiling them after the loop)
    heads, where = runner.acc.m2_HxSxDxD.hl.shape[-5], runner.acc.m2_HxSxDxD.hl.addressable_shards[0].device
    compile_ahead = (lambda: in_background(lambda: finalize_lib.compile_ahead(
        (heads, cfg.num_states, cfg.hidden_size, cfg.hidden_size), num_groups, sample_states, where))) \
        if jax.default_backend() != "cpu" else None
    started = dict(done)
    with timings("loop"):
        try:
            done, first = consume(
                runner, pack_batches(tokens, rows=rows, row_len=row_len, start_cursor=cursor, row_subset=local),
                done, total, checkpoint_every=checkpoint_every_tokens, progress=progress,
                after_first_step=compile_ahead, save_checkpoint=None if checkpointer is None else lambda d, c:
                checkpointer.save(d["batches"], runner.acc, {"settings": settings, "cursor": c, "done": d}))
        finally:
            if checkpointer is not None:
                checkpointer.close()
    timings["loop"] -= first
    # the loop's tokens/s leaves out the first step (its compile): this run's batches after the
    # first, at their mean size, over the loop's time; None with one batch (nothing to time)
    batches = done["batches"] - started["batches"]
    loop_rate = (done["tokens"] - started["tokens"]) * (batches - 1) / batches / timings["loop"] \
        if batches > 1 and timings["loop"] > 0 else None
    timings["compile"] += first
    with timings("tokenize"):
        if streamed and not tokens.done():
            log("finishing the token cache of the whole corpus")
        cache, plan = finished(), plan.result()
    if cache.source_names != labels:
        raise RuntimeError(f"sources {labels} read before tokenizing, {cache.source_names} in the token cache")
    log(f"corpus: {cache.n_tokens:,} tokens in {cache.n_sequences:,} {unit}s, padding {plan.padding_fraction:.1%}"
        + (" (token cache written)" if streamed else ""))
    with timings("merge"):
        acc = runner.merged_layers()
        token = runner.token_readout()
        sampled = runner.sample()
    has_sources = num_groups > 1 or bool(sources)
    with timings("finalize"):
        final = finalize(acc, cfg.state_names, cache.source_names if has_sources else None, token=token,
                         isoscore_zeta=config.stats.isoscore_zeta)
        if sampled is not None:
            count, states = sampled
            for layer, extra in zip(final["layers"], sample_metrics(states, count, cfg.state_names, intrinsic,
                                                                    k=intrinsic_k)):
                layer.update(extra)
                layer["massive_ratio"] = massive_ratio(layer)
            final["cka"] = sample_cka(states, count, cfg.state_names)
            if intrinsic:
                final["sample"] = states
    if centered:
        final = centered_pass(final, acc, loaded, runner, cache, rows, row_len, local, timings, progress)
    metrics = build_metrics(loaded, unit, done, final, has_sources)
    loop_s = timings["loop"] + timings["compile"]
    manifest = build_manifest(loaded, cache, corpus, done, plan, loop_s, time.time() - timings.start, settings)
    manifest["from_cache"] = not streamed and tokens.from_cache
    manifest["step_plan_s"] = step.seconds  # made beside the load; "waited": its part in timings' compile
    manifest["tokens_per_second"] = loop_rate  # the rate the last log line gives
    manifest["bad_records_skipped"] = cache.meta["bad_records"]  # a cached run reads no records
    if hasattr(cache, "hosts"):  # what each process read (data/shares.py)
        manifest["host_shares"] = [{k: h[k] for k in ("bytes", "tokens", "sequences", "from_cache")}
                                   for h in cache.hosts]
    sums = runner.token_sums if save_token_sums and token_stats else None
    return Results(metrics, manifest, final, cfg.state_names, timings, sums, config)


def centered_pass(final, acc, model, runner, cache, rows, row_len, local, timings, progress):
    """Second pass: cosines of x - mean(x), the mean taken from the first pass (float64)."""
    from isojax.data import pack_batches
    from isojax.stats.finalize import finalize
    sums = (np.asarray(acc.sum_GxSxD.hi, np.float64) + np.asarray(acc.sum_GxSxD.lo, np.float64)).sum(0)
    counts = np.array([layer["count"] for layer in final["layers"]], np.float64)
    log("second pass for centered InterSim")
    model.params = runner.params
    second = make_runner(model, runner.mesh, token_stats=False, num_groups=len(cache.source_names),
                         centers_SxD=sums / counts[:, None], skip_positions=runner.options.skip_positions)
    with timings("loop"):
        consume(second, pack_batches(cache, rows=rows, row_len=row_len, row_subset=local),
                {"tokens": 0, "sequences": 0, "batches": 0}, final["layers"][0]["count"], progress=progress,
                desc="centered")
    with timings("finalize"):
        again = finalize(second.merged_layers(), model.config.state_names)
    for layer, other in zip(final["layers"], again["layers"]):
        layer["centered_inter_sim"] = other["centered_inter_sim"]
    return final
