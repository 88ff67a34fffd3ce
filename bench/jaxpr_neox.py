"""Fingerprints of the GPT-NeoX forward's traced program (jaxpr), to check that a change to the
model leaves the tuned GPT-NeoX step alone: run on two commits and compare the lines.

    JAX_PLATFORMS=cpu python -m bench.jaxpr_neox [--model pythia-70m] [--out jaxprs.txt] [--every-preset]

Three programs at [2, 128] rows: float32 with XLA attention; bfloat16 with the packed attention
kernel; bfloat16 with the fused MLP and LayerNorm-pair kernels requested (on a CPU they fall back
inside the trace, as they would on a GPU where they do not apply). --every-preset: the same
three programs of every preset, of every family, one line each (a program the preset's shapes do
not allow, such as the packed kernel at a head size it does not take, says so).
"""

from __future__ import annotations

import argparse
import hashlib

import jax
import jax.numpy as jnp

from isojax.hf.family.presets import preset, preset_names
from isojax.model.decoder import Decoder, collect_states, param_shapes
from isojax.model.options import ForwardOptions

PROGRAMS = {"float32-xla": (jnp.float32, ForwardOptions()),
            "bfloat16-packed": (jnp.bfloat16, ForwardOptions(attention="packed")),
            "bfloat16-kernels": (jnp.bfloat16, ForwardOptions(mlp_kernel="mosaic", norm_kernel="pallas"))}


def program(cfg, dtype, options) -> str:
    """The traced forward of `cfg` at [2, 128] rows, observed by collect_states, as text."""
    rows = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    buf = jax.ShapeDtypeStruct((cfg.num_states, 2, 128, cfg.hidden_size), jnp.float32)
    module = Decoder(cfg, dtype=dtype, param_dtype=dtype, options=options)
    forward = lambda p, t, s, q, b: module.apply({"params": p}, t, s, q, b, collect_states)
    return str(jax.make_jaxpr(forward)(param_shapes(cfg, dtype), rows, rows, rows, buf))


def jaxprs(model: str) -> dict[str, str]:
    return {name: program(preset(model), dtype, options) for name, (dtype, options) in PROGRAMS.items()}


def fingerprint(text: str) -> str:
    return f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text)} chars)"


def every_preset() -> None:
    for model in preset_names():
        for name, (dtype, options) in PROGRAMS.items():
            try:
                line = fingerprint(program(preset(model), dtype, options))
            except Exception as e:  # noqa: BLE001 - a kernel refusing these shapes
                line = f"not traced ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
            print(f"{model} {name}: {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pythia-70m")
    ap.add_argument("--out", help="also write the jaxprs themselves here (to diff them)")
    ap.add_argument("--every-preset", action="store_true", help="fingerprint every preset's programs instead")
    args = ap.parse_args()
    if args.every_preset:
        return every_preset()
    programs = jaxprs(args.model)
    for name, text in programs.items():
        print(f"{name}: {fingerprint(text)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n=====\n".join(f"{name}\n{text}" for name, text in programs.items()))


if __name__ == "__main__":
    main()
