"""Where the fused step's device time goes: a jax.profiler trace of a few steps, summed per kernel.

    python -m bench.profile_step --model pythia-1.4b [--forward-only] [--steps 3] [--out DIR]

Runs warm-up steps, traces `--steps` more, then reads the Perfetto trace JSON that
jax.profiler writes and prints device time per step by kernel class (matrix products,
attention, scatter/gather, sort, fusions of elementwise ops and reductions, copies) and the
top kernels and XLA ops. The trace itself stays under --out for a closer look
(ui.perfetto.dev opens the .trace.json.gz).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import time
from pathlib import Path


# Kernel classes, first match wins (names of cuBLAS/cuDNN/XLA kernels on Hopper).
CLASSES = [
    ("collective (NCCL)", r"nccl|all_to_all|all-to-all|collective"),
    ("attention (cuDNN or packed)", r"cudnn|fmha|flash|sdpa|packed_attention"),
    ("LayerNorm pair (Pallas)", r"layer_norm_pair"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|sm90_|triton_gemm|dot"),
    ("scatter", r"scatter"),
    ("gather", r"gather"),
    ("sort", r"sort|radix|cub"),
    ("copy / memset", r"memcpy|memset|copy|dynamic_update_slice|dynamic-update-slice"),
    ("reduction fusion", r"reduce|reduction"),
    ("elementwise fusion", r"fusion|loop_|wrapped_|convert|multiply|add|select"),
]


def classify(name: str) -> str:
    low = name.lower()
    for label, pattern in CLASSES:
        if re.search(pattern, low):
            return label
    return "other"


def load_trace(log_dir: Path) -> dict:
    files = sorted(log_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no .trace.json.gz under {log_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def summarize(trace: dict, steps: int) -> str:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"].get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = e["args"].get("name", "")
    device_pids = {p for p, n in pname.items() if re.search(r"GPU|/device:|TPU", n)}
    kernels, ops, modules = collections.Counter(), collections.Counter(), collections.Counter()
    calls = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        thread = tname.get((e["pid"], e.get("tid")), "")
        dur = float(e.get("dur", 0.0))  # microseconds
        if re.search(r"XLA Modules", thread):
            modules[e["name"]] += dur
        elif re.search(r"XLA Ops", thread):
            ops[e["name"]] += dur
        else:  # the CUDA streams: one event per kernel or copy
            kernels[e["name"]] += dur
            calls[e["name"]] += 1
    total = sum(kernels.values())
    threads = sorted({f"{pname[p]}/{t}" for (p, _), t in tname.items() if p in device_pids})
    lines = [f"device threads: {threads}",
             f"kernel time per step: {total / steps / 1e3:.1f} ms ({len(kernels)} distinct kernels)"]
    by_class = collections.Counter()
    for name, dur in kernels.items():
        by_class[classify(name)] += dur
    lines.append(f"\n{'class':<22}{'ms/step':>10}{'share':>8}")
    for label, dur in by_class.most_common():
        lines.append(f"{label:<22}{dur / steps / 1e3:>10.2f}{dur / max(total, 1):>8.1%}")
    lines.append(f"\ntop kernels\n{'ms/step':>9}{'share':>7}{'calls/step':>11}  name")
    for name, dur in kernels.most_common(40):
        lines.append(f"{dur / steps / 1e3:>9.2f}{dur / max(total, 1):>7.1%}{calls[name] / steps:>11.0f}  {name[:150]}")
    if ops:
        op_total = sum(ops.values())
        lines.append(f"\ntop XLA ops ({op_total / steps / 1e3:.1f} ms/step)\n{'ms/step':>9}{'share':>7}  op")
        for name, dur in ops.most_common(40):
            lines.append(f"{dur / steps / 1e3:>9.2f}{dur / op_total:>7.1%}  {name[:150]}")
    if modules:
        lines.append("\nXLA modules (ms/step): " + ", ".join(
            f"{n[:60]} {d / steps / 1e3:.1f}" for n, d in modules.most_common(5)))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pythia-1.4b")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forward-only", action="store_true", help="no statistics (a no-op observer)")
    ap.add_argument("--no-token-stats", action="store_true")
    ap.add_argument("--attention", default="cudnn")
    ap.add_argument("--no-causal", action="store_true", help="ForwardOptions(cudnn_causal=False)")
    ap.add_argument("--mlp-kernel", default="xla", choices=["xla", "mosaic"], help="ForwardOptions.mlp_kernel")
    ap.add_argument("--norm-kernel", default="xla", choices=["xla", "pallas"], help="ForwardOptions.norm_kernel")
    ap.add_argument("--out", default="/tmp/isojax_profile")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from bench.common import pack_in_memory
    from bench.common import random_sentences, sentence_lengths
    from isojax.hf.family.presets import preset
    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder
    from isojax.device.runner import Runner
    from isojax.device import mesh as parallel
    from isojax.model.options import ForwardOptions
    cfg = preset(args.model)
    n_batches = args.steps + 2
    lengths = sentence_lengths(int(args.rows * args.row_len * (n_batches + 1)), seed=1, max_len=args.row_len)
    tokens, offsets = random_sentences(lengths, cfg.vocab_size, seed=2)
    batches = pack_in_memory(tokens, offsets, args.rows, args.row_len)[:n_batches]
    params = random_params(cfg, "bfloat16")
    module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                     options=ForwardOptions(attention=args.attention, cudnn_causal=not args.no_causal,
                                            mlp_kernel=args.mlp_kernel, norm_kernel=args.norm_kernel))
    if args.forward_only:
        noop = lambda obs, s, x: obs + x[0, 0, 0].astype(jnp.float32)
        fwd = jax.jit(lambda p, a, b, c: module.apply({"params": p}, a, b, c, jnp.float32(0), noop))
        step = lambda b: fwd(params, b[0], b[1], b[2])
    else:
        runner = Runner(module, params, parallel.make_mesh(devices=jax.devices()[:1]),
                        token_stats=not args.no_token_stats)

        def step(b):
            runner.step(b[0], b[1], b[2], 0)
            return runner.acc
    for b in batches[:2]:
        jax.block_until_ready(step(b))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        for b in batches[2:]:
            out = step(b)
        jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / args.steps
    n_tok = sum(b[3] for b in batches[2:]) / args.steps
    head = (f"{args.model} {'forward only' if args.forward_only else 'forward + statistics'}"
            f"{' (no token stats)' if args.no_token_stats else ''}, {args.rows}x{args.row_len}, "
            f"attention {args.attention}, {jax.devices()[0].device_kind}, jax {jax.__version__}\n"
            f"traced wall per step {wall * 1e3:.1f} ms ({n_tok / wall:,.0f} tok/s under the profiler)")
    print(head + "\n" + summarize(load_trace(out_dir), args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
