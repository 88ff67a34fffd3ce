"""Scale-out: tokens/s of the full step (per-token IntraSim included) on 1, 2, ... devices of
one host, peak memory per device, and what an asynchronous checkpoint costs the loop.

Each device keeps the per-device batch of isojax.extract's default (65,536 token slots for
widths above 1024, else 262,144), so k devices run k times the rows per step; scaling
efficiency = tokens/s on k devices / (k x tokens/s on 1). The workload is bench_throughput's
(log-normal sentence lengths, Zipf token ids), packed by isojax's packer.

    python -m bench.bench_scaling --models pythia-410m,pythia-1.4b --devices 1,2
    python -m bench.bench_scaling --models pythia-1.4b --devices 1,2 --token-stats on,off --profile /tmp/prof
    python -m bench.bench_scaling --models pythia-1.4b --devices 4 --checkpoint /tmp/ckpt

--checkpoint times two checkpoints in a row on the largest device count: the loop runs every
batch twice while each is written; a checkpoint's cost is the caller's wait, the loop's slowdown
and any wait after the loop for the files, over the loop time of 20M tokens. Peak memory is the device's peak since the process started (a device that
ran an earlier, smaller count carries that run's peak).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


import jax

from bench.common import pack_in_memory
from bench.common import random_sentences, sentence_lengths


def per_device_batch(cfg) -> int:
    return 262144 if cfg.hidden_size <= 1024 else 65536


def fitting_model_axis(cfg, k: int, token_stats: bool, tokens_per_device: int) -> int:
    """The smallest 'model' axis dividing k at which weights, accumulators and the step fit, as
    isojax.device.memory.choose_mesh picks it for extract."""
    from isojax.device import memory
    from isojax.device.memory import device_memory_bytes, host_memory_bytes
    limit = memory.FIT * (device_memory_bytes() or host_memory_bytes())
    for m in (m for m in range(1, k + 1) if k % m == 0):
        if sum(memory.memory_per_device(cfg, token_stats, "bfloat16", 1, k, m)) + \
                memory.step_bytes(cfg, "bfloat16", tokens_per_device, m) <= limit:
            return m
    return k


def kernels(cfg, attention: str, mlp_kernel: str, norm_kernel: str, device_rows: int, row_len: int):
    """auto: the kernels isojax.extract would choose here (isojax.device.kernel_choice)."""
    from isojax.device import kernel_choice as select
    if attention == "auto":
        attention = select.choose_attention("packed", True, cfg, "bfloat16", row_len)[0] \
            if jax.default_backend() == "gpu" else "xla"
    if mlp_kernel == "auto":
        mlp_kernel = select.choose_mlp_kernel("auto", cfg, "bfloat16", device_rows)[0]
    if norm_kernel == "auto":
        norm_kernel = select.choose_norm_kernel("auto", cfg, "bfloat16", device_rows)[0]
    return attention, mlp_kernel, norm_kernel


def run(name: str, k: int, steps: int, checkpoint: str | None, row_len: int = 512, model_axis: int | str = 1,
        batch_per_device: int | None = None, token_stats: bool = True, profile: str | None = None,
        reserve: bool = True, mlp_kernel: str = "xla", attention: str | None = None, norm_kernel: str = "xla",
        matmul_rate: float | None = None, exchange_rows: int | None = None) -> dict:
    import jax.numpy as jnp

    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    from isojax.hf.family.presets import preset
    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder
    from isojax.model.options import ForwardOptions
    from isojax.device.runner import Runner
    cfg = preset(name)
    per_device = batch_per_device or per_device_batch(cfg)
    if model_axis == "auto":
        model_axis = fitting_model_axis(cfg, k, token_stats, per_device)
    model_axis = min(int(model_axis), k)
    mesh = parallel.make_mesh({"data": k // model_axis, "model": model_axis}, devices=jax.devices()[:k])
    rows = k * per_device // row_len
    lengths = sentence_lengths(int(rows * row_len * (steps + 3) * 1.02), seed=1, max_len=row_len)
    tokens, offsets = random_sentences(lengths, 50304, seed=2)
    batches = pack_in_memory(tokens, offsets, rows, row_len)[:steps + 2]
    attention = attention or ("cudnn" if jax.default_backend() == "gpu" else "xla")
    attention, mlp_kernel, norm_kernel = kernels(cfg, attention, mlp_kernel, norm_kernel, rows // k, row_len)
    options = ForwardOptions(attention=attention, mlp_kernel=mlp_kernel, norm_kernel=norm_kernel,
                             activation_sharding=parallel.rows(mesh) if k > 1 else None)
    module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=options)
    from isojax.stats.options import StatsOptions
    runner = Runner(module, random_params(cfg, "bfloat16", mesh=mesh), mesh, token_stats=token_stats,
                    options=StatsOptions(exchange_rows=exchange_rows))
    t0 = time.perf_counter()
    for tok, seg, pos, _ in batches[:2]:
        runner.step(tok, seg, pos, 0)
    jax.block_until_ready(runner.acc)
    compile_s = time.perf_counter() - t0

    def loop(part):
        t = time.perf_counter()
        n = 0
        for tok, seg, pos, m in part:
            runner.step(tok, seg, pos, 0)
            n += m
        jax.block_until_ready(runner.acc)
        return n, time.perf_counter() - t

    half = 2 + steps // 2
    n_tok, secs = loop(batches[2:half])
    out = dict(model=name, devices=k, model_axis=model_axis, rows=rows, token_stats=token_stats, mlp_kernel=mlp_kernel,
               attention=attention, norm_kernel=norm_kernel,
               tokens_per_s=n_tok / secs, compile_s=compile_s,
               mfu=n_tok / secs * cfg.flops_per_token(gram=True) / (k * matmul_rate) if matmul_rate else None,
               acc_gb_per_device=runner.accumulator_bytes() / 1e9,
               peak_gb=[(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9 for d in mesh.local_devices])
    if profile:  # three more steps under the profiler, summed per kernel class over all devices
        from bench.profile_step import load_trace, summarize
        trace_dir = Path(profile) / f"{name}-{k}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            loop(batches[2:5])
        text = f"{name} on {k} devices, token stats {token_stats}\n" + summarize(load_trace(trace_dir), 3)
        print(text, file=sys.stderr, flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"profile_{name}_{k}_{int(token_stats)}.txt").write_text(text)
    if checkpoint:  # two in a row: the first also grows XLA's page-locked pool, later ones find it
        shutil.rmtree(checkpoint, ignore_errors=True)
        ckpt = checkpointing.Checkpointer(Path(checkpoint))
        if reserve:  # as isojax.extract does before its loop
            t = time.perf_counter()
            ckpt.reserve(runner.acc)
            ckpt.wait()
            out["reserve_s"] = time.perf_counter() - t
        for i in (1, 2):
            t = time.perf_counter()
            ckpt.save(i, runner.acc, {"bench": True})
            block_s = time.perf_counter() - t
            n2, secs2 = loop(batches[2:] * 2)  # steps while the files are written (each batch twice)
            t = time.perf_counter()
            ckpt.wait()
            tail_s = time.perf_counter() - t
            slowdown = secs2 - n2 / out["tokens_per_s"]
            # cost per checkpoint over the loop time of a 20M-token interval
            out[f"ckpt{i}"] = dict(block_s=block_s, loop_slowdown_s=slowdown, wait_after_s=tail_s,
                                   cost_at_20M=(block_s + max(slowdown, 0.0) + tail_s) / (20e6 / out["tokens_per_s"]))
        out["ckpt_gb"] = sum(f.stat().st_size for f in (Path(checkpoint) / "2").rglob("*") if f.is_file()) / 1e9
        shutil.rmtree(checkpoint, ignore_errors=True)
    del runner
    jax.clear_caches()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="pythia-410m,pythia-1.4b")
    ap.add_argument("--devices", default=None, help="device counts (default: 1 and all)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per run")
    ap.add_argument("--model-axis", default="1", help="split parameters over this many devices (FSDP); auto: the "
                    "smallest that fits, as extract chooses")
    ap.add_argument("--batch-per-device", type=int, default=None, help="token slots per device and step")
    ap.add_argument("--token-stats", default="on", help="on, off or on,off (per-token IntraSim)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="trace 3 steps of the largest device count "
                    "(with token stats) into DIR and print device time per kernel class")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="also time two asynchronous checkpoints on the largest device count")
    ap.add_argument("--mlp-kernel", default="xla", choices=["xla", "mosaic", "auto"], help="ForwardOptions.mlp_kernel")
    ap.add_argument("--norm-kernel", default="xla", choices=["xla", "pallas", "auto"], help="ForwardOptions.norm_kernel")
    ap.add_argument("--attention", default=None, choices=["xla", "cudnn", "packed", "auto"],
                    help="ForwardOptions.attention (default: cudnn on GPUs, else xla; auto: packed where it applies)")
    ap.add_argument("--exchange-rows", type=int, default=None,
                    help="StatsOptions.exchange_rows (default: token_sums.exchange_cap's)")
    ap.add_argument("--mfu", action="store_true", help="measure the card's bf16 matrix rate and give each run's MFU")
    ap.add_argument("--no-reserve", action="store_true",
                    help="do not grow the page-locked pool before the first checkpoint (Checkpointer.reserve)")
    args = ap.parse_args()
    counts = [int(c) for c in args.devices.split(",")] if args.devices else sorted({1, jax.device_count()})
    dev = jax.devices()[0]
    rate = None
    if args.mfu:
        from bench.bench_throughput import bf16_matmul_rate
        rate = bf16_matmul_rate()
    results = []
    for name in args.models.split(","):
        for token_stats in [t == "on" for t in args.token_stats.split(",")]:
            for k in counts:
                last = k == max(counts) and token_stats
                res = run(name, k, args.steps, args.checkpoint if last else None,
                          model_axis=args.model_axis, batch_per_device=args.batch_per_device,
                          token_stats=token_stats, profile=args.profile if last else None,
                          reserve=not args.no_reserve, mlp_kernel=args.mlp_kernel, attention=args.attention,
                          norm_kernel=args.norm_kernel, matmul_rate=rate, exchange_rows=args.exchange_rows)
                results.append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
    base = {(r["model"], r["token_stats"]): r["tokens_per_s"] for r in results if r["devices"] == 1}
    lines = [f"card: {jax.device_count()} x {dev.device_kind}; jax {jax.__version__}"
             + (f"; bf16 matmul {rate / 1e12:.0f} TFLOP/s (MFU's denominator)" if rate else ""),
             f"{'model':<13}{'tokens':>7}{'devices':>8}{'rows':>6}{'tok/s':>12}{'efficiency':>11}{'acc GB/dev':>11}"
             f"{'peak GB/dev':>12}{'compile s':>10}{'MFU':>6}  {'kernels':<22}{'ckpt GB':>8}{'1st @20M':>9}{'2nd @20M':>9}"]
    for r in results:
        key = (r["model"], r["token_stats"])
        eff = r["tokens_per_s"] / (r["devices"] * base[key]) if key in base else float("nan")
        ck = (f"{r['ckpt_gb']:>8.1f}{r['ckpt1']['cost_at_20M']:>9.1%}{r['ckpt2']['cost_at_20M']:>9.1%}"
              if "ckpt1" in r else "")
        lines.append(f"{r['model']:<13}{'on' if r['token_stats'] else 'off':>7}{str(r['devices']) + ('/m' + str(r['model_axis']) if r['model_axis'] > 1 else ''):>8}{r['rows']:>6}{r['tokens_per_s']:>12,.0f}{eff:>11.1%}"
                     f"{r['acc_gb_per_device']:>11.2f}{max(r['peak_gb']):>12.1f}{r['compile_s']:>10.1f}"
                     f"{r['mfu'] or float('nan'):>6.1%}  {r['attention'] + '/' + r['mlp_kernel'] + '/' + r['norm_kernel']:<22}" + ck)
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        tag = f"{args.models.replace(',', '_')}_{'_'.join(map(str, counts))}" + ("_noreserve" if args.no_reserve else "") + f"_{args.mlp_kernel}" + (f"_{args.attention}" if args.attention else "") + ("_m" + args.model_axis if args.model_axis != "1" else "")
        Path(os.environ["OUT"], f"bench_scaling_{tag}.txt").write_text(table + "\n")
        Path(os.environ["OUT"], f"bench_scaling_{tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
