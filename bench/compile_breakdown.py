"""Where a first run's step compile goes (issue 39): the step of `extract` (one source, the default
sample, extract's batch) compiled from shapes as the plan compiles it (device/ahead.py), with no
persistent cache, each variant in a fresh process: the kernels extract chooses on a GPU against
XLA's paths, and XLA's GPU autotuning on (its default) against off. Prints a table; no weights.

    python -m bench.compile_breakdown --model pythia-1.4b
    python -m bench.compile_breakdown --model pythia-1b --variants packed/mosaic/pallas:4,xla/xla/xla:0

A variant is attention/mlp/norm:autotune level (XLA's --xla_gpu_autotune_level; 4 is its default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = "packed/mosaic/pallas:4,packed/mosaic/pallas:0,cudnn/xla/xla:4,cudnn/xla/xla:0"


def compile_once(model: str, kernels: str) -> dict:
    """In this process: seconds to lower and to compile the step of `model` with `kernels`."""
    from bench import bench_throughput  # noqa: F401  (XLA's flags as extract sets them)
    import jax

    from isojax.device import ahead
    from isojax.device import mesh as parallel
    from isojax.device.memory import default_sample_size, device_batch_tokens
    from isojax.device.runner import Layout
    from isojax.hf.family.presets import preset
    from isojax.hf.loading import abstract_params, build_module
    from isojax.model.options import KernelChoice

    attention, mlp, norm = kernels.split("/")
    cfg, dtype, row_len = preset(model), "bfloat16", 512
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    rows = device_batch_tokens(cfg) // row_len
    layout = Layout(build_module(cfg, dtype, KernelChoice(attention, mlp, norm)), mesh, token_stats=True,
                    num_groups=1, sample_size=default_sample_size(cfg, dtype))
    t = time.perf_counter()
    ahead.compile_step(layout, abstract_params(cfg, dtype, mesh), rows, row_len)
    return {"compile_s": time.perf_counter() - t, "card": jax.devices()[0].device_kind, "jax": jax.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pythia-1.4b")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # in the child: attention/mlp/norm
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(compile_once(args.model, args.one)))
        return 0
    lines, card = [], None
    for variant in args.variants.split(","):
        kernels, level = variant.split(":")
        flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), f"--xla_gpu_autotune_level={level}") if f)
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_COMPILATION_CACHE_DIR": "", "ISOJAX_CACHE": "/nonexistent"}
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "bench.compile_breakdown", "--model", args.model, "--one", kernels],
                           env=env, cwd=REPO, capture_output=True, text=True)
        process_s = time.perf_counter() - t
        try:
            got = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            lines.append(f"{kernels:<24}{level:>9}  failed: {(p.stderr.strip().splitlines() or ['?'])[-1][:200]}")
            continue
        card = got["card"]
        lines.append(f"{kernels:<24}{level:>9}{got['compile_s']:>12.1f}{process_s:>11.1f}")
        print(lines[-1], flush=True)
    head = f"{'attention/MLP/norms':<24}{'autotune':>9}{'compile s':>12}{'process s':>11}"
    table = "\n".join([f"{args.model}, extract's step (one source, default sample), bf16; card: {card}", head,
                       "-" * len(head), *lines])
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "compile_breakdown.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
