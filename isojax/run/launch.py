"""What a plan tells someone about to rent a slice (extract --dry-run --target): its hosts and
processes, the command each host runs, and the run's time from a measured rate.

The estimate takes the one-GPU rates of bench/RESULTS.md §14b (every family on an H100 and an H200,
extract's kernels, `bench_families`) and §10j (three Pythia sizes on an H100): the measured preset of
the model's family nearest in size, scaled to the model by forward FLOPs per token
(ModelConfig.flops_per_token: the same share of the card's rate), times the chips: a figure on the
fast side (410m and 1.4b scaled at 83-100% on 2 and 4 GPUs, §7, §7b and §7f; more chips were not
measured). No estimate where nothing was measured (A100s, TPUs, a family without a row) or the run's
tokens are not known before tokenizing (no --max-tokens)."""

from __future__ import annotations

import shlex

# tokens/s on one GPU, bench/RESULTS.md §14b ("Each family against its peer": isojax's columns) and, on
# the H100, §10j (pythia-70m, 410m, 1.4b: "LayerNorm kernel (the default)")
MEASURED = {
    "gpu-h100": {"pythia-70m": 6_741_539, "pythia-410m": 652_884, "pythia-1.4b": 189_649, "pythia-1b": 265_070,
                 "gpt2-xl": 134_111, "opt-1.3b": 178_911, "falcon-mqa-1b": 234_698,
                 "llama-1b": 212_645, "mistral-1b": 254_200, "qwen2-1.5b": 173_577, "olmo-1b": 217_722,
                 "olmo2-1b": 212_414, "phi-2": 88_917},
    "gpu-h200": {"pythia-1b": 266_360, "gpt2-xl": 137_349, "opt-1.3b": 178_467, "falcon-mqa-1b": 236_186,
                 "llama-1b": 215_441, "mistral-1b": 254_650, "qwen2-1.5b": 176_246, "olmo-1b": 218_489,
                 "olmo2-1b": 213_281, "gemma-2b": 125_326, "phi-2": 88_286},
}


def launch_line(argv: list[str] | None, hosts: int) -> str:
    """The run's command as given to the dry run, without --dry-run and --target, with --distributed
    where the slice has more than one host (each host runs it: jax.distributed joins them)."""
    out, skip = ["python", "-m", "isojax.extract"], False
    for arg in argv or []:
        if skip:
            skip = False
        elif arg == "--target":
            skip = True
        elif arg != "--dry-run" and not arg.startswith("--target="):
            out.append(arg)
    if hosts > 1 and "--distributed" not in out:
        out.insert(3, "--distributed")
    return shlex.join(out)


def estimate(cfg, target, tokens: int | None) -> dict:
    """{"seconds", "tokens_per_second", "from"} or {"seconds": None, "why"} (the module's docstring)."""
    from isojax.hf.family.presets import preset
    if target is None:
        return {"seconds": None, "why": "planned for this machine: no measured rate is kept for it"}
    rates = MEASURED.get(target.kind)
    if rates is None:
        return {"seconds": None, "why": f"no rate measured on {target.kind} in bench/RESULTS.md (measured: "
                                        f"{', '.join(MEASURED)})"}
    same = [(name, preset(name)) for name in rates if preset(name).family == cfg.family]
    if not same:
        return {"seconds": None, "why": f"no {cfg.family} model measured on {target.kind} in bench/RESULTS.md"}
    name, ref = min(same, key=lambda nr: abs(nr[1].param_count() - cfg.param_count()))
    per_chip = rates[name] * ref.flops_per_token() / cfg.flops_per_token()
    rate = per_chip * target.chips
    basis = (f"{name} measured at {rates[name]:,} tokens/s on one {target.kind[4:].upper()} (bench/RESULTS.md), "
             f"scaled by FLOPs per token to {per_chip:,.0f} per GPU, x {target.chips}")
    if not tokens:
        return {"seconds": None, "tokens_per_second": round(rate), "from": basis,
                "why": "the run's tokens are known only once the corpus is tokenized: give --max-tokens"}
    return {"seconds": round(tokens / rate, 1), "tokens_per_second": round(rate), "from": basis}


def slice_plan(cfg, target, argv, tokens: int | None) -> dict:
    """plan.json's "launch": hosts, processes, the command on every host, the time estimate."""
    hosts = target.hosts if target is not None else 1
    return {"hosts": hosts, "processes": hosts, "command": launch_line(argv, hosts),
            "estimate": estimate(cfg, target, tokens)}


def describe(launch: dict) -> list[str]:
    """The plan's lines about the slice."""
    hosts, est = launch["hosts"], launch["estimate"]
    where = "on every host at once" if hosts > 1 else "on its host"
    lines = [f"{hosts} host(s), one process each; run {where}: {launch['command']}"]
    if est.get("seconds") is not None:
        lines.append(f"estimated loop time {est['seconds'] / 3600:.2f} h at {est['tokens_per_second']:,} tokens/s "
                     f"({est['from']}; compile, tokenizing and finalize not counted)")
    else:
        lines.append(f"no estimate of the run's time: {est['why']}")
    return lines
