"""python -m isojax.extract: InterSim, IntraSim, anisotropy and more for every hidden state of a
GPT-NeoX model over a corpus, in one pass, resumable. Results go to --out only; logs and the
progress bar to stderr. With no --model and no --data it runs the embedded default: pythia-70m
(random weights of its shapes when the weights can't be had offline) on the documentation
bundled with CPython."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from isojax.errors import UserError, run_command

DEFAULT_MODEL = "pythia-70m"
CPU_DEFAULT_MAX_TOKENS = 50_000  # the embedded default must finish in under two minutes on 2 CPU cores


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m isojax.extract", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="preset (pythia-1.4b, pythia-410m-deduped, ...), random:<preset> "
                    f"(random weights), a local checkpoint directory, or a hub id; default {DEFAULT_MODEL}, "
                    "falling back to random:pythia-70m when offline")
    ap.add_argument("--revision", default=None, help="hub revision (training checkpoint), e.g. step143000")
    ap.add_argument("--data", action="append", default=None, metavar="PATH",
                    help="corpus: .txt, .jsonl[.gz|.zst], .parquet, a folder of shards, or hub:NAME[:CONFIG]:SPLIT; "
                    "repeatable; default: the documentation topics bundled with CPython")
    ap.add_argument("--unit", default="sentence", choices=["sentence", "document"], help="sequence unit")
    ap.add_argument("--source", action="append", default=None, metavar="NAME",
                    help="keep only this Pile source (meta.pile_set_name); repeatable")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="forward compute dtype (default: bfloat16 on accelerators, float32 on CPU); "
                    "statistics are always float32 compensated, finalized in float64")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="packed row length T; longer sequences are split into consecutive windows of "
                    "min(T, context) tokens (default 512 for sentences, the context for documents)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="tokens per batch, rows x T (default on accelerators: 262144 for models of width "
                         "<= 1024, else 65536; 8192 on CPU)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="stop after the batch that reaches this many tokens (whole batches)")
    ap.add_argument("--out", required=True, help="results directory")
    ap.add_argument("--checkpoint-every-tokens", type=int, default=None, metavar="N",
                    help="write accumulators + data cursor atomically under OUT/checkpoint every N tokens")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    ap.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    ap.add_argument("--no-token-stats", action="store_true",
                    help="skip per-token IntraSim (saves (L+2) x V x D x 8 bytes of device memory)")
    ap.add_argument("--centered", action="store_true",
                    help="also compute centered InterSim (cosines of x - mean): a second pass over the data")
    ap.add_argument("--save-token-sums", action="store_true",
                    help="also write the per-token unit-vector sums [L+2, V, D] (float64) to OUT/tokens.zarr")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"],
                    help="attention kernel: auto = cudnn for bfloat16 on GPU, else xla")
    scale = ap.add_argument_group("devices and hosts")
    scale.add_argument("--mesh", default=None, metavar="data=N,model=M",
                       help="device mesh: batch rows are split over all devices; parameters are "
                            "split over 'model' (FSDP) when M > 1. Default: all devices on 'data', "
                            "or the smallest 'model' that makes the parameters and accumulators fit")
    scale.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="multi-host: the coordinator (process 0) address; with --num-processes, --process-id")
    scale.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    scale.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    scale.add_argument("--distributed", action="store_true",
                       help="multi-host: join the run described by the cluster's environment "
                            "(TPU pod slice, SLURM, Open MPI), as jax.distributed.initialize() finds it")
    return ap


def log(msg: str) -> None:
    print(f"isojax: {msg}", file=sys.stderr, flush=True)


def check_out(out: Path, args) -> None:
    has_results = (out / "metrics.json").exists()
    has_ckpt = (out / "checkpoint").exists()
    if args.resume:
        if has_results and not has_ckpt:
            raise UserError(f"{out} holds the results of a finished run: nothing to resume")
        return
    if has_results and not args.overwrite:
        raise UserError(f"{out} already holds results (metrics.json); pass --overwrite to replace them")
    if has_ckpt and not args.overwrite:
        raise UserError(f"{out}/checkpoint holds an unfinished run: pass --resume to continue it "
                        "or --overwrite to start over")


def choose_model(args, dtype: str, attention: str, mesh):
    from isojax.loading import load_model
    if args.model is not None:
        return load_model(args.model, revision=args.revision, dtype=dtype, attention_impl=attention, mesh=mesh)
    try:
        return load_model(DEFAULT_MODEL, revision=args.revision, dtype=dtype, attention_impl=attention, mesh=mesh)
    except UserError as e:  # offline and not cached
        log(f"could not load {DEFAULT_MODEL} ({e})")
        log("*" * 72)
        log(f"WARNING: RANDOM WEIGHTS of {DEFAULT_MODEL}'s shapes: the results describe an untrained model")
        log("*" * 72)
        return load_model(f"random:{DEFAULT_MODEL}", dtype=dtype, attention_impl=attention, mesh=mesh)


def peek_config(name: str):
    """The model's config without loading weights, where that is cheap (presets, local dirs)."""
    from isojax.config import base_preset, preset, read_hf_config
    if name.startswith("random:") or base_preset(name):
        return preset(name.removeprefix("random:"))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return read_hf_config(path)
    return None


def memory_per_device(cfg, args, dtype: str, num_groups: int, n: int, model_axis: int) -> tuple[int, int]:
    """(accumulator bytes, weight bytes) on each of n devices with parameters split model_axis ways."""
    from isojax.runner import MAX_GROUP_SPECTRA, per_device_accumulator_bytes
    need = per_device_accumulator_bytes(cfg, n, num_groups=num_groups, token_stats=not args.no_token_stats,
                                        group_spectra=num_groups <= MAX_GROUP_SPECTRA)
    return need, (2 if dtype == "bfloat16" else 4) * cfg.param_count() // model_axis


def choose_mesh(cfg, args, dtype: str, num_groups: int = 1, verbose: bool = False):
    """The mesh of --mesh, else all devices on 'data' with the smallest 'model' axis that makes
    parameters and accumulators fit; refuses (short message) what cannot fit."""
    import jax

    from isojax import parallel
    from isojax.runner import device_memory_bytes, host_memory_bytes
    n = jax.device_count()
    sizes = parallel.parse_mesh(args.mesh)
    limit = device_memory_bytes() or host_memory_bytes()
    fits = lambda m: sum(memory_per_device(cfg, args, dtype, num_groups, n, m)) <= 0.9 * limit
    if "model" not in sizes and "data" not in sizes:
        sizes["model"] = next((m for m in range(1, n + 1) if n % m == 0 and fits(m)), 1)
    mesh = parallel.make_mesh(sizes)
    check_fits(cfg, args, dtype, num_groups, mesh, verbose)
    return mesh


def check_fits(cfg, args, dtype: str, num_groups: int, mesh, verbose: bool = False) -> None:
    from isojax.runner import device_memory_bytes, host_memory_bytes
    n = mesh.size
    limit = device_memory_bytes() or host_memory_bytes()
    need, weights = memory_per_device(cfg, args, dtype, num_groups, n, mesh.shape["model"])
    if verbose:
        log(f"accumulators need {need / 1e9:.2f} GB per device, weights {weights / 1e9:.2f} GB "
            f"(device memory {limit / 1e9:.1f} GB; mesh data={mesh.shape['data']},model={mesh.shape['model']})")
    if need + weights > 0.9 * limit:
        raise UserError(f"accumulators ({need / 1e9:.1f} GB) and weights ({weights / 1e9:.1f} GB) per device do not "
                        f"fit the device's {limit / 1e9:.1f} GB on {n} device(s); use more devices, a larger "
                        "'model' axis (--mesh), --no-token-stats (per-token IntraSim needs (L+2) x V x D x 8 "
                        "bytes, split over the devices) or a smaller model")


def run(args) -> Path:
    from isojax import parallel
    parallel.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
    import jax

    from isojax import checkpointing
    from isojax.data import load_corpus, pack_batches, plan_stats, tokenize_corpus
    from isojax.finalize import finalize
    from isojax.loading import cache_root
    from isojax.manifest import build_manifest, build_metrics
    from isojax.results import write_results

    t_start = time.time()
    out = Path(args.out)
    check_out(out, args)
    on_accel = jax.default_backend() != "cpu"
    dtype = args.dtype or ("bfloat16" if on_accel else "float32")
    if args.attention == "cudnn" and dtype != "bfloat16":
        raise UserError("--attention cudnn needs --dtype bfloat16 (cuDNN's fused attention has no float32 kernel)")
    attention = args.attention
    if attention == "auto":
        attention = "cudnn" if (on_accel and dtype == "bfloat16" and jax.default_backend() == "gpu") else "xla"
    n_dev = jax.device_count()
    early = peek_config(args.model or DEFAULT_MODEL)
    # refuse before allocating weights when parameters and accumulators cannot fit
    mesh = choose_mesh(early, args, dtype) if early is not None else parallel.make_mesh(parallel.parse_mesh(args.mesh))
    model = choose_model(args, dtype, attention, mesh)
    cfg = model.config
    log(f"model {model.source['name']} ({model.weights} weights, {cfg.num_layers} layers, d={cfg.hidden_size}), "
        f"{dtype}, devices: {n_dev} x {jax.devices()[0].device_kind}, processes: {jax.process_count()}")

    row_len = args.seq_len or (512 if args.unit == "sentence" else cfg.max_position_embeddings)
    if not 1 <= row_len <= cfg.max_position_embeddings:
        raise UserError(f"--seq-len must be in [1, {cfg.max_position_embeddings}] (the model's context)")
    if args.attention == "auto" and model.attention_impl == "cudnn" and row_len % 64:
        model.attention_impl = "xla"  # cuDNN attention was only measured on rows of multiples of 64
    # small models are bound by per-kernel overheads: larger batches (bench/RESULTS.md); the
    # default is per device, so that each device keeps its batch as devices are added
    batch_tokens = args.batch_tokens or n_dev * ((262144 if cfg.hidden_size <= 1024 else 65536) if on_accel else 8192)
    rows = max(1, batch_tokens // row_len)
    rows = -(-rows // n_dev) * n_dev
    corpus = load_corpus(args.data, unit=args.unit, sources=args.source)
    cache = tokenize_corpus(corpus, model.tokenizer, cache_dir=cache_root() / "tokens", max_len=row_len)
    plan = plan_stats(cache, rows=rows, row_len=row_len)
    log(f"corpus {corpus.describe()}: {cache.n_tokens:,} tokens in {cache.n_sequences:,} {args.unit}s, "
        f"sources: {', '.join(cache.source_names)}; rows {rows} x {row_len}, padding {plan.padding_fraction:.1%}, "
        f"attention {model.attention_impl}")

    num_groups = len(cache.source_names)
    check_fits(cfg, args, dtype, num_groups, mesh, verbose=True)
    runner = make_runner(model, mesh, token_stats=not args.no_token_stats, num_groups=num_groups)

    if args.max_tokens is None and args.data is None and not on_accel:
        args.max_tokens = CPU_DEFAULT_MAX_TOKENS
        log(f"embedded default corpus on CPU: the first {args.max_tokens:,} tokens (--max-tokens to change)")
    settings = {"model_checksum": model.source["checksum"], "corpus": cache.fingerprint, "rows": rows,
                "row_len": row_len, "dtype": dtype, "token_stats": not args.no_token_stats,
                "max_tokens": args.max_tokens, "devices": n_dev, "processes": jax.process_count()}
    cursor, done = None, {"tokens": 0, "sequences": 0, "batches": 0}
    ckpt_dir = out / "checkpoint"
    if args.resume:
        cursor, done = resume(runner, ckpt_dir, settings, done)
    elif ckpt_dir.exists() and parallel.is_main_process():
        shutil.rmtree(ckpt_dir)

    total = min(plan.tokens, args.max_tokens or plan.tokens)
    local = parallel.local_rows(mesh, rows) if jax.process_count() > 1 else None
    checkpointer = checkpointing.Checkpointer(ckpt_dir) if args.checkpoint_every_tokens else None
    t_loop = time.time()
    try:
        done = consume(runner, pack_batches(cache, rows=rows, row_len=row_len, start_cursor=cursor, row_subset=local),
                       done, total, args, lambda d, c: checkpointer.save(
                           d["batches"], runner.acc, {"settings": settings, "cursor": c, "done": d}))
    finally:
        if checkpointer is not None:
            checkpointer.close()
    acc = runner.merged_layers()
    token = runner.token_readout()
    seconds = time.time() - t_loop
    has_sources = len(cache.source_names) > 1 or bool(args.source)
    final = finalize(acc, cfg.state_names, cache.source_names if has_sources else None, token=token)
    if args.centered:
        final = centered_pass(final, acc, model, runner, cache, rows, row_len, local, args)
    sums = runner.token_sums if args.save_token_sums and not args.no_token_stats else None
    if parallel.is_main_process():
        metrics = build_metrics(model, args.unit, done, final, has_sources)
        manifest = build_manifest(model, cache, corpus, done, plan, seconds, time.time() - t_start, settings)
        write_results(out, metrics, manifest, final, cfg.state_names, sums, plots=not args.no_plots)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    elif sums is not None:
        for s in range(cfg.num_states):  # every process takes part in gathering the sums
            sums(s)
    log(f"{done['tokens']:,} tokens in {seconds:.1f} s ({done['tokens'] / max(seconds, 1e-9):,.0f} tokens/s); "
        f"results in {out}")
    return out


def make_runner(model, mesh, *, token_stats: bool, num_groups: int, centers_SxD=None):
    """A Runner whose activations stay split by rows over every device."""
    import dataclasses

    from isojax import parallel
    from isojax.runner import Runner
    module = model.module
    if mesh.size > 1:
        module = module.clone(options=dataclasses.replace(
            module.options, activation_sharding=parallel.rows(mesh)))
    return Runner(module, model.params, mesh, token_stats=token_stats, num_groups=num_groups,
                  centers_SxD=centers_SxD)


def resume(runner, ckpt_dir: Path, settings: dict, done: dict):
    """(cursor, done) after the newest checkpoint, whose accumulators are loaded into runner."""
    from isojax import checkpointing
    restored = checkpointing.latest(ckpt_dir, runner.abstract)
    if restored is None:
        log(f"no complete checkpoint under {ckpt_dir}: starting from the beginning")
        return None, done
    acc, meta = restored
    if meta["settings"] != settings:
        diff = [k for k in settings if meta["settings"].get(k) != settings[k]]
        raise UserError(f"the checkpoint was made with other settings ({', '.join(diff)}); "
                        "rerun with the same arguments (and device and process counts) or start over with --overwrite")
    runner.load(acc)
    log(f"resuming after {meta['done']['tokens']:,} tokens")
    return meta["cursor"], meta["done"]


def consume(runner, batches, done, total, args, save_checkpoint) -> dict:
    """Feed batches to the device with a progress bar; checkpoint every N tokens."""
    from tqdm import tqdm

    from isojax import parallel
    done = dict(done)
    last_ckpt = done["tokens"]
    bar = tqdm(total=total, initial=min(done["tokens"], total), unit="tok", unit_scale=True, file=sys.stderr,
               dynamic_ncols=True, smoothing=0.1, disable=None if parallel.is_main_process() else True)
    try:
        for batch in batches:
            if args.max_tokens and done["tokens"] >= args.max_tokens:
                break
            runner.step(batch.tokens_BxT, batch.segment_ids_BxT, batch.positions_BxT, batch.group)
            done = {"tokens": done["tokens"] + batch.n_tokens, "sequences": done["sequences"] + batch.n_sequences,
                    "batches": done["batches"] + 1}
            bar.update(min(batch.n_tokens, max(total - bar.n, 0)))
            every = args.checkpoint_every_tokens
            if every and done["tokens"] - last_ckpt >= every:
                save_checkpoint(done, batch.cursor)
                last_ckpt = done["tokens"]
    finally:
        bar.close()
        if hasattr(batches, "close"):
            batches.close()
    return done


def centered_pass(final, acc, model, runner, cache, rows, row_len, local, args):
    """Second pass: cosines of x - mean(x), the mean taken from the first pass (float64)."""
    import numpy as np

    from isojax.data import pack_batches
    from isojax.finalize import finalize
    sums = (np.asarray(acc.sum_GxSxD.hi, np.float64) + np.asarray(acc.sum_GxSxD.lo, np.float64)).sum(0)
    counts = np.array([layer["count"] for layer in final["layers"]], np.float64)
    centers_SxD = sums / counts[:, None]
    log("second pass for centered InterSim")
    model.params = runner.params
    second_runner = make_runner(model, runner.mesh, token_stats=False, num_groups=len(cache.source_names),
                                centers_SxD=centers_SxD)
    consume(second_runner, pack_batches(cache, rows=rows, row_len=row_len, row_subset=local),
            {"tokens": 0, "sequences": 0, "batches": 0}, final["layers"][0]["count"], args, lambda d, c: None)
    second = finalize(second_runner.merged_layers(), model.config.state_names)
    for layer, other in zip(final["layers"], second["layers"]):
        layer["centered_inter_sim"] = other["centered_inter_sim"]
    return final


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
