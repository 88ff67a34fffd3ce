"""Fingerprints of the GPT-NeoX forward's traced program (jaxpr), to check that a change to the
model leaves the tuned GPT-NeoX step alone: run on two commits and compare the lines.

    JAX_PLATFORMS=cpu python -m bench.jaxpr_neox [--model pythia-70m] [--out jaxprs.txt]

Three programs at [2, 128] rows: float32 with XLA attention; bfloat16 with the packed attention
kernel; bfloat16 with the fused MLP and LayerNorm-pair kernels requested (on a CPU they fall back
inside the trace, as they would on a GPU where they do not apply).
"""

from __future__ import annotations

import argparse
import hashlib

import jax
import jax.numpy as jnp

from isojax.hf.family.presets import preset
from isojax.model.decoder import Decoder, collect_states, param_shapes
from isojax.model.options import ForwardOptions

PROGRAMS = {"float32-xla": (jnp.float32, ForwardOptions()),
            "bfloat16-packed": (jnp.bfloat16, ForwardOptions(attention="packed")),
            "bfloat16-kernels": (jnp.bfloat16, ForwardOptions(mlp_kernel="mosaic", norm_kernel="pallas"))}


def jaxprs(model: str) -> dict[str, str]:
    cfg = preset(model)
    rows = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    buf = jax.ShapeDtypeStruct((cfg.num_states, 2, 128, cfg.hidden_size), jnp.float32)
    out = {}
    for name, (dtype, options) in PROGRAMS.items():
        module = Decoder(cfg, dtype=dtype, param_dtype=dtype, options=options)
        forward = lambda p, t, s, q, b: module.apply({"params": p}, t, s, q, b, collect_states)
        out[name] = str(jax.make_jaxpr(forward)(param_shapes(cfg, dtype), rows, rows, rows, buf))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pythia-70m")
    ap.add_argument("--out", help="also write the jaxprs themselves here (to diff them)")
    args = ap.parse_args()
    programs = jaxprs(args.model)
    for name, text in programs.items():
        print(f"{name}: sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text)} chars)")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n=====\n".join(f"{name}\n{text}" for name, text in programs.items()))


if __name__ == "__main__":
    main()
