"""Where the time goes: tokens/s of the fused step with parts switched off, one model, same card.

    python bench/breakdown.py --model pythia-1.4b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_throughput import pack_in_memory  # noqa: E402
from workload import random_sentences, sentence_lengths  # noqa: E402
from isojax.config import preset  # noqa: E402
from isojax.loading import random_params  # noqa: E402
from isojax.model import GPTNeoX  # noqa: E402
from isojax.runner import Runner  # noqa: E402


def rate(step, batches, warmup=2):
    for b in batches[:warmup]:
        out = step(b)
    jax.block_until_ready(out)
    t, n = time.perf_counter(), 0
    for b in batches[warmup:]:
        out = step(b)
        n += b[3]
    jax.block_until_ready(out)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pythia-1.4b")
    ap.add_argument("--tokens", type=float, default=1e6)
    args = ap.parse_args()
    cfg = preset(args.model)
    params = random_params(cfg, "bfloat16")
    lengths = sentence_lengths(int(args.tokens), seed=1, max_len=256)
    tokens, offsets = random_sentences(lengths, cfg.vocab_size, seed=2)
    packs = {(r, t): pack_in_memory(tokens, offsets, r, t) for r, t in ((128, 512), (256, 256), (256, 512))}
    noop = lambda obs, s, x: obs + x[0, 0, 0].astype(jnp.float32)
    for attn in ("cudnn", "xla"):
        m = GPTNeoX(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_impl=attn)
        f = jax.jit(lambda p, a, b, c, m=m: m.apply({"params": p}, a, b, c, jnp.float32(0), noop))
        r = rate(lambda b: f(params, b[0], b[1], b[2]), packs[(128, 512)])
        print(f"{args.model} forward only, attention={attn}, 128x512: {r:,.0f} tok/s", flush=True)
    m = GPTNeoX(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_impl="cudnn")
    for token_stats, shape in ((False, (128, 512)), (True, (128, 512)), (True, (256, 256)), (True, (256, 512))):
        runner = Runner(m, params, token_stats=token_stats)

        def step(b, runner=runner):
            runner.step(b[0], b[1], b[2], 0)
            return runner.acc
        r = rate(step, packs[shape])
        print(f"{args.model} forward + stats, token_stats={token_stats}, {shape[0]}x{shape[1]}: {r:,.0f} tok/s",
              flush=True)
        del runner


if __name__ == "__main__":
    main()
