"""`isojax.measure(model, data, **options) -> Results`: the whole extract job as a library call,
Length: the job's steps (load, loop, read-out, the sentence probe, results) read top down in one place.
read top down: measure() loads, tokenizes and plans the step (run/plan.py) at once; _measure runs
it in four steps (_start, _loop, _read_out, _results). Memory planning lives in device/memory.py,
kernel choice in device/kernel_choice.py, the inputs in run/inputs.py, the centered pass in
run/centered.py.

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

from isojax import faults, storage
from isojax.errors import UserError
from isojax.stats.sample_readout import massive_max_over_sample_median, sample_cka, sample_metrics
from isojax.device.memory import check_fits, choose_mesh, defaults_platform, room_beside
from isojax.device.kernel_choice import CheckRecord, check_mlp_kernel, check_norm_kernel
from isojax.log import log
from isojax.model.options import KernelChoice
from isojax.run.config import KernelConfig, MeasureConfig
from isojax.run.inputs import DEFAULT_MODEL, load, open_tokens, peek_config, row_length, tokenizer_without_weights
from isojax.run.loop import consume, resume
from isojax.run.plan import StepPlan, plan_in_background, run_dtype, run_max_tokens, step_module
from isojax.run.results import Results
from isojax.run.timings import Timings, in_background
from isojax.steps import TRAINED

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


def make_runner(model, mesh, *, token_stats: bool, num_groups: int, sample_size: int = 0, skip_positions: int = 0,
                kernels: KernelChoice = KernelChoice(), step_measures=()):
    """A Runner of a LoadedModel with these kernels, its activations split by rows over every device;
    step_measures: StatsOptions.step_measures (the step measures on)."""
    from isojax.device.runner import Runner
    from isojax.hf.loading import build_module
    from isojax.stats.options import StatsOptions
    return Runner(step_module(build_module(model.config, model.dtype, kernels), mesh), model.params, mesh,
                  token_stats=token_stats, num_groups=num_groups, sample_size=sample_size,
                  options=StatsOptions(skip_positions=skip_positions, step_measures=tuple(step_measures)))


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


def check_options(config: MeasureConfig) -> None:
    """Refuse config's counts that are not positive integers, a skip_positions below 0, an
    isoscore_zeta outside [0, 1] and a bos not auto, on or off."""
    data, stats = config.data, config.stats
    for name, value in (("max_tokens", data.max_tokens), ("max_tokens_per_source", data.max_tokens_per_source),
                        ("batch_tokens", data.batch_tokens), ("seq_len", data.seq_len),
                        ("checkpoint_every_tokens", config.checkpoint.every_tokens),
                        ("intrinsic_k", stats.intrinsic_k)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise UserError(f"{name} must be a positive integer, not {value!r}")
    if not isinstance(stats.isoscore_zeta, (int, float)) or not 0 <= stats.isoscore_zeta <= 1:
        raise UserError(f"isoscore_zeta must be a number from 0 to 1, not {stats.isoscore_zeta!r}")
    skip = stats.skip_positions
    if not isinstance(skip, (int, np.integer)) or skip < 0:
        raise UserError(f"skip_positions must be a non-negative integer, not {skip!r}")
    from isojax.stats.measures import check_optional
    try:
        stats.step_settings()
        check_optional(stats.measures)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    if data.bos not in ("auto", "on", "off"):
        raise UserError(f"bos must be auto, on or off, not {data.bos!r}")


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
    results = start_measure(model, data, **kwargs)
    results.wait()
    return results


def start_measure(model=None, data=None, *, ahead=None, **kwargs) -> Results:
    """measure()'s Results, the per-source metrics perhaps still being read out on a thread beside
    (Results.wait; Results.save draws and writes what does not need them meanwhile): the command
    line's and the sweeps' way. ahead: a sweep's LoadAhead (run/load_ahead.py), which may hold this
    run's tokenizer and weights read already, and reads the sweep's next checkpoint once this run's
    loop has begun."""
    import jax

    from isojax.data import TokenStream, load_corpus

    if isinstance(model, MeasureConfig):
        if data is not None or kwargs:
            raise TypeError("measure(config) takes no other arguments")
        config = model
    else:
        config = MeasureConfig.build(model, data, **kwargs)
    model, revision, unit, seq_len = config.model.model, config.model.revision, config.data.unit, config.data.seq_len
    attention, progress = config.kernels.attention, config.progress
    timings = Timings()
    use_compilation_cache()
    on_accel = defaults_platform() != "cpu"
    dtype = run_dtype(config, on_accel)
    if attention in ("cudnn", "packed") and dtype != "bfloat16":
        raise UserError(f"attention {attention} needs dtype bfloat16 (its kernel has no float32 version)")
    if attention == "packed" and jax.default_backend() != "gpu":
        raise UserError("attention packed is a GPU kernel; this run has no GPU")
    with timings("compile"):
        from isojax.hf.loading import cache_root
        check_mlp_kernel(config.kernels.mlp, dtype, CheckRecord(cache_root() / "kernel_checks"))
        check_norm_kernel(config.kernels.norm, dtype)
    auto_attention = attention == "auto"
    if auto_attention:  # packed (else cuDNN) on GPUs in bf16, Pallas flash attention on TPUs, else plain
        attention = {"gpu": "packed" if dtype == "bfloat16" else "xla", "tpu": "pallas"}.get(jax.default_backend(), "xla")
    check_options(config)
    corpus = load_corpus(config.data.data, unit=unit, sources=config.data.sources,
                         max_tokens=run_max_tokens(config, on_accel),
                         max_tokens_per_source=config.data.max_tokens_per_source)  # checks every path first
    with timings("load"):
        name = model if isinstance(model, str) or model is None else None
        early = peek_config(name or DEFAULT_MODEL) if name is not None or model is None else model.config
        mesh = choose_mesh(early, config, dtype, corpus, row_length(early, unit, seq_len) if early is not None else 0)
        found = ahead.tokenizer(name, early) if ahead is not None and name is not None else None
        found = found or tokenizer_without_weights(model, early)
    tokens, planned, opening = None, None, None
    plan_for = lambda cfg, row_len, tokens: plan_in_background(
        cfg, config, dtype=dtype, attention=attention, auto_attention=auto_attention, mesh=mesh, row_len=row_len,
        corpus=corpus, tokens=tokens, timings=timings)

    def open_beside(tokenizer, cfg, bos):  # on a thread beside the load (and the plan, which waits for it)
        with timings.beside("tokenize"):
            opened = open_tokens(corpus, tokenizer, row_length(cfg, unit, seq_len), progress, bos)
            faults.reached("tokens_opened")
        return opened

    try:
        if found is not None:  # the token cache opens (tokenizing starts) and the step's plan, while the weights load
            bos = found[2].resolve(config.data.bos, found[1])
            opening = in_background(lambda: open_beside(found[0], early, bos), daemon=True, name="isojax-tokens")
            planned = plan_for(early, row_length(early, unit, seq_len), opening)
        with timings("load"):
            loaded = load(model, revision, dtype, mesh, ahead)  # a LoadedModel given is copied, not changed
        if found is not None:
            loaded.source["tokenizer"] = found[1]
            with timings("tokenize"):  # what the load left of opening the token cache
                tokens = opening.result()
        row_len = row_length(loaded.config, unit, seq_len)
        if tokens is None:
            bos = loaded.bos.resolve(config.data.bos, loaded.source["tokenizer"])
            with timings("tokenize"):
                tokens = open_tokens(corpus, loaded.tokenizer, row_len, progress, bos)
        with timings("compile"):  # what is left of the plan: the part that did not overlap the load
            waited = time.time()
            plan = planned.result() if planned is not None else None
            # not known before the weights (hub ids), or not these shapes (peek_config leaves the name out)
            if plan is None or dataclasses.replace(plan.cfg, name=loaded.config.name) != loaded.config:
                plan = plan_for(loaded.config, row_len, tokens).result()
            plan.seconds["waited"] = time.time() - waited
        # Results.config records the choice resolved: on or off, never auto
        config = config.replace(data={"bos": "off" if bos is None else "on"})
        return _measure(loaded, corpus, tokens, timings, config, plan, row_len=row_len, mesh=mesh, bos=bos,
                        ahead=ahead)
    finally:
        if isinstance(tokens, TokenStream):  # nothing once finished; after an error, stops the build
            tokens.cancel()
        elif tokens is None and opening is not None:  # the load failed: the build stops once it has started
            opening.add_done_callback(_cancel_opened)


def _cancel_opened(opening) -> None:
    """Stop the build of a token stream opened beside a load that failed."""
    from isojax.data import TokenStream
    if opening.exception() is None and isinstance(opening.result(), TokenStream):
        opening.result().cancel()


def _measure(loaded, corpus, tokens, timings, config: MeasureConfig, step: StepPlan, *, row_len, mesh,
             bos: int | None, ahead=None) -> Results:
    """measure() once the weights are loaded, the tokens cached or streaming and the step planned;
    ahead (a sweep's LoadAhead) reads the next checkpoint once the loop has begun."""
    import jax

    from isojax.data import TokenStream, plan_stats

    # the kernels chosen once, by the step's plan: the step runs them, and Results.config records them
    config = config.replace(model={"dtype": loaded.dtype}, devices={"mesh": dict(mesh.shape)},
                            kernels=KernelConfig(step.kernels.attention, step.kernels.mlp, step.kernels.norm))
    streamed = isinstance(tokens, TokenStream)
    finished = lambda: tokens.result() if streamed else tokens
    # the padding fraction, from the plan of the finished cache, computed while the devices work
    padding = in_background(lambda: plan_stats(finished(), rows=step.rows, row_len=row_len))
    runner = _start(loaded, corpus, tokens, timings, config, step, row_len=row_len, mesh=mesh, bos=bos)
    settings = {"model_checksum": loaded.source["checksum"], "corpus": tokens.fingerprint, "rows": step.rows,
                "row_len": row_len, "dtype": loaded.dtype, "token_stats": config.stats.token_stats,
                "max_tokens": step.max_tokens, "devices": mesh.size, "processes": jax.process_count(),
                "mesh": dict(mesh.shape), "sample_states": step.sample_states,
                "skip_positions": int(config.stats.skip_positions), "bos": config.data.bos, "bos_id": bos}
    if config.stats.step_settings():  # only when on: a checkpoint written without any resumes as before
        settings["step_measures"] = dict(config.stats.step_settings())

    def total():  # None while tokenizing: the bar shows count and rate
        if streamed and not tokens.done():
            return None
        return finished().n_tokens  # a budget's tokens only: the cache holds no more (Corpus.budget)

    from isojax.stats.sentences import Probe
    # not in multi-process runs: each process holds only its share of the token cache (data/shares.py)
    probe = Probe(runner.module, runner.params, runner.mesh, row_len) \
        if config.stats.sentence_probe and jax.process_count() == 1 else None
    read_ahead = None
    if ahead is not None:  # the next checkpoint in the room this step's plan leaves on the devices
        room = room_beside(loaded.config, config.stats.token_stats, loaded.dtype, len(step.labels), mesh,
                           step.rows * row_len // mesh.size, step.sample_states, config.stats.step_settings())
        read_ahead = lambda: ahead.start(loaded.dtype, mesh, room)
    done, loop_rate, local = _loop(runner, tokens, total, timings, config, step, row_len=row_len, settings=settings,
                                   probe=lambda: probe and probe.compile_beside(finished), read_ahead=read_ahead)
    with timings("tokenize"):
        if streamed and not tokens.done():
            log("finishing the token cache of the whole corpus")
        cache, plan = finished(), padding.result()
    if cache.source_names != step.labels:
        raise RuntimeError(f"sources {step.labels} read before tokenizing, {cache.source_names} in the token cache")
    log(f"corpus: {cache.n_tokens:,} tokens in {cache.n_sequences:,} {config.data.unit}s, padding "
        f"{plan.padding_fraction:.1%}" + (" (token cache written)" if streamed else ""))
    has_sources = len(step.labels) > 1 or bool(config.data.sources)
    final, pending = _read_out(runner, loaded.config.state_names, cache, timings, config, has_sources,
                               row_len=row_len, rows=step.rows, local=local)
    if probe is None:
        if config.stats.sentence_probe:
            log("multi-process run: no sentence probe (erank, massive_count, ... are null; README \"Measures\")")
    else:
        with timings("finalize"):  # the sentence probe (stats/sentences.py): its forward, then float64 on the host
            from isojax.stats.sentences import probe as sentence_probe
            try:
                per_state, final["sentences"] = sentence_probe(cache, probe, loaded.tokenizer)
            except Exception as e:  # e.g. out of device memory: the loop's results are kept, the probe's null
                log(f"warning: the sentence probe failed ({type(e).__name__}: {e}); erank, massive_count, ... are null")
                per_state = []
            for layer, extra in zip(final["layers"], per_state):
                layer.update(extra)
            if per_state:
                _add_init_erank(final, loaded, runner, cache, tokens.fingerprint, row_len)
    return _results(loaded, runner, corpus, tokens, cache, plan, timings, config, step, done=done,
                    loop_rate=loop_rate, final=final, settings=settings, has_sources=has_sources, pending=pending)


_INIT_ERANKS: dict = {}  # per model shape, dtype, mesh, token cache and row length: once in a sweep's process


def _add_init_erank(final: dict, loaded, runner, cache, corpus: str, row_len: int) -> None:
    """Each layer's erank_init: the sentence probe's erank (the same sentences) through a random
    initialization of the model's config as Hugging Face's from_config draws it (loading.from_config_params,
    seed sweep_files.INIT_SEED), the baseline of diff_erank where a sweep has no step0,
    as Wei et al. measure an untrained model; metrics.json's sentences["init_seed"] records the seed.
    Computed once per process for a model shape and token cache (a sweep's checkpoints share it)."""
    from isojax.hf.loading import from_config_params
    from isojax.run.sweep_files import INIT_SEED
    from isojax.stats.sentences import Probe
    from isojax.stats.sentences import probe as sentence_probe
    key = (loaded.config, loaded.dtype, runner.module.options, runner.mesh, corpus, row_len)
    if key not in _INIT_ERANKS:
        log(f"Diff-eRank's baseline: the same sentences through a random initialization of the config (seed {INIT_SEED})")
        try:
            params = from_config_params(loaded.config, loaded.dtype, seed=INIT_SEED, mesh=runner.mesh)
            per_state, _ = sentence_probe(cache, Probe(runner.module, params, runner.mesh, row_len), loaded.tokenizer)
            del params
            _INIT_ERANKS[key] = [s.get("erank") for s in per_state]
        except Exception as e:  # e.g. out of device memory: erank_init null, the run's results kept
            log(f"warning: the random initialization's erank failed ({type(e).__name__}: {e}); erank_init is null")
            _INIT_ERANKS[key] = [None] * len(final["layers"])
    for layer, e in zip(final["layers"], _INIT_ERANKS[key]):
        layer["erank_init"] = e
    final["sentences"]["init_seed"] = INIT_SEED


def _start(loaded, corpus, tokens, timings, config: MeasureConfig, step: StepPlan, *, row_len, mesh, bos):
    """The run's opening lines, its last refusals (skip_positions, memory), and its Runner, with
    the step compiled ahead where it takes these parameters."""
    import jax

    from isojax.data import TokenStream
    from isojax.device import ahead
    cfg, dtype = loaded.config, loaded.dtype
    # a local directory may hold trained or random weights: only a hub checkpoint is known to be trained
    weights = "weights from a local checkpoint" if loaded.weights == TRAINED and loaded.source.get("path") \
        and Path(str(loaded.source["name"])).expanduser().is_dir() else f"{loaded.weights} weights"
    log(f"model {loaded.source['name']} ({weights}, {cfg.num_layers} layers, d={cfg.hidden_size}), "
        f"{dtype}, devices: {mesh.size} x {mesh.devices.flat[0].device_kind}, processes: {jax.process_count()}")
    size = "tokenizing while the devices measure (first run)" if isinstance(tokens, TokenStream) else \
        f"{tokens.n_tokens:,} tokens in {tokens.n_sequences:,} {config.data.unit}s"
    log(f"corpus {corpus.describe()}: {size}, sources: {', '.join(step.labels)}; "
        f"{'no BOS' if bos is None else f'BOS {bos} before each {config.data.unit}'}; rows {step.rows} x {row_len}, "
        f"attention {step.kernels.attention}, MLP {step.kernels.mlp}, LayerNorms {step.kernels.norm}")
    skip = int(config.stats.skip_positions)
    check_skip_positions(tokens, skip)
    check_fits(cfg, config.stats.token_stats, dtype, len(step.labels), mesh, step.rows * row_len // mesh.size,
               verbose=True, sample_size=step.sample_states, step_measures=config.stats.step_settings())
    with timings("compile"):  # the step's setup: parameters placed, accumulators allocated (their init compiles)
        runner = make_runner(loaded, mesh, token_stats=config.stats.token_stats, num_groups=len(step.labels),
                             sample_size=step.sample_states, skip_positions=skip, kernels=step.kernels,
                             step_measures=config.stats.step_settings())
    if ahead.matches(ahead.runner_signature(runner, step.rows, row_len), step.signature):
        runner.use_compiled(step.executable)
    else:  # e.g. a checkpoint whose parameter tree is not its config's: the step compiles at its first batch
        log("the step compiled ahead does not take these parameters: compiling it again")
    s = step.seconds
    log(f"step planned beside the load in {s['total']:.1f} s (compile {s['compile']:.1f} s, kernels "
        f"{s['kernels']:.1f} s, sample's tokens {s['tokens']:.1f} s), {s['waited']:.1f} s of it waited for")
    return runner


def _loop(runner, tokens, total, timings, config: MeasureConfig, step: StepPlan, *, row_len, settings,
          probe=lambda: None, read_ahead=None):
    """Feed every batch to the devices (resumed from, and checkpointed into, the checkpoint
    directory): (done, the loop's tokens/s, this process's rows in a multi-process run or None).
    probe(): starts the sentence probe's compile beside the loop (on accelerators); read_ahead():
    a sweep's next checkpoint read beside the loop; both once the first batch is done."""
    import jax

    from isojax.data import pack_batches
    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    from isojax.stats import finalize as finalize_lib
    directory, every = config.checkpoint.directory, config.checkpoint.every_tokens
    cursor, done = None, {"tokens": 0, "sequences": 0, "batches": 0}
    if config.checkpoint.resume:
        cursor, done = resume(runner, storage.path(directory), settings, done)
    elif directory is not None and parallel.is_main_process():
        checkpointing.clear(storage.path(directory))
    local = parallel.local_rows(runner.mesh, step.rows) if jax.process_count() > 1 else None
    # with a checkpoint directory, SIGTERM (preemption) checkpoints too, periodic checkpoints or not
    checkpointer = checkpointing.Checkpointer(storage.path(directory)) if directory is not None else None
    if every:
        checkpointer.reserve(runner.acc)
    # matplotlib loads while the devices work (0.3-0.9 s of the demo's after-loop time otherwise)
    in_background(lambda: importlib.import_module("isojax.plots"))
    # and, on accelerators, the float64 read-outs compile beside the loop from its start, the sentence
    # probe once the first batch is done (compiled after the loop, a first run's read-outs took seconds)
    on_accel = jax.default_backend() != "cpu"
    if on_accel:
        in_background(lambda: finalize_lib.compile_ahead(runner.gram_shape(), len(step.labels), step.sample_states,
                                                         runner.readout_device(), config.stats.measures))
    after_first = [f for f in (probe if on_accel else None, read_ahead) if f is not None]
    started = dict(done)
    with timings("loop"):
        try:
            done, first = consume(
                runner, pack_batches(tokens, rows=step.rows, row_len=row_len, start_cursor=cursor, row_subset=local),
                done, total, checkpoint_every=every, progress=config.progress,
                after_first_step=(lambda: [f() for f in after_first]) if after_first else None, save_checkpoint=None if checkpointer is None else lambda d, c:
                checkpointer.save(d["batches"], runner.acc, {"settings": settings, "cursor": c, "done": d}))
        finally:
            if checkpointer is not None:
                checkpointer.close()
    # the loop's tokens/s leaves out the first step (a compile, or an executable's first run): this
    # run's batches after the first, at their mean size, over their time; None with one batch (nothing to time)
    steady = timings["loop"] - first
    batches = done["batches"] - started["batches"]
    loop_rate = (done["tokens"] - started["tokens"]) * (batches - 1) / batches / steady \
        if batches > 1 and steady > 0 else None
    if not runner.compiled_ahead:  # the step compiled at its first batch: that batch's time is the compile's
        timings["loop"] -= first
        timings["compile"] += first
    return done, loop_rate, local


def _read_out(runner, state_names, cache, timings, config: MeasureConfig, has_sources: bool, *, row_len, rows,
              local) -> tuple:
    """(finalize's metrics of the merged accumulators, the sample's, and the centered pass's; the
    Future of their per-source metrics, read out on a thread, or None)."""
    from isojax.run.centered import centered_pass
    from isojax.stats.finalize import finalize_whole
    intrinsic = bool(config.stats.sample_states)
    with timings("merge"):
        acc = runner.merged_layers()
        token = runner.token_readout()
        sampled = runner.sample()
    with timings("finalize"):
        final, finish_groups = finalize_whole(acc, state_names, cache.source_names if has_sources else None,
                                              token=token, isoscore_zeta=config.stats.isoscore_zeta,
                                              bf16=config.model.dtype == "bfloat16")
        step_sums = runner.step_sums(acc)
        if step_sums:  # the step measures' sums added over the devices, in float64, read out
            from isojax.stats.measures import step_readout, with_steps_by_source
            step_readout(final, step_sums, dict(config.stats.step_settings()), int(acc.layer_count()[0]))
            finish_groups = with_steps_by_source(final, finish_groups, step_sums,
                                                 cache.source_names if has_sources else ())
        # the per-source reductions on the devices, while the host goes on (Results.save draws and writes)
        pending = None if finish_groups is None else in_background(
            lambda: _timed_beside(timings, "finalize", finish_groups), name="isojax-sources")
        if sampled is not None:
            count, states = sampled
            for layer, extra in zip(final["layers"], sample_metrics(states, count, state_names, intrinsic,
                                                                    k=config.stats.intrinsic_k,
                                                                    extra=config.stats.measures)):
                layer.update(extra)
                layer["massive_max_over_sample_median"] = massive_max_over_sample_median(layer)
            final["cka"] = sample_cka(states, count, state_names)
            if intrinsic:
                final["sample"], final["sample_keys"] = states, runner.sample_keys()
                final["sample_tokens"] = _sample_identity(final["sample_keys"], cache)
    if config.stats.centered:
        final = centered_pass(final, acc, runner, cache, rows, row_len, local, timings, config.progress)
    return final, pending


def _sample_identity(keys, cache):
    """A Future of the sampled tokens' sequence ids, positions and token ids (stats.sample.identify),
    recovered on a thread from the token cache while the run goes on; None in a multi-process run
    (each process holds only its share of the tokens: samples.zarr has the keys only). Not on a
    daemon thread: measure() returns before it is done, and JAX still running on a daemon thread
    when the interpreter finalizes aborts the process."""
    from isojax.data import TokenCache
    from isojax.stats.sample import identify
    if keys is None or not isinstance(cache, TokenCache):
        return None

    def run():
        faults.reached("sample_identify")
        return identify(keys, cache.offsets, cache.tokens)

    return in_background(run, name="isojax-sample-ids")


def _timed_beside(timings, phase: str, fn) -> None:
    with timings.beside(phase):
        fn()


def _results(loaded, runner, corpus, tokens, cache, plan, timings, config: MeasureConfig, step: StepPlan, *, done,
             loop_rate, final, settings, has_sources, pending) -> Results:
    """Results of the run: metrics.json's document, the manifest and the per-token sums asked for."""
    from isojax.data import TokenStream
    from isojax.run.manifest import build_manifest, build_metrics
    metrics = build_metrics(loaded, config.data.unit, done, final, has_sources)
    metrics["bos"] = config.data.bos  # on or off: a BOS token before each unit (--bos, resolved)
    loop_s = timings["loop"] + timings["compile"]
    manifest = build_manifest(loaded, step.kernels, cache, corpus, done, plan, loop_s, time.time() - timings.start,
                              settings)
    manifest["from_cache"] = not isinstance(tokens, TokenStream) and tokens.from_cache
    manifest["step_plan_s"] = step.seconds  # made beside the load; "waited": its part in timings' compile
    manifest["tokens_per_second"] = loop_rate  # the rate the last log line gives
    manifest["bad_records_skipped"] = cache.meta["bad_records"]  # a cached run reads no records
    manifest["measures"] = list(config.stats.measures)  # the read-outs --measure turned on (run/sweep_files.read_out)
    if hasattr(cache, "hosts"):  # what each process read (data/shares.py)
        manifest["host_shares"] = [{k: h[k] for k in ("bytes", "tokens", "sequences", "from_cache")}
                                   for h in cache.hosts]
    sums = runner.token_sums if config.stats.save_token_sums and config.stats.token_stats else None
    return Results(metrics, manifest, final, loaded.config.state_names, timings, sums, config, pending)
