"""Compile time of the fused step, piece by piece (which part makes GPU compiles slow).

    python -m bench.compile_profile --model pythia-70m
"""

from __future__ import annotations

import argparse
import dataclasses
import time


import jax
import jax.numpy as jnp
import numpy as np

from isojax.device import mesh as parallel
from isojax.model.options import ForwardOptions
from isojax.stats.options import StatsOptions
from isojax.hf.family.presets import preset
from isojax.hf.loading import random_params
from isojax.model.decoder import Decoder
from isojax.device.runner import Runner


def timed_compile(label, fn, *args):
    t = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    print(f"{label:<44} lower {t1 - t:6.1f} s   compile {time.perf_counter() - t1:6.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pythia-70m")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--attention", default="cudnn")
    args = ap.parse_args()
    cfg = preset(args.model)
    b, t = args.rows, args.row_len
    tok = np.zeros((b, t), np.int32)
    seg = np.ones((b, t), np.int32)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    params = random_params(cfg, "bfloat16")
    module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention=args.attention))
    noop = lambda obs, s, x: obs + x[0, 0, 0].astype(jnp.float32)
    fwd = jax.jit(lambda p, a, c, d: module.apply({"params": p}, a, c, d, jnp.float32(0), noop))
    timed_compile("forward only", fwd, params, tok, seg, pos)
    one = dataclasses.replace(cfg, num_layers=1)
    for token_stats in (False, True):
        for mode in ("scatter", "scan") if token_stats else (None,):
            for c in (one, cfg):
                m = Decoder(c, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention=args.attention))
                r = Runner(m, random_params(c, "bfloat16"), parallel.make_mesh(devices=jax.devices()[:1]),
                           token_stats=token_stats, options=StatsOptions(segment_sum=mode or "auto"))
                rows = jax.device_put((tok, seg, pos), parallel.rows(r.mesh))
                timed_compile(f"L={c.num_layers} token_stats={token_stats} segsum={mode}", r._step, r.params, r.acc,
                              *rows, jnp.int32(0), r.centers_SxD)


if __name__ == "__main__":
    main()
