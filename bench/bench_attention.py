"""Issue 13 experiment: attention of one layer, from the fused qkv projection to [B, T, H, K],
as the model runs it on GPUs: XLA's rotary and v slice then cuDNN (the default), against
isojax.kernels.packed_attention (rotary in the kernel, key blocks outside the query block's sequences
skipped), on the throughput benchmark's packed sentences.

    python -m bench.bench_attention [--row-len 512]

Each kernel output is compared with the cuDNN path's on the real (non-padding) positions.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np


from bench.common import timed
from bench.bench_throughput import DEFAULT_BATCH_TOKENS
from bench.common import pack_in_memory
from bench.common import random_sentences, sentence_lengths

from isojax.kernels import packed_attention
from isojax.hf.family.presets import preset
from isojax.numerics import apply_rotary, rotary_tables, segment_mask


def cudnn_path(qkv, cos, sin, seg):
    q = apply_rotary(qkv[..., 0, :], cos, sin)
    k = apply_rotary(qkv[..., 1, :], cos, sin)
    return jax.nn.dot_product_attention(q, k, qkv[..., 2, :], mask=segment_mask(seg), is_causal=True,
                                        implementation="cudnn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="pythia-70m,pythia-410m,pythia-1.4b")
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--blocks", default="64x64,128x64,64x32,128x128")
    ap.add_argument("--mean-tokens", type=float, default=None,
                    help="mean sequence length (default: the benchmark's sentences, 33); 1e6 fills every row "
                         "with one sequence (documents: nothing to skip)")
    ap.add_argument("--configs", default="4x2,4x3,8x2,8x3", help="warps x stages to try")
    args = ap.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; row length {args.row_len}")
    print(f"{'model':<13}{'path':<28}{'ms/layer':>10}{'vs cuDNN':>10}{'max |diff|':>12}{'visited':>9}")
    for name in args.models.split(","):
        cfg = preset(name)
        t = args.row_len
        rows = DEFAULT_BATCH_TOKENS.get(name, 65536) // t
        kw = {} if args.mean_tokens is None else {"mean": args.mean_tokens}
        lengths = sentence_lengths(rows * t * 2, seed=1, max_len=t, **kw)
        tokens, offsets = random_sentences(lengths, 50304, seed=2)
        _, seg, pos, _ = pack_in_memory(tokens, offsets, rows, t)[0]
        seg, pos = jnp.asarray(seg), jnp.asarray(pos)
        h, k = cfg.num_heads, cfg.head_dim
        qkv = jax.random.normal(jax.random.key(0), (rows, t, h, 3, k), jnp.bfloat16)
        cos, sin = rotary_tables(pos, cfg)
        real = np.asarray(seg) > 0
        ref_f = jax.jit(cudnn_path)
        ref = np.asarray(ref_f(qkv, cos, sin, seg).astype(jnp.float32))[real]
        base = timed(ref_f, qkv, cos, sin, seg)
        print(f"{name:<13}{'XLA rotary + slice + cuDNN':<28}{base:>10.3f}{1.0:>10.2f}{0.0:>12.2e}{'':>9}", flush=True)
        starts = np.asarray(packed_attention.segment_starts(seg))
        for spec in args.blocks.split(","):
            bq, bk = map(int, spec.split("x"))
            if not packed_attention.applies(t, k, cfg.rotary_dims, jnp.bfloat16, bq, bk):
                continue
            # key blocks visited per query block, against the causal full count
            first = starts[:, ::bq] // bk
            last = (np.arange(t // bq) + 1) * bq // bk + ((np.arange(t // bq) + 1) * bq % bk > 0)
            visited = (last[None] - first).sum() / (last[None].repeat(rows, 0)).sum()
            for warps, stages in (map(int, c.split("x")) for c in args.configs.split(",")):
                f = jax.jit(lambda qkv, cos, sin, seg, bq=bq, bk=bk, w=warps, s=stages: packed_attention.attention(
                    qkv, cos, sin, seg, block_q=bq, block_k=bk, num_warps=w, num_stages=s))
                try:
                    out = np.asarray(f(qkv, cos, sin, seg).astype(jnp.float32))[real]
                    ms = timed(f, qkv, cos, sin, seg)
                except Exception as e:  # a block shape Triton cannot build: say so, go on
                    print(f"{name:<13}{f'packed {bq}x{bk} w{warps} s{stages}':<28} failed: {str(e)[:80]}")
                    continue
                diff = float(np.abs(out - ref).max())
                print(f"{name:<13}{f'packed {bq}x{bk} w{warps} s{stages}':<28}{ms:>10.3f}{base / ms:>10.2f}"
                      f"{diff:>12.2e}{visited:>9.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
