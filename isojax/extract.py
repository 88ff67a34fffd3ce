"""python -m isojax.extract: InterSim, IntraSim, anisotropy and more for every hidden state of a
language model of any of eleven families (GPT-NeoX/Pythia, Llama, Mistral, Qwen2, OLMo, OLMo-2,
GPT-2, OPT, Falcon, Gemma, Phi) over a corpus, in one pass, resumable. Results go to --out only; logs and the
progress bar to stderr. With no --model and no --data it runs the embedded default: pythia-70m
(random weights of its shapes when the weights can't be had offline) on the documentation
bundled with CPython."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path

from isojax.run.measure import DEFAULT_MODEL
from isojax.run.plan import CPU_DEFAULT_MAX_TOKENS
from isojax.errors import ArgumentParser, UserError, exit_with, run_command


def zeta_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def target_name(text: str) -> str:
    if not text.strip():  # not "this machine": that is --dry-run without --target
        raise argparse.ArgumentTypeError(f"expected a kind of slice such as tpu-v5e-8 or gpu-h100-8, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m isojax.extract", description=__doc__)
    ap.add_argument("--model", action="append", default=None,
                    help="preset (pythia-1.4b, pythia-410m-deduped, ...), random:<preset> (random weights), a local "
                         f"checkpoint directory, or a hub id; default {DEFAULT_MODEL}, falling back to "
                         "random:pythia-70m when offline. Repeat it to sweep over models (OUT/<model>/<revision>/)")
    rev = ap.add_mutually_exclusive_group()
    rev.add_argument("--revision", default=None, help="revision (training checkpoint), e.g. step143000: a hub revision, or a subfolder of a "
                     "local --model folder of revisions")
    rev.add_argument("--revisions", default=None, metavar="R1,R2,...",
                     help="sweep these revisions of every --model: OUT/<model>/<revision>/ and OUT/sweep.csv; a "
                          "local directory with one subfolder per revision stands in for a hub repository")
    rev.add_argument("--paper-steps", action="store_true",
                     help="sweep the paper's 21 checkpoints: step0 and floor(i*143/20)*1000 for i = 1..20")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="sweeps: measure every N-th (model, revision) step from the I-th (I = 0 ... N-1), so N jobs "
                         "(a SLURM job array: $SLURM_ARRAY_TASK_ID/N) run one sweep into one shared --out; each "
                         "rebuilds OUT/sweep.csv from every finished step and says how many are still missing")
    ap.add_argument("--data", action="append", default=None, metavar="PATH",
                    help="corpus: .txt, .jsonl[.gz|.zst], .parquet, a folder of shards, or "
                    "hub:NAME[@REVISION][:CONFIG]:SPLIT (a Hugging Face dataset, streamed), or any of the files "
                    "as gs://BUCKET/PATH (copied once into isojax's cache); repeatable; default: the documentation topics bundled with CPython")
    ap.add_argument("--unit", default="sentence", choices=["sentence", "document"], help="sequence unit (default: sentence)")
    ap.add_argument("--source", action="append", default=None, metavar="NAME",
                    help="keep only this Pile source (meta.pile_set_name); repeatable")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="forward compute dtype (default: bfloat16 on accelerators, float32 on CPU); "
                    "statistics are always float32 compensated, finalized in float64")
    ap.add_argument("--seq-len", type=positive_int, default=None,
                    help="packed row length T; longer sequences are split into consecutive windows of "
                    "min(T, context) tokens (default 512 for sentences, the context for documents)")
    ap.add_argument("--batch-tokens", type=positive_int, default=None,
                    help="tokens per batch, rows x T (default on accelerators: 262144 for models of width "
                         "<= 1024, else 65536; 8192 on CPU)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="measure at most this many tokens, split equally over the sources (each source's "
                         "first max-tokens // sources tokens; the unit that fills a share is cut); reading "
                         "and tokenizing stop once every share is full; default: all, "
                         f"or {CPU_DEFAULT_MAX_TOKENS:,} for the embedded default corpus on CPU")
    ap.add_argument("--max-tokens-per-source", type=positive_int, default=None, metavar="N",
                    help="each source's share of tokens: its first N; with --max-tokens, each source's "
                         "share is the smaller of N and its equal share")
    ap.add_argument("--out", required=True, help="results directory, or gs://BUCKET/PATH on Google Cloud Storage "
                    "(credentials as Google's libraries find them: GOOGLE_APPLICATION_CREDENTIALS, gcloud, the "
                    "metadata server; single runs only)")
    ap.add_argument("--checkpoint-every-tokens", type=positive_int, default=None, metavar="N",
                    help="write accumulators + data cursor atomically under OUT/checkpoint every N tokens")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    ap.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    ap.add_argument("--delete-downloads", action="store_true",
                    help="sweeps: once a checkpoint is measured, delete from the Hugging Face cache the files this "
                         "sweep downloaded for it (files cached before the run stay)")
    ap.add_argument("--no-token-stats", action="store_true",
                    help="skip per-token IntraSim (saves (L+2) x V x D x 8 bytes of device memory)")
    ap.add_argument("--centered", action="store_true",
                    help="also compute centered InterSim (cosines of x - mean): a second pass over the data")
    ap.add_argument("--save-token-sums", action="store_true",
                    help="also write the per-token unit-vector sums [L+2, V, D] (float64) to OUT/tokens.zarr")
    ap.add_argument("--sample-states", type=positive_int, default=None, metavar="K",
                    help="keep a uniform sample of K tokens (all their states; seeded by token identity, so the "
                         "same on any batch size or device count) for the intrinsic dimension per layer (TwoNN, "
                         "MLE, MoM) and anisotropy over batches of 4096; written to OUT/samples.zarr. Without "
                         "it, on accelerators, a default sample (16,384 tokens or fewer) gives the batch anisotropy "
                         "only; on CPU no sample is kept unless asked for")
    ap.add_argument("--intrinsic-k", type=positive_int, default=20, metavar="k",
                    help="neighbours for the MLE and MoM intrinsic dimension (default: 20)")
    ap.add_argument("--isoscore-zeta", type=zeta_fraction, default=0.75, metavar="ZETA",
                    help="IsoScore*'s covariance shrinkage (1 - ZETA) C + ZETA C0, 0 to 1, C0 the covariance of all "
                         "the layer's states (default: 0.75, I-STAR's analysis, Rudman & Eickhoff 2024)")
    ap.add_argument("--no-sample", action="store_true", help="keep no sample (no batch anisotropy)")
    ap.add_argument("--sentence-probe", action="store_true",
                    help="the per-sentence measures of Diff-eRank (erank) and Sun et al. (massive_count, ...) on a "
                         "fixed subset of sentences, by a forward of its own after the loop (off by default: seconds "
                         "per checkpoint; README \"The sentence probe\")")
    ap.add_argument("--skip-positions", type=non_negative_int, default=0, metavar="K",
                    help="leave the first K positions of every sequence (window) out of every statistic; the model "
                         "still reads them (default: 0); with a BOS token (--bos), it is position 0")
    from isojax.stats.measures import optional, steps
    for step in steps().values():  # each step measure's flags (stats/measures base.Step)
        step.add_arguments(ap, positive_int)
    ap.add_argument("--measure", action="append", default=[], metavar="NAME",
                    help=f"also read out a registered measure that is off by default ({', '.join(optional())}; "
                         "repeat or comma-separate; README \"Geometry measures\")")
    ap.add_argument("--bos", default="auto", choices=["auto", "on", "off"],
                    help="put the tokenizer's BOS token before every sentence (document): auto (default) = as the "
                         "model's tokenizer does in Hugging Face with add_special_tokens=True (Llama-family "
                         "tokenizers add one, GPT-NeoX/Pythia's none); on: always (an error where the tokenizer "
                         "has none); off: never")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--format", default="csv", choices=["csv", "parquet"],
                    help="parquet: also write layers.parquet (and a sweep's sweep.parquet) beside the CSVs "
                         "(default: csv only)")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn", "packed", "pallas"],
                    help="attention kernel: auto (default) = packed for bfloat16 on GPUs (one kernel with rotary "
                         "that skips the key blocks outside each sequence; cudnn where it does not apply), pallas "
                         "(flash attention with segment ids) on TPUs, else xla (plain, the exact reference)")
    ap.add_argument("--mlp-kernel", default="auto", choices=["auto", "xla", "mosaic"],
                    help="the MLP's first product with bias and GELU, or a SiLU-gated MLP's two products: auto "
                         "(default) = mosaic (one fused kernel) for bfloat16 on Hopper GPUs where the shapes "
                         "tile, else xla (cuBLAS + elementwise passes)")
    ap.add_argument("--norm-kernel", default="auto", choices=["auto", "xla", "pallas"],
                    help="a parallel-residual block's two LayerNorms: auto (default) = pallas (one kernel reading "
                         "the state once) for bfloat16 on GPUs where the width is a power of two, else xla")
    scale = ap.add_argument_group("devices and hosts")
    scale.add_argument("--mesh", default=None, metavar="data=N,model=M",
                       help="device mesh: batch rows are split over all devices; parameters are "
                            "split over 'model' (FSDP) when M > 1. Default: all devices on 'data', "
                            "or the smallest 'model' that makes the parameters and accumulators fit")
    scale.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="multi-host: the coordinator (process 0) address; with --num-processes, --process-id")
    scale.add_argument("--num-processes", type=positive_int, default=None, help="multi-host: number of processes")
    scale.add_argument("--process-id", type=non_negative_int, default=None, help="multi-host: this process's index (0 ...)")
    scale.add_argument("--coordinator-timeout", type=positive_int, default=120, metavar="SECONDS",
                       help="multi-host: how long to wait for the coordinator and the other processes (default: 120)")
    scale.add_argument("--shutdown-timeout", type=positive_int, default=3600, metavar="SECONDS",
                       help="multi-host: how long the end of a run waits for the slowest process, once the results "
                            "are written (default: 3600); a process later than that is a warning")
    scale.add_argument("--distributed", action="store_true",
                       help="multi-host: join the run described by the cluster's environment "
                            "(TPU pod slice, SLURM, Open MPI), as jax.distributed.initialize() finds it")
    plan = ap.add_argument_group("planning without the hardware")
    plan.add_argument("--dry-run", action="store_true",
                      help="decide everything a run decides before its first batch (mesh, kernels, rows, memory per "
                           "device, sample, output size) and lower the step for the target, without weights or "
                           "reading the corpus; printed and written to OUT/plan.json")
    plan.add_argument("--target", type=target_name, default=None, metavar="KIND",
                      help="with --dry-run: plan for tpu-v4-N, tpu-v5e-N, tpu-v5p-N, tpu-v6e-N (N: chips; TensorCores "
                           "for v4 and v5p), gpu-h100-N, gpu-h200-N, gpu-a100-40g-N or gpu-a100-80g-N; default: this "
                           "machine")
    return ap


def check_out(out: Path, args) -> None:
    """Before any work, in every process: --out can be written and holds no input of this run;
    results already there are refused unless --overwrite (outdir's one refusal), or --resume of
    the run that is to write them."""
    from isojax.run import outdir
    outdir.check_path(out, [*(args.data or []), *(args.model or [])])
    has_results = (out / "metrics.json").exists()
    has_ckpt = (out / "checkpoint").exists()
    if args.resume:
        if has_results and not has_ckpt:
            raise UserError(f"{out} holds the results of a finished run: nothing to resume")
        return
    held = [name for name in outdir.owned(out) if name != "plan.json"]  # a dry run's plan: replaced by the run
    outdir.refuse_earlier(out, held or (["metrics.json"] if has_results else []),
                          overwrite=args.overwrite)
    if has_ckpt and not args.overwrite:
        raise UserError(f"{out}/checkpoint holds an unfinished run: pass --resume to continue it "
                        "or --overwrite to start over")


def check_free_space(out: Path, config) -> None:
    """Refuse, before any work, a run (a MeasureConfig) whose results (and checkpoints) cannot fit
    the free space of --out's disk: the output size of the sample the run's plan keeps
    (results.planned_output_bytes); where the model's shapes are not known without loading it, the
    write itself reports a full disk (on GCS there is no free space to check)."""
    from isojax import storage
    if storage.is_remote(out):
        return
    from isojax.device.memory import defaults_platform
    from isojax.run.measure import peek_config
    from isojax.run.results import planned_output_bytes
    cfg = peek_config(config.model.model or DEFAULT_MODEL)
    if cfg is None:
        return
    need = planned_output_bytes(cfg, config, defaults_platform() != "cpu")
    every = config.checkpoint.every_tokens
    if every:  # the last two checkpoints kept, a third being written
        from isojax.device.runner import per_device_accumulator_bytes
        need += 3 * per_device_accumulator_bytes(cfg, 1, token_stats=config.stats.token_stats)
    base = next(p for p in [out, *out.absolute().parents] if p.exists())
    free = shutil.disk_usage(base).free
    if need > free:
        from isojax.log import gb_apart
        need_gb, free_gb = gb_apart(need, free)
        raise UserError(f"the results{' and checkpoints' if every else ''} of this run need up to about "
                        f"{need_gb} in {out}, and its disk has {free_gb} free; free space or "
                        "choose another --out" + (" (or leave out --save-token-sums)" if config.stats.save_token_sums
                                                 else ""))


def run(args) -> Path:
    if args.dry_run or args.target is not None:  # --target '' is a mistake (target_name), not this machine
        if not args.dry_run:
            raise UserError("--target plans for other hardware: it goes with --dry-run")
        from isojax.run.dry_run import dry_run
        return dry_run(args)
    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    parallel.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed,
                        timeout_s=args.coordinator_timeout, shutdown_timeout_s=args.shutdown_timeout)
    from isojax.run.config import MeasureConfig, cli_options
    from isojax.run.measure import start_measure
    from isojax.steps import paper_steps
    from isojax.log import log

    from isojax import storage
    out = storage.path(args.out)
    options = cli_options(args)
    models = args.model or [None]
    from isojax.run.sweep import parse_shard
    shard = parse_shard(args.shard, bool(args.paper_steps or args.revisions or len(models) > 1))
    if args.paper_steps or args.revisions or len(models) > 1:
        from isojax.run.sweep import run_sweep
        revisions = paper_steps() if args.paper_steps else \
            [r.strip() for r in (args.revisions or "").split(",") if r.strip()] or [args.revision]
        if None in models:
            raise UserError("a sweep needs --model")
        if storage.is_remote(out):
            raise UserError("--out gs://... takes single runs; a sweep (--revisions, --paper-steps, several --model) "
                            "writes to a local --out")
        run_sweep(models, revisions, out, resume=args.resume, overwrite=args.overwrite, plots=not args.no_plots,
                  delete_downloads=args.delete_downloads, parquet=args.format == "parquet",
                  config=MeasureConfig.build(**options), shard=shard)
        log(f"{len(models) * len(revisions)} steps{f' (shard {shard[0]}/{shard[1]})' if shard[1] > 1 else ''}; "
            f"results in {out}/<model>/<revision>/ and {out / 'sweep.csv'}")
        parallel.finish(args.shutdown_timeout)
        return out
    if args.delete_downloads:
        raise UserError("--delete-downloads applies to sweeps (--revisions, --paper-steps or several --model)")
    from isojax.device.memory import defaults_platform
    from isojax.run import outdir
    from isojax.run.results import planned_result_names
    config = MeasureConfig.build(models[0], revision=args.revision, checkpoint_dir=out / "checkpoint",
                                 resume_run=args.resume, **options)
    names = planned_result_names(config, plots=not args.no_plots, parquet=args.format == "parquet",
                                 on_accel=defaults_platform() != "cpu")  # every name the run may write
    # held to the end: a second run into this --out is refused before it measures anything
    with outdir.claim(out, overwrite=True, names=names, inputs=[*(args.data or []), *(args.model or [])]) \
            if parallel.is_main_process() else contextlib.nullcontext():
        check_out(out, args)  # after claim: a commit a killed run left half done is undone first
        check_free_space(out, config)
        results = start_measure(config)  # its per-source metrics read out while save draws and writes
        if parallel.is_main_process():
            results.save(out, overwrite=True, plots=not args.no_plots, parquet=args.format == "parquet")
            checkpointing.remove(out / "checkpoint")  # only what isojax wrote there
        else:
            results.join_save()
    tokens, t = results.metrics["tokens"], results.timings
    wall, loop = results.manifest["seconds_wall"], t["loop"]
    rate = results.manifest.get("tokens_per_second")  # the loop after its first step; None: one batch
    loop_text = f"device loop {loop:.1f} s ({rate:,.0f} tokens/s)" if rate else \
        "device loop of one batch (too short to time)"
    log(f"{tokens:,} tokens: wall {wall:.1f} s ({tokens / max(wall, 1e-9):,.0f} tokens/s), {loop_text} "
        f"+ compile {t['compile']:.1f} s; results in {out}")
    parallel.finish(args.shutdown_timeout)  # after the commit: a slow host at the end is a warning
    return out


def main(argv=None) -> int:
    # JAX takes 75% of each GPU by default; a run owns its devices (gpt-neox-20b on 4 x 80 GB
    # peaks at 57 GB per device). 90%, not more: NCCL allocates outside JAX's pool, and at 95%
    # it can run out of memory (bench/RESULTS.md 7c). Set the variable to share a GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    use_cuda_graphs_for_loops()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the dry run's launch line repeats it
    return run_command(run, args)


def use_cuda_graphs_for_loops() -> None:
    """XLA records fusions and library calls of a GPU program into CUDA graphs (command buffers)
    but by default not while loops or conditionals; the step's layer scan and per-token rounds are
    while loops. Adding them pays where the step launches many small kernels (small models;
    bench/RESULTS.md 10d). Left alone if XLA_FLAGS already sets command buffers; on CPUs
    the flag does nothing. Must run before jax starts a backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        # one type per flag: XLA applies only the first of a comma-separated list of +TYPE
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=+WHILE"
                                   " --xla_gpu_enable_command_buffer=+CONDITIONAL").strip()


if __name__ == "__main__":
    exit_with(main())
