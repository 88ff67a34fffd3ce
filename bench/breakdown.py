"""Where the time goes: tokens/s of the fused step with parts switched off or changed, one
model, same card, one variant alive at a time.

    python -m bench.breakdown --model pythia-1.4b [--variants fwd,fwd_nocausal,full,full_b256k,...]

Variants (all bf16, random weights, the bench workload of bench_throughput.py):
  fwd            forward only, cuDNN attention with the boolean segment mask
  fwd_nocausal   the same without telling cuDNN the mask is causal (no block skipping)
  fwd_xla        forward only, XLA attention (dense masked softmax)
  nostats_tok    forward + all statistics except the per-token sums
  full           forward + all statistics (what `isojax.extract` runs)
  full_chunkN    full, per-token update in one round of N rows (StatsOptions.token_chunk = N)
  full_chunk2048 / full_chunk8192   rounds of 2048 / 8192 distinct tokens
  fwd_gelu_xla   forward with jax's erf in the GELU (ForwardOptions.fast_gelu off)
  full_gram1     full with each batch Gram as one [D, D] product (StatsOptions.gram_block = inf)
  full_gram1024  full with Gram blocks of 1024 columns (StatsOptions.gram_block = 1024)
  full_hint / full_nohint   per-token segment sums with / without XLA's sorted-indices hint
  *_256          on rows of 256 (256 x 256) instead of 128 x 512
  *_b256k        on 512 x 512 rows (262,144 token slots per batch)
  *_b256k_256    on 1024 x 256 rows
"""

from __future__ import annotations

import argparse
import functools
import gc
import time


import jax
import jax.numpy as jnp

from bench.common import pack_in_memory
from bench.common import random_sentences, sentence_lengths
import dataclasses

from isojax.device import mesh as parallel
from isojax.hf.family.presets import preset
from isojax.hf.loading import random_params
from isojax.model.decoder import Decoder
from isojax.model.options import ForwardOptions
from isojax.stats.options import StatsOptions
from isojax.device.runner import Runner

ALL = ("fwd_nocausal,fwd,fwd_gelu_xla,fwd_xla,nostats_tok,full,full_chunkN,full_chunk2048,"
       "full_chunk8192,full_gram1,full_hint,full_256,full_b256k")
# variant -> settings of the forward (ForwardOptions) or of the statistics (StatsOptions)
FORWARD = {"fwd_nocausal": {"cudnn_causal": False}, "fwd_gelu_xla": {"fast_gelu": False}, "fwd_xla": {"attention": "xla"}}
STATS = {
    "full_chunk2048": {"token_chunk": 2048},
    "full_chunk8192": {"token_chunk": 8192},
    "full_gram1": {"gram_block": 1 << 30},
    "full_nohint": {"sorted_scatter_max_d": 0},
    "full_hint": {"sorted_scatter_max_d": 1 << 30},
    "full_gram1024": {"gram_block": 1024},
}
CAUSAL = {"cudnn_causal": True}  # turned off if cuDNN refuses it


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


# variant name suffix -> rows x row_len (no suffix: 128 x 512)
SHAPES = {"_256": (256, 256), "_b256k": (512, 512), "_b256k_256": (1024, 256)}


def run_variant(name, cfg, params, packs):
    suffix = next((k for k in sorted(SHAPES, key=len, reverse=True) if name.endswith(k)), "")
    shape = SHAPES.get(suffix, (128, 512))
    name = name.removesuffix(suffix) if suffix else name
    batches = packs(shape)
    forward = ForwardOptions(**{"attention": "cudnn", **CAUSAL, **FORWARD.get(name, {})})
    module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=forward)
    stats_options = StatsOptions(**STATS.get(name, {}))
    if name == "full_chunkN":
        stats_options = dataclasses.replace(stats_options, token_chunk=shape[0] * shape[1] + 1)  # one round
    try:
        if name.startswith("fwd"):
            noop = lambda obs, s, x: obs + x[0, 0, 0].astype(jnp.float32)
            f = jax.jit(lambda p, a, b, c: module.apply({"params": p}, a, b, c, jnp.float32(0), noop))
            return rate(lambda b: f(params, b[0], b[1], b[2]), batches)
        runner = Runner(module, params, parallel.make_mesh(devices=jax.devices()[:1]),
                        token_stats=name != "nostats_tok", options=stats_options)

        def step(b):
            runner.step(b[0], b[1], b[2], 0)
            return runner.acc
        r = rate(step, batches)
        del runner, step
        return r
    finally:
        jax.clear_caches()
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pythia-1.4b")
    ap.add_argument("--tokens", type=float, default=1e6)
    ap.add_argument("--variants", default=ALL)
    args = ap.parse_args()
    cfg = preset(args.model)
    params = random_params(cfg, "bfloat16")
    lengths = sentence_lengths(int(args.tokens), seed=1, max_len=256)
    tokens, offsets = random_sentences(lengths, cfg.vocab_size, seed=2)
    # the last, partly filled batch is left out: it would count as padding
    packs = functools.cache(lambda shape: pack_in_memory(tokens, offsets, *shape)[:-1])
    print(f"{args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for name in args.variants.split(","):
        try:
            r = run_variant(name, cfg, params, packs)
            print(f"{name:<14} {r:>12,.0f} tok/s", flush=True)
        except Exception as e:  # keep going: one failing variant must not hide the others
            print(f"{name:<14} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if name == "fwd" and CAUSAL["cudnn_causal"]:
                CAUSAL["cudnn_causal"] = False
                print("(cuDNN refused the causal flag: the remaining variants run without it)", flush=True)


if __name__ == "__main__":
    main()
