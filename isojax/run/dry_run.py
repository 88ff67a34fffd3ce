"""extract --dry-run [--target KIND]: what a run decides before its first batch (the model's shapes,
kernels, mesh, rows, memory per device, sample, output size), without weights and without reading
the corpus beyond its size, and the measuring step lowered for the target (TPU or GPU slices from
device/targets.py, on any machine: jax.export over an AbstractMesh of the slice's chips; else this
machine). Printed, and written to OUT/plan.json (a result file: outdir.staged)."""

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
    hopper: bool = False  # sm_90 GPUs: the fused MLP kernel's


def target_machine(target) -> Machine:
    return Machine(target.name, target.platform, target.chips, target.chip_memory,
                   target.kind in ("gpu-h100", "gpu-h200"))


def this_machine() -> Machine:
    import jax

    from isojax.device.memory import device_memory_bytes, host_memory_bytes
    from isojax.kernels import mlp
    return Machine("this machine", jax.default_backend(), jax.device_count(),
                   device_memory_bytes() or host_memory_bytes(), mlp.available())


def kernels(args, cfg, machine: Machine, dtype: str, row_len: int, device_rows: int) -> tuple[str, str, str]:
    """(attention, mlp, norm): what extract chooses on `platform` (kernels/select.py, measure()),
    taken as if each kernel's probe there passes."""
    from isojax.kernels import mlp, norm
    from isojax.kernels.select import choose_attention, exact_gelu_with_bias, layer_norm_pair
    attention, auto, platform = args.attention, args.attention == "auto", machine.platform
    if attention in ("cudnn", "packed") and dtype != "bfloat16":
        raise UserError(f"attention {attention} needs dtype bfloat16 (its kernel has no float32 version)")
    if attention in ("cudnn", "packed") and platform != "gpu" or attention == "pallas" and platform != "tpu":
        raise UserError(f"attention {attention} does not run on {platform.upper()}")
    if auto:
        attention = {"gpu": "packed" if dtype == "bfloat16" else "xla", "tpu": "pallas"}.get(platform, "xla")
    attention = choose_attention(attention, auto, cfg, dtype, row_len, check=False)
    bf16_gpu = platform == "gpu" and dtype == "bfloat16"
    t = mlp.Tiles()
    mlp_fits = bf16_gpu and machine.hopper and exact_gelu_with_bias(cfg) and device_rows % t.tile_m == 0 \
        and cfg.intermediate_size % t.tile_n == 0 and cfg.hidden_size % t.tile_k == 0
    d = cfg.hidden_size
    norm_fits = bf16_gpu and layer_norm_pair(cfg) and norm.applies(d, "bfloat16") \
        and device_rows % norm.rows_per_block(d) == 0
    for flag, value, fits in (("mlp-kernel", args.mlp_kernel, mlp_fits), ("norm-kernel", args.norm_kernel, norm_fits)):
        if value not in ("auto", "xla") and not fits:
            raise UserError(f"--{flag} {value} does not apply to this model on {platform.upper()} in {dtype}")
    return (attention, "mosaic" if mlp_fits and args.mlp_kernel != "xla" else "xla",
            "pallas" if norm_fits and args.norm_kernel != "xla" else "xla")


def memory(cfg, args, dtype, groups, n, model_axis, tokens_per_device, sample) -> dict:
    """Bytes per device: parameters, accumulators, the step's temporaries (device/memory.py)."""
    from isojax.device.memory import memory_per_device, step_bytes
    acc, weights = memory_per_device(cfg, not args.no_token_stats, dtype, groups, n, model_axis, sample)
    step = step_bytes(cfg, dtype, tokens_per_device, model_axis)
    return {"parameters": weights, "accumulators": acc, "step": step, "total": weights + acc + step}


def device_tokens(cfg, args, machine: Machine) -> int:
    """Token slots per device and batch, before rounding to whole rows (as run/plan.py)."""
    from isojax.device.memory import device_batch_tokens
    if args.batch_tokens:
        return -(-args.batch_tokens // machine.devices)
    return device_batch_tokens(cfg, machine.platform != "cpu")


def model_axis(cfg, args, dtype, machine: Machine, tokens: int, groups: int, sample: int) -> int | None:
    """The smallest 'model' axis that makes the run fit the machine (memory.choose_mesh's rule, the
    sample and sources counted); None where nothing fits."""
    from isojax.device.memory import smallest_model_axis
    return smallest_model_axis(cfg, not args.no_token_stats, dtype, machine.devices, tokens, machine.memory,
                               num_groups=groups, sample_size=sample)


def does_not_fit(cfg, args, dtype, machine: Machine, target, groups: int, sample: int) -> UserError:
    """The refusal, naming the smallest slice of the target's kind that fits (at the same tokens per chip)."""
    from isojax.device import targets
    tokens = device_tokens(cfg, args, machine)
    what = f"{cfg.name} ({cfg.param_count() / 1e9:.1f}B parameters, {tokens:,} tokens per device)"
    if target is None:
        return UserError(f"{what} does not fit {machine.devices} device(s) of {machine.memory / 2**30:.1f} GiB; "
                         "use --target to plan for other hardware, --batch-tokens or --no-token-stats")
    smallest = lambda per_chip: next((t for t in targets.slices(target) if model_axis(
        cfg, args, dtype, target_machine(t), per_chip, groups, sample)), None)
    if (fits := smallest(tokens)) is not None:
        return UserError(f"{what} does not fit {target.name}; the smallest {target.kind} slice that fits is "
                         f"{fits.name} ({fits.chips} chips)")
    per_chip = next((t for t in (2 ** k for k in range(20, 8, -1)) if t < tokens and smallest(t)), None)
    hint = f"; at {per_chip:,} tokens per chip (--batch-tokens) {smallest(per_chip).name} fits" if per_chip else ""
    return UserError(f"{what} fits no {target.kind} slice{hint}")


def step_layout(cfg, dtype: str, chosen: tuple, mesh, platform: str, **kwargs):
    """The step's Layout (device/runner.py) as run/plan.py builds it, for `platform`'s per-token sums
    (StatsOptions.segment_sum_mode: scatter on GPUs, else scan); kwargs: Layout's."""
    from isojax.device.runner import Layout
    from isojax.hf.loading import build_module
    from isojax.run.plan import step_module
    from isojax.stats.options import StatsOptions
    module = step_module(build_module(cfg, dtype, *chosen), mesh)
    return Layout(module, mesh, options=StatsOptions(segment_sum="scatter" if platform == "gpu" else "scan"), **kwargs)


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
        exported = jax.export.export(layout.step(), platforms=[EXPORT_PLATFORM[platform]])(
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
    from isojax.device.memory import FIT
    from isojax.hf.loading import abstract_params
    from isojax.run.measure import DEFAULT_MODEL, peek_config, row_length
    from isojax.run.plan import default_sample_size
    from isojax.run.results import output_bytes

    target = targets.parse(args.target) if args.target else None
    machine = target_machine(target) if target else this_machine()
    if args.model and len(args.model) > 1 or args.revisions or args.paper_steps:
        raise UserError("--dry-run plans one model: name one --model, without --revisions or --paper-steps")
    model = (args.model or [DEFAULT_MODEL])[0]
    cfg = cfg or peek_config(model)
    if cfg is None:
        raise UserError(f"--dry-run needs the model's config without downloading: a preset, random:<preset> or a "
                        f"folder with config.json, not {model!r}")
    platform = machine.platform
    dtype = args.dtype or ("bfloat16" if platform != "cpu" else "float32")
    corpus = load_corpus(args.data, unit=args.unit, sources=args.source)  # checks the paths; reads no records
    text_only = all(inp.kind in ("txt", "default") for inp in corpus.inputs)
    labels = corpus.labels() if text_only else sorted(args.source) if args.source else None
    groups = len(labels) if labels else 1
    row_len = row_length(cfg, args.unit, args.seq_len)
    sizes = parallel.parse_mesh(args.mesh)
    n = sizes["data"] * sizes["model"] if len(sizes) == 2 else machine.devices
    if n > machine.devices or machine.devices % sizes.get("model", sizes.get("data", 1)):
        raise UserError(f"--mesh {args.mesh} does not divide the {machine.devices} devices of {machine.name}")
    machine = dataclasses.replace(machine, devices=n)
    tokens = device_tokens(cfg, args, machine)
    sample = 0 if args.no_sample else args.sample_states or (default_sample_size(cfg, dtype) if platform != "cpu"
                                                             else 0)
    m = sizes.get("model") or (n // sizes["data"] if "data" in sizes else
                               model_axis(cfg, args, dtype, machine, tokens, groups, sample))
    if m is None:
        raise does_not_fit(cfg, args, dtype, machine, target, groups, sample)
    rows = -(-max(1, (args.batch_tokens or n * tokens) // row_len) // n) * n
    per_device = memory(cfg, args, dtype, groups, n, m, rows * row_len // n, sample)
    if per_device["total"] > FIT * machine.memory:
        raise UserError(f"mesh data={n // m},model={m} needs {per_device['total'] / 2**30:.1f} GiB per device of "
                        f"{machine.memory / 2**30:.1f} GiB on {machine.name}")
    chosen = kernels(args, cfg, machine, dtype, row_len, rows // n * row_len)

    # off a GPU the GPU kernels run as stand-ins (packed attention and the norm pair in Pallas' interpret
    # mode, the fused MLP as XLA's path): lowered here, those are what the module holds
    interpreted = platform == "gpu" and jax.default_backend() != "gpu" and chosen != ("xla",) * 3
    parallel.use_gspmd_partitioner()
    mesh = jax.sharding.AbstractMesh((n // m, m), parallel.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layout = step_layout(cfg, dtype, chosen, mesh, platform, token_stats=not args.no_token_stats, num_groups=groups,
                         sample_size=sample)
    text, seconds = lower(layout, abstract_params(cfg, dtype, mesh), rows, row_len, platform) if lower_step else \
        ("", 0.0)
    size = corpus.size_bytes()
    return {
        "target": machine.name, "platform": platform, "devices": n, "device_memory": machine.memory,
        "model": {"name": model, "family": cfg.family, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "heads": cfg.num_heads, "vocab_size": cfg.vocab_size, "parameters": cfg.param_count()},
        "dtype": dtype, "kernels": dict(zip(("attention", "mlp", "norm"), chosen)),
        "segment_sum": layout.options.segment_sum, "mesh": {"data": n // m, "model": m},
        "rows": rows, "row_len": row_len, "tokens_per_batch": rows * row_len, "tokens_per_device": rows * row_len // n,
        "memory_per_device": per_device, "sample_states": sample, "token_stats": not args.no_token_stats,
        "corpus": {"inputs": corpus.describe(), "bytes": size, "sources": labels},
        "output_bytes": output_bytes(cfg, token_stats=not args.no_token_stats, save_token_sums=args.save_token_sums,
                                     sample_states=sample),
        "lowered": {"platform": EXPORT_PLATFORM[platform], "seconds": round(seconds, 2), "module_chars": len(text),
                    "custom_calls": custom_calls(text), "pallas_interpreted": interpreted} if lower_step else None,
        "stablehlo": text,
    }


def dry_run(args) -> Path:
    """Plan, print, and write OUT/plan.json (replacing only an earlier plan.json)."""
    from isojax.run import outdir
    out = Path(args.out)
    with outdir.claim(out, overwrite=True, names={"plan.json"}):  # --out checked (and held) before the work
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
    if result["lowered"]["pallas_interpreted"]:
        log("no GPU here: the GPU kernels were lowered as their stand-ins off a GPU (Pallas' interpret mode, XLA's "
            "MLP), not as the kernels a GPU compiles")
    return out
