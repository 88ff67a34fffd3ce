"""extract --dry-run [--target KIND]: what a run decides before its first batch (the model's shapes,
kernels, mesh, rows, memory per device, sample, output size), without weights and without reading
the corpus beyond its size, and the measuring step lowered for the target (TPU or GPU slices from
device/targets.py, on any machine: jax.export over an AbstractMesh of the slice's chips; else this
machine), and what renting the slice takes (run/launch.py: hosts, the command on each, the time from a
measured rate). Printed, and written to OUT/plan.json (a result file: outdir.staged)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from isojax.errors import UserError
from isojax.log import log

EXPORT_PLATFORM = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}
PARTITIONING = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


@dataclasses.dataclass
class Machine:
    name: str  # the target's name, or "this machine"
    platform: str  # tpu, gpu or cpu
    devices: int
    memory: int  # bytes per device
    hopper: bool  # sm_90 GPUs: the fused MLP kernel's
    defaults: str  # the platform whose defaults a run takes (dtype, batch, sample): memory.defaults_platform


def target_machine(target) -> Machine:
    return Machine(target.name, target.platform, target.chips, target.chip_memory,
                   target.kind in ("gpu-h100", "gpu-h200"), target.platform)


def this_machine() -> Machine:
    import jax

    from isojax.device.memory import defaults_platform, device_memory_bytes, host_memory_bytes
    from isojax.kernels import mlp
    return Machine("this machine", jax.default_backend(), jax.device_count(),
                   device_memory_bytes() or host_memory_bytes(), mlp.available(), defaults_platform())


def kernels(args, cfg, machine: Machine, dtype: str, row_len: int, device_rows: int):
    """The KernelChoice extract makes on `platform` (device/kernel_choice.py, measure()), taken as if
    each kernel's probe there passes."""
    from isojax.device.kernel_choice import choose_attention, fused_mlp, layer_norm_pair
    from isojax.kernels import mlp, norm
    from isojax.model.options import KernelChoice
    attention, auto, platform = args.attention, args.attention == "auto", machine.platform
    if attention in ("cudnn", "packed") and dtype != "bfloat16":
        raise UserError(f"attention {attention} needs dtype bfloat16 (its kernel has no float32 version)")
    if attention in ("cudnn", "packed") and platform != "gpu" or attention == "pallas" and platform != "tpu":
        raise UserError(f"attention {attention} does not run on {platform.upper()}")
    if auto:
        attention = {"gpu": "packed" if dtype == "bfloat16" else "xla", "tpu": "pallas"}.get(platform, "xla")
    attention = choose_attention(attention, auto, cfg, dtype, row_len, check=False)[0]
    bf16_gpu = platform == "gpu" and dtype == "bfloat16"
    fused = fused_mlp(cfg)
    mlp_fits = bf16_gpu and machine.hopper and fused is not None \
        and mlp.tiles(device_rows, cfg.hidden_size, cfg.intermediate_size, fused == "swiglu")
    d = cfg.hidden_size
    norm_fits = bf16_gpu and layer_norm_pair(cfg) and norm.applies(d, "bfloat16") \
        and device_rows % norm.rows_per_block(d) == 0
    for flag, value, fits in (("mlp-kernel", args.mlp_kernel, mlp_fits), ("norm-kernel", args.norm_kernel, norm_fits)):
        if value not in ("auto", "xla") and not fits:
            raise UserError(f"--{flag} {value} does not apply to this model on {platform.upper()} in {dtype}")
    mosaic = mlp_fits and (args.mlp_kernel == "mosaic" or args.mlp_kernel == "auto" and fused == "gelu")
    return KernelChoice(attention, "mosaic" if mosaic else "xla",
                        "pallas" if norm_fits and args.norm_kernel != "xla" else "xla")


def memory(cfg, args, dtype, groups, n, model_axis, tokens_per_device, sample) -> dict:
    """Bytes per device: parameters, accumulators, the step's temporaries (device/memory.py)."""
    from isojax.device.memory import memory_per_device, step_bytes
    acc, weights = memory_per_device(cfg, not args.no_token_stats, dtype, groups, n, model_axis, sample)
    step = step_bytes(cfg, dtype, tokens_per_device, model_axis, step_measures(args))
    return {"parameters": weights, "accumulators": acc, "step": step, "total": weights + acc + step}


def step_measures(args) -> tuple[tuple[str, int], ...]:
    """StatsOptions.step_measures of the command line's run (stats/measures base.Step)."""
    from isojax.stats.measures import step_settings, steps
    given = {step.keyword: step.setting(args) for step in steps().values()}
    return step_settings({k: v for k, v in given.items() if v is not None}, not args.no_token_stats)


def fit(cfg, args, dtype, machine: Machine, row_len: int, groups: int, sample: int, model_axis: int | None = None,
        per_chip: int | None = None) -> tuple[int | None, int]:
    """(model axis, rows per batch) as a run there chooses them (memory.fit_batch, as run_batch; None: nothing
    fits): --batch-tokens as given (or per_chip tokens on each chip), else the default batch shrunk to fit."""
    from isojax.device.memory import fit_batch
    return fit_batch(cfg, not args.no_token_stats, dtype, machine.devices, machine.memory, row_len,
                     batch_tokens=per_chip * machine.devices if per_chip else args.batch_tokens,
                     model_axis=model_axis, on_accel=machine.defaults != "cpu", num_groups=groups, sample_size=sample,
                     step_measures=step_measures(args))


def does_not_fit(cfg, args, dtype, machine: Machine, target, row_len: int, groups: int, sample: int) -> UserError:
    """The refusal, naming the smallest slice of the target's kind that fits (at the same tokens per chip
    where --batch-tokens is given, else with the default batch shrunk as a run there shrinks it)."""
    from isojax.device import targets
    from isojax.device.memory import batch_rows
    n = machine.devices
    per_chip = batch_rows(args.batch_tokens, n, row_len) // n * row_len if args.batch_tokens else None
    what = f"{cfg.name} ({cfg.param_count() / 1e9:.1f}B parameters" + (f", {per_chip:,} tokens per device)" if per_chip
                                                                       else ")")
    even = "" if per_chip else f" even at one row of {row_len:,} tokens per device"
    if target is None:
        return UserError(f"{what} does not fit {n} device(s) of {machine.memory / 2**30:.1f} GiB{even}; "
                         "use --target to plan for other hardware, --batch-tokens or --no-token-stats")

    def smallest(tokens):  # (slice, tokens per chip there)
        for t in targets.slices(target):
            m, rows = fit(cfg, args, dtype, target_machine(t), row_len, groups, sample, per_chip=tokens)
            if m is not None:
                return t, rows // t.chips * row_len
        return None, None

    fits, tokens = smallest(per_chip)
    if fits is not None:
        there = "" if per_chip else f", {tokens:,} tokens per chip"
        return UserError(f"{what} does not fit {target.name}{even}; the smallest {target.kind} slice that fits is "
                         f"{fits.name} ({fits.chips} chips{there})")
    fewer = next((t for t in (2 ** k for k in range(20, 8, -1)) if per_chip and t < per_chip and smallest(t)[0]), None)
    hint = f"; at {fewer:,} tokens per chip (--batch-tokens) {smallest(fewer)[0].name} fits" if fewer else ""
    return UserError(f"{what} fits no {target.kind} slice{even}{hint}")


def step_layout(cfg, dtype: str, chosen, mesh, platform: str, gpu_arch: str = "", **kwargs):
    """The step's Layout (device/runner.py) as run/plan.py builds it, for `platform`'s per-token sums
    (StatsOptions.segment_sum_mode: scatter on GPUs, else scan) with the KernelChoice `chosen`, its
    kernels lowered for gpu_arch (ForwardOptions.gpu_arch) where given; kwargs: Layout's."""
    from isojax.device.runner import Layout
    from isojax.hf.loading import build_module
    from isojax.run.plan import step_module
    from isojax.stats.options import StatsOptions
    module = build_module(cfg, dtype, chosen)
    module = step_module(module.clone(options=dataclasses.replace(module.options, gpu_arch=gpu_arch)), mesh)
    return Layout(module, mesh, options=StatsOptions(segment_sum="scatter" if platform == "gpu" else "scan"), **kwargs)


# Triton kernels (the packed attention, the LayerNorm pair) lower to custom calls that jax.export keeps
# off its list of stable targets; a plan is never serialized, so the check is left out for them
UNSTABLE_KERNEL_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def not_lowered(chosen, machine: Machine) -> tuple[object, dict[str, str]]:
    """(the KernelChoice lowered, {kernel: why it was not}) for a GPU target off a GPU: jax's cuDNN
    attention asks the cuDNN library, absent without a GPU, for its version while it lowers, so XLA's
    attention stands in for it in the lowered module; the memory plan is the same either way (the
    step's declared bytes, device/memory.py step_bytes, do not depend on the attention kernel)."""
    import jax
    if machine.platform != "gpu" or jax.default_backend() == "gpu" or chosen.attention != "cudnn":
        return chosen, {}
    why = ("jax lowers it only with the cuDNN library at hand, and there is none without a GPU; XLA's "
           "attention stands in for it in the lowered module, and the memory plan, the step's declared bytes, "
           "is the same for either")
    return dataclasses.replace(chosen, attention="xla"), {"attention cudnn": why}


def lower(layout, params, rows: int, row_len: int, platform: str) -> tuple[str, float]:
    """(StableHLO text, seconds) of the step lowered for the platform (jax.export)."""
    import jax
    import numpy as np

    from isojax.device import mesh as parallel
    from isojax.device.runner import signature
    cfg, mesh = layout.module.cfg, layout.mesh
    centers = jax.ShapeDtypeStruct((cfg.num_states, 0), np.float32, sharding=parallel.replicated(mesh))
    t = time.time()
    try:
        unchecked = [jax.export.DisabledSafetyCheck.custom_call(name) for name in UNSTABLE_KERNEL_CALLS]
        exported = jax.export.export(layout.step(), platforms=[EXPORT_PLATFORM[platform]], disabled_checks=unchecked)(
            *signature(params, layout.abstract, mesh, rows, row_len, centers))
    except Exception as e:  # noqa: BLE001 -- what a run there would meet at its first compile
        raise UserError(f"the step does not lower for {platform.upper()} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300]})") from None
    return exported.mlir_module(), time.time() - t


def custom_calls(text: str) -> dict[str, int]:
    """The lowered module's custom calls by target name (Mosaic TPU kernels: tpu_custom_call), but for
    the partitioner's markers."""
    names = [name for name in re.findall(r"custom_call @\"?([\w$.]+)", text) if name not in PARTITIONING]
    return {name: names.count(name) for name in sorted(set(names))}


def plan(args, cfg=None, lower_step: bool = True) -> dict:
    """The dry run's plan (module docstring); raises UserError for what a run there would refuse.
    cfg: the model's shapes instead of --model's (tests: fewer layers); lower_step=False: planned only."""
    import jax

    from isojax.data import load_corpus
    from isojax.device import mesh as parallel
    from isojax.device import targets
    from isojax.device.memory import batch_rows, device_batch_tokens, known_labels, log_shrink
    from isojax.hf.loading import abstract_params
    from isojax.run.config import MeasureConfig, cli_options
    from isojax.run.measure import DEFAULT_MODEL, peek_config, row_length
    from isojax.run.plan import run_dtype, run_sample
    from isojax.run.results import output_bytes
    from isojax.steps import local_revision

    target = targets.parse(args.target) if args.target is not None else None
    machine = target_machine(target) if target else this_machine()
    if args.model and len(args.model) > 1 or args.revisions or args.paper_steps:
        raise UserError("--dry-run plans one model: name one --model, without --revisions or --paper-steps")
    model = (args.model or [DEFAULT_MODEL])[0]
    cfg = cfg or peek_config(str(local_revision(model, args.revision) or model))
    if cfg is None:
        raise UserError(f"--dry-run needs the model's config without downloading: a preset, random:<preset> or a "
                        f"folder with config.json, not {model!r}")
    platform, on_accel = machine.platform, machine.defaults != "cpu"
    config = MeasureConfig.build(model, **cli_options(args))
    dtype = run_dtype(config, on_accel)
    corpus = load_corpus(args.data, unit=args.unit, sources=args.source)  # checks the paths; reads no records
    labels = known_labels(corpus, args.source)
    groups = len(labels) if labels else 1
    row_len = row_length(cfg, args.unit, args.seq_len)
    sizes = parallel.parse_mesh(args.mesh)
    n = sizes["data"] * sizes["model"] if len(sizes) == 2 else machine.devices
    if n > machine.devices or machine.devices % sizes.get("model", sizes.get("data", 1)):
        raise UserError(f"--mesh {args.mesh} does not divide the {machine.devices} devices of {machine.name}")
    machine = dataclasses.replace(machine, devices=n)
    sample = run_sample(cfg, config, on_accel)  # the corpus not read: at most max_tokens (the CLI's run_max_tokens)
    fixed = sizes.get("model") or (n // sizes["data"] if "data" in sizes else None)
    m, rows = fit(cfg, args, dtype, machine, row_len, groups, sample, model_axis=fixed)
    if m is None and fixed is None:
        raise does_not_fit(cfg, args, dtype, machine, target, row_len, groups, sample)
    per_device = memory(cfg, args, dtype, groups, n, m or fixed, rows * row_len // n, sample)
    if m is None:
        raise UserError(f"mesh data={n // fixed},model={fixed} needs {per_device['total'] / 2**30:.1f} GiB per device "
                        f"of {machine.memory / 2**30:.1f} GiB on {machine.name} at {rows * row_len // n:,} tokens per "
                        "device")
    if not args.batch_tokens:
        log_shrink(cfg, batch_rows(n * device_batch_tokens(cfg, on_accel), n, row_len) // n * row_len,
                   rows * row_len // n, machine.memory)
    chosen = kernels(args, cfg, machine, dtype, row_len, rows // n * row_len)

    # for a GPU, here or not: the Pallas and Mosaic GPU kernels lowered as a GPU of the target's
    # architecture compiles them (off a GPU cuDNN's attention cannot be: not_lowered)
    lowered_kernels, missing = not_lowered(chosen, machine)
    parallel.use_gspmd_partitioner()
    mesh = jax.sharding.AbstractMesh((n // m, m), parallel.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layout = step_layout(cfg, dtype, lowered_kernels, mesh, platform, ("sm_90" if machine.hopper else "sm_80")
                         if platform == "gpu" else "", token_stats=not args.no_token_stats, num_groups=groups,
                         sample_size=sample)
    text, seconds = lower(layout, abstract_params(cfg, dtype, mesh), rows, row_len, platform) if lower_step else \
        ("", 0.0)
    from isojax.run.launch import slice_plan
    from isojax.run.plan import run_max_tokens
    launch = slice_plan(cfg, target, getattr(args, "argv", None), run_max_tokens(config, on_accel))
    size = corpus.size_bytes()
    return {
        "target": machine.name, "platform": platform, "devices": n, "device_memory": machine.memory,
        "model": {"name": model, "family": cfg.family, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "heads": cfg.num_heads, "vocab_size": cfg.vocab_size, "parameters": cfg.param_count()},
        "dtype": dtype, "kernels": {"attention": chosen.attention, "mlp": chosen.mlp, "norm": chosen.norm},
        "segment_sum": layout.options.segment_sum, "mesh": {"data": n // m, "model": m},
        "rows": rows, "row_len": row_len, "tokens_per_batch": rows * row_len, "tokens_per_device": rows * row_len // n,
        "memory_per_device": per_device, "sample_states": sample, "token_stats": not args.no_token_stats,
        "corpus": {"inputs": corpus.describe(), "bytes": size, "sources": labels},
        "output_bytes": output_bytes(cfg, token_stats=not args.no_token_stats, save_token_sums=args.save_token_sums,
                                     sample_states=sample),
        "lowered": {"platform": EXPORT_PLATFORM[platform], "seconds": round(seconds, 2), "module_chars": len(text),
                    "custom_calls": custom_calls(text), "not_lowered": missing} if lower_step else None,
        "launch": launch, "stablehlo": text,
    }


def dry_run(args):
    """Plan, print, and write OUT/plan.json (replacing only an earlier plan.json)."""
    from isojax import storage
    from isojax.run import outdir
    out = storage.path(args.out)  # a gs:// URL stays one (Path would make it a local folder "gs:")
    inputs = [*(args.data or []), *(args.model or [])]  # checked as a run checks them
    with outdir.claim(out, overwrite=True, names={"plan.json"}, inputs=inputs):  # --out checked (and held) first
        result = plan(args)
        result.pop("stablehlo")
        with outdir.staged(out, replace_all=False) as tmp:
            (tmp / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
    mem, gb = result["memory_per_device"], lambda b: f"{b / 2**30:.2f} GiB"
    k, mesh = result["kernels"], result["mesh"]
    calls = ", ".join(f"{name} x{count}" for name, count in result["lowered"]["custom_calls"].items()) or "none"
    log(f"plan for {result['target']}: {result['model']['name']} ({result['model']['family']}, "
        f"{result['model']['parameters'] / 1e9:.2f}B parameters), {result['dtype']}, kernels attention "
        f"{k['attention']}, MLP {k['mlp']}, norms {k['norm']}, per-token sums {result['segment_sum']}")
    log(f"mesh data={mesh['data']},model={mesh['model']} over {result['devices']} devices; rows {result['rows']} x "
        f"{result['row_len']} ({result['tokens_per_device']:,} tokens per device); sample {result['sample_states']:,}")
    log(f"per device: parameters {gb(mem['parameters'])}, accumulators {gb(mem['accumulators'])}, step ~"
        f"{gb(mem['step'])}, total {gb(mem['total'])} of {gb(result['device_memory'])}; output up to "
        f"{result['output_bytes'] / 1e9:.2f} GB")
    log(f"the step was lowered for {result['platform'].upper()} (jax.export, platform "
        f"{result['lowered']['platform']}) in {result['lowered']['seconds']:.1f} s; custom calls: {calls}; "
        f"plan in {out / 'plan.json'}")
    for kernel, why in result["lowered"]["not_lowered"].items():
        log(f"not lowered: {kernel} ({why})")
    from isojax.run.launch import describe
    for line in describe(result["launch"]):
        log(line)
    return out
