"""End-to-end throughput: isojax vs the Hugging Face PyTorch peer, same process, same card.

isojax: packed rows from token ids already in memory (the host pipeline is benchmarked in
bench_data.py), bf16 forward, full statistics of every state (unit sums, centered Gram of
states and of unit vectors, per-token IntraSim), fused into the layer scan.
Peer (bench/peer_hf.py): bf16 transformers GPTNeoX, SDPA, output_hidden_states, length-sorted
padded batches, unit sums + per-token index_add_ (DESIGN.md's measured peer: no Gram).

    python -m bench.bench_throughput                       # 70m, 410m, 1.4b
    python -m bench.bench_throughput --models pythia-70m --tokens 2e6 --no-peer
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the card with torch
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")

import jax
import jax.numpy as jnp

from bench.common import pack_in_memory,  random_sentences, sentence_lengths

from isojax.extract import use_cuda_graphs_for_loops

use_cuda_graphs_for_loops()  # as isojax.extract does (XLA_FLAGS that set command buffers win)

DEFAULT_TOKENS = {"pythia-70m": 1.2e7, "pythia-410m": 4e6, "pythia-1.4b": 1.5e6}
# Token slots per batch, by model (bench/breakdown.py: the small models gain 10-15% from
# 262,144-token batches; isojax.extract's default does the same by width).
DEFAULT_BATCH_TOKENS = {"pythia-70m": 262144, "pythia-410m": 262144, "pythia-1.4b": 65536}


def bf16_matmul_rate(n: int = 8192) -> float:
    """Measured dense bf16 matrix rate of this card (FLOP/s), the MFU denominator (n x n products;
    a small n for a CPU's look)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        out = f(a)
    out.block_until_ready()
    return 10 * 2 * n ** 3 / (time.perf_counter() - t)


def run_isojax(name, tokens, offsets, *, row_len, batch_tokens, attention, token_stats, mlp_kernel="xla",
               norm_kernel="xla", gram_block=512, warmup=2, dtype="bfloat16"):
    """isojax's step over the packed workload: `name` a preset or a ModelConfig of any family."""
    from isojax.model.config import ModelConfig
    from isojax.hf.family.presets import preset
    from isojax.hf.loading import random_params
    from isojax.device import mesh as parallel
    from isojax.model.decoder import model_class
    from isojax.numerics import DTYPES
    from isojax.model.options import ForwardOptions
    from isojax.stats.options import StatsOptions
    from isojax.device.runner import Runner
    cfg = name if isinstance(name, ModelConfig) else preset(name)
    rows = max(1, batch_tokens // row_len)
    t0 = time.perf_counter()
    # The last, partly filled batch is left out (over 10^8 tokens it is noise; here it would
    # add several points of padding).
    batches = pack_in_memory(tokens, offsets, rows, row_len)[:-1]
    pack_s = time.perf_counter() - t0
    module = model_class(cfg)(cfg, dtype=DTYPES[dtype], param_dtype=DTYPES[dtype],
                              options=ForwardOptions(attention=attention, mlp_kernel=mlp_kernel, norm_kernel=norm_kernel))
    runner = Runner(module, random_params(cfg, dtype), parallel.make_mesh(devices=jax.devices()[:1]),
                    token_stats=token_stats, options=StatsOptions(gram_block=gram_block))
    t0 = time.perf_counter()
    for tok, seg, pos, _ in batches[:warmup]:
        runner.step(tok, seg, pos, 0)
    jax.block_until_ready(runner.acc)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_tok = 0
    for tok, seg, pos, n in batches[warmup:]:
        runner.step(tok, seg, pos, 0)
        n_tok += n
    jax.block_until_ready(runner.acc)
    secs = time.perf_counter() - t0
    slots = sum(b[0].size for b in batches[warmup:])
    mem = jax.local_devices()[0].memory_stats() or {}
    out = dict(tokens_per_s=n_tok / secs, tokens=n_tok, seconds=secs, padding_fraction=1 - n_tok / slots,
               peak_mem_bytes=mem.get("peak_bytes_in_use"), compile_s=compile_s, pack_s=pack_s,
               flops_per_token=cfg.flops_per_token(gram=True), rows=rows, row_len=row_len, mlp_kernel=mlp_kernel,
               norm_kernel=norm_kernel, gram_block=gram_block,
               attention=attention)
    del runner
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="pythia-70m,pythia-410m,pythia-1.4b")
    ap.add_argument("--tokens", type=float, default=None, help="tokens per model (default: by size)")
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: by model (DEFAULT_BATCH_TOKENS)")
    ap.add_argument("--attention", default="cudnn",
                    help="comma-separated: xla, cudnn, packed, auto (each runs, as --mlp-kernel's)")
    ap.add_argument("--no-token-stats", action="store_true")
    ap.add_argument("--mlp-kernel", default=None,
                    help="comma list of ForwardOptions.mlp_kernel to run (default: xla, and mosaic on Hopper GPUs)")
    ap.add_argument("--norm-kernel", default="xla",
                    help="comma list of ForwardOptions.norm_kernel to run (xla, pallas; default: xla)")
    ap.add_argument("--gram-block", type=int, default=512, help="StatsOptions.gram_block (default 512)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-batch-tokens", type=int, default=16384)
    ap.add_argument("--peer-seconds", type=float, default=40.0, help="cap on each peer run")
    args = ap.parse_args(argv)

    rate = bf16_matmul_rate()
    dev = jax.devices()[0]
    lines = [f"card: {dev.device_kind}; jax {jax.__version__}; measured bf16 matmul {rate / 1e12:.0f} TFLOP/s"]
    rows_out = []
    from isojax.kernels import mlp as kernels
    mlp_kernels = args.mlp_kernel.split(",") if args.mlp_kernel else ["xla"] + ["mosaic"] * kernels.available()
    for name in args.models.split(","):
        n = int(args.tokens or DEFAULT_TOKENS.get(name, 1e6))
        lengths = sentence_lengths(n, seed=1, max_len=args.row_len)  # longer ones would be windows
        tokens, offsets = random_sentences(lengths, 50304, seed=2)
        peer_row = len(rows_out)
        for attention, mlp, norm in itertools.product(args.attention.split(","), mlp_kernels,
                                                      args.norm_kernel.split(",")):
            res = {"model": name, "isojax": run_isojax(name, tokens, offsets, row_len=args.row_len,
                                                       batch_tokens=args.batch_tokens or DEFAULT_BATCH_TOKENS.get(name, 65536),
                                                       attention=attention, token_stats=not args.no_token_stats,
                                                       mlp_kernel=mlp, norm_kernel=norm, gram_block=args.gram_block)}
            res["isojax"]["mfu"] = res["isojax"]["tokens_per_s"] * res["isojax"]["flops_per_token"] / rate
            print(f"{name} ({attention}, {mlp}, {norm}): isojax {res['isojax']['tokens_per_s']:,.0f} tok/s, "
                  f"compile {res['isojax']['compile_s']:.0f} s", flush=True)
            rows_out.append(res)
            jax.clear_caches()
        res = rows_out[peer_row]
        jax.clear_caches()
        if not args.no_peer:
            import torch
            from bench.peer_hf import run_peer
            torch.cuda.reset_peak_memory_stats()
            res["peer"] = run_peer(name, tokens, offsets, batch_tokens=args.peer_batch_tokens, sort_by_length=True,
                                   gram=False, max_seconds=args.peer_seconds)
            res["peer"].pop("stats", None)
            torch.cuda.empty_cache()
            for r in rows_out[peer_row + 1:]:
                r["peer"] = res["peer"]
        for r in rows_out[peer_row:]:
            print(json.dumps(r, default=str), file=sys.stderr, flush=True)

    lines.append(f"{'model':<13}{'attention':>10}{'MLP':>7}{'norm':>7}{'B x T':>10}{'isojax tok/s':>14}{'peer tok/s':>12}{'ratio':>7}{'MFU':>7}{'pad':>7}"
                 f"{'peak GB':>9}{'peer GB':>9}{'compile s':>10}")
    for r in rows_out:
        iso, peer = r["isojax"], r.get("peer")
        ratio = iso["tokens_per_s"] / peer["tokens_per_s"] if peer else float("nan")
        lines.append(f"{r['model']:<13}{iso['attention']:>10}{iso['mlp_kernel']:>7}{iso['norm_kernel']:>7}{str(iso['rows']) + 'x' + str(iso['row_len']):>10}{iso['tokens_per_s']:>14,.0f}{(peer or {}).get('tokens_per_s', float('nan')):>12,.0f}"
                     f"{ratio:>7.2f}{iso['mfu']:>7.1%}{iso['padding_fraction']:>7.1%}"
                     f"{(iso['peak_mem_bytes'] or 0) / 1e9:>9.1f}{((peer or {}).get('peak_mem_bytes') or 0) / 1e9:>9.1f}"
                     f"{iso['compile_s']:>10.1f}")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_throughput.txt").write_text(table + "\n")
        Path(os.environ["OUT"], "bench_throughput.json").write_text(json.dumps(rows_out, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
