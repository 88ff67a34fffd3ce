"""Hashes of the step's compiled program, to show that a change to the statistics leaves the step alone:
run on two commits (PYTHONPATH) and compare the lines.

    PYTHONPATH=CHECKOUT python CHECKOUT2/bench/step_program.py [--devices 1 2] [--configs NAME ...] [--out DIR]

(run by its path, from outside a checkout, so that `isojax` is PYTHONPATH's: the first line names it.)

For each configuration (CONFIGS) of a tiny GPT-NeoX (D = 64, 2 layers, V = 512, rows 4 x 64 per device; its
shapes only: the program does not depend on the weights): the jitted step the runner uses (device/runner.py
Layout.step, as run.plan builds it: the module split by rows over the mesh, the statistics' options with the
registry's default step measures; a "-centered" one: the second pass of --centered after that first pass, as
Runner.second_pass builds it), lowered from shapes and compiled (device/ahead.py compile_step), then its
optimized HLO text canonicalized: metadata, the source locations' tables and the module's name left out,
instruction, computation and parameter names numbered in order of appearance, so that only a change of the
program itself changes the hash. The device count is a process setting: each count
runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count (2 devices: the token part split
over both, token_shards 2). --out writes each canonical text (to diff two commits' programs); --compare A B
compares two such folders, telling apart programs that differ only by zero-size arrays passed through (and, with
them gone, by the order in which ENTRY runs instructions that do not depend on each other).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys

CONFIGS = {  # name -> (dtype, token_stats, groups, skip_positions, sample_size, centered)
    "f32": ("float32", True, 1, 0, 64, False),
    "bf16": ("bfloat16", True, 1, 0, 64, False),
    "f32-no-tokens": ("float32", False, 1, 0, 64, False),
    "bf16-no-tokens": ("bfloat16", False, 1, 0, 64, False),
    "f32-groups3": ("float32", True, 3, 0, 64, False),
    "f32-skip2": ("float32", True, 1, 2, 64, False),
    "bf16-skip2-groups2": ("bfloat16", True, 2, 2, 64, False),
    "f32-no-sample": ("float32", True, 1, 0, 0, False),
    # the second pass of --centered after the first pass of these settings (Runner.second_pass: no token stats,
    # no sample, no step measure of the first pass; the centers [S, D] an argument)
    "f32-centered": ("float32", True, 1, 0, 64, True),
    "bf16-centered": ("bfloat16", True, 1, 0, 64, True),
    "bf16-skip2-groups2-centered": ("bfloat16", True, 2, 2, 64, True),
}
TINY_NEOX = dict(model_type="gpt_neox", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu",
                 max_position_embeddings=2048, layer_norm_eps=1e-5)
ROWS, ROW_LEN = 4, 64


def canonical(hlo: str) -> str:
    """The HLO text with what does not change the program left out (metadata, the source locations'
    tables, the module's name) or numbered in order of appearance (instructions, computations, parameters)."""
    hlo = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n", "", hlo, flags=re.S | re.M)
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"^HloModule \S+", "HloModule m", hlo, flags=re.M)
    names: dict[str, str] = {}

    def rename(m):
        return names.setdefault(m.group(1), f"n{len(names)}")

    hlo = re.sub(r"^((?:ENTRY )?%[\w.\-]+ \()(.*)(\) -> )", lambda m: m.group(1) + re.sub(
        r"([\w.\-]+): ", lambda p: f"%{p.group(1)}: ", m.group(2)) + m.group(3), hlo, flags=re.M)
    return re.sub(r"%([\w.\-]+)", lambda m: "%" + rename(m), hlo)


def program(name: str) -> str:
    """The canonical optimized HLO of configuration `name` on this process's devices."""
    import jax

    from isojax.device import ahead
    from isojax.device.mesh import make_mesh
    from isojax.device.runner import Layout
    from isojax.hf.family import from_hf_dict
    from isojax.hf.loading import abstract_params, build_module
    from isojax.run.plan import step_module
    from isojax.stats.measures import step_settings
    from isojax.stats.options import StatsOptions

    dtype, token_stats, groups, skip, sample_size, centered = CONFIGS[name]
    cfg = from_hf_dict(TINY_NEOX, name="tiny-neox")
    mesh = make_mesh()
    module = step_module(build_module(cfg, dtype), mesh)
    options = StatsOptions(skip_positions=skip, step_measures=step_settings({}, token_stats))
    layout = Layout(module, mesh, token_stats=token_stats, num_groups=groups, sample_size=sample_size, options=options)
    rows = ROWS * mesh.size
    params = abstract_params(cfg, dtype, mesh)
    if centered:  # Runner.second_pass's layout, its step compiled for centers [S, D] (compile_step's are [S, 0])
        import dataclasses

        import numpy as np

        from isojax.device import mesh as parallel
        from isojax.device.runner import signature
        layout = Layout(module, mesh, token_stats=False, num_groups=groups, centered=True,
                        options=dataclasses.replace(layout.options, step_measures=()))
        centers = jax.ShapeDtypeStruct((cfg.num_states, cfg.hidden_size), np.float32,
                                       sharding=parallel.replicated(mesh))
        compiled = layout.step().lower(*signature(params, layout.abstract, mesh, rows, ROW_LEN, centers)).compile()
    else:
        compiled, _ = ahead.compile_step(layout, params, rows, ROW_LEN)
    assert len(jax.devices()) == mesh.size
    return canonical(compiled.as_text())


def hashes(configs, out: str | None) -> dict[str, str]:
    import jax
    result = {}
    for name in configs:
        text = program(name)
        result[name] = f"{hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text)} chars)"
        if out:
            with open(os.path.join(out, f"{name}-{len(jax.devices())}dev.hlo"), "w") as f:
                f.write(text)
    return result


def without_empty(hlo: str) -> tuple[str, str, int]:
    """(the text before ENTRY, ENTRY's body, the number of its instructions left out): the canonical text with
    ENTRY's zero-size instructions (parameters, constants and copies of arrays with a 0 in their shape: an empty
    accumulator field) left out, its signature line aside and its names and parameters numbered again (the
    parameters in the order of their numbers), so that two programs that differ only by empty arrays passed
    through compare equal (--compare)."""
    head, entry = hlo.split("\nENTRY ", 1)
    base = int(re.match(r"%n(\d+)", entry).group(1))
    gone, kept = set(), []
    for line in entry.split("\n")[1:]:
        m = re.match(r"\s*(?:ROOT )?(%n\d+) = \w+\[([\d,]*)\]", line)
        if m and "0" in m.group(2).split(","):
            gone.add(m.group(1))
            continue
        kept.append(line)
    body = "\n".join(kept)
    body = re.sub(r"(%n\d+)\b(, )?", lambda m: "" if m.group(1) in gone else m.group(0), body)
    body = re.sub(r"\w+\[[\d,]*\b0\b[\d,]*\]\{[\d,]*\}(, )?", "", re.sub(r"/\*index=\d+\*/", "", body))
    body = re.sub(r", \)", ")", body)
    ranks = {n: i for i, n in enumerate(sorted({int(n) for n in re.findall(r"parameter\((\d+)\)", body)}))}
    body = re.sub(r"parameter\((\d+)\)", lambda m: f"parameter({ranks[int(m.group(1))]})", body)
    names: dict[str, str] = {}
    body = re.sub(r"%n(\d+)", lambda m: names.setdefault(m.group(0), f"%e{len(names)}")
                  if int(m.group(1)) > base else m.group(0), body)
    return head.split("\n", 1)[1], body, len(gone)


def _dataflow(body: str) -> list[str]:
    """ENTRY's body (without_empty's) as its instructions, each with its own name left out and its operands' names
    replaced by a hash of what computes them (opcode, shape, attributes and, in turn, their operands), in the
    order they run: two bodies with equal sorted lists compute the same instructions on the same operands, in
    another order at most (a schedule's order of instructions that do not depend on each other)."""
    hashes: dict[str, str] = {}
    out = []
    for line in body.split("\n"):
        m = re.match(r"(\s*(?:ROOT )?)(%e\d+) = (.*)$", line)
        if not m:
            out.append(line)
            continue
        text = m.group(1) + re.sub(r"%e\d+\b", lambda o: hashes.get(o.group(0), o.group(0)), m.group(3))
        hashes[m.group(2)] = "#" + hashlib.sha256(text.strip().encode()).hexdigest()[:16]
        out.append(text)
    return out


def reordered(bx: str, by: str) -> int | None:
    """The number of places where two ENTRY bodies (without_empty's) run other instructions, if they compute the
    same instructions on the same operands (_dataflow); None where they do not."""
    x, y = _dataflow(bx), _dataflow(by)
    return sum(a != b for a, b in zip(x, y)) if sorted(x) == sorted(y) else None


def compare(a: str, b: str) -> None:
    """Each canonical text of folder a (--out) against b's: the same; the same but for empty arrays; the same but
    for empty arrays and the order in which ENTRY runs instructions that do not depend on each other (a
    schedule's tie, moved by the empty ones' absence: the same instructions on the same operands); or not."""
    for name in sorted(os.listdir(a)):
        x, y = (open(os.path.join(d, name)).read() for d in (a, b))
        if x == y:
            print(f"{name}: the same")
            continue
        (hx, bx, nx), (hy, by, ny) = without_empty(x), without_empty(y)
        moved = reordered(bx, by) if hx == hy else None
        empty = f"empty arrays ({nx} and {ny} zero-size instructions of ENTRY)"
        print(f"{name}: " + (f"the same but for {empty}" if bx == by and hx == hy else
                             f"the same but for {empty} and the order of {moved} independent instructions of ENTRY"
                             if moved is not None else "differs"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="*", default=[1, 2], help="device counts (default: 1 2)")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS), metavar="NAME",
                    help=f"of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--out", help="a folder to write each canonical HLO text into (to diff them)")
    ap.add_argument("--compare", nargs=2, metavar="DIR", help="compare two --out folders' texts (no compiling): "
                    "the same, the same but for zero-size arrays passed through, or different")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a subprocess of that device count
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.one:
        print(json.dumps(hashes(args.configs, args.out)))
        return
    import isojax
    print(f"isojax: {os.path.dirname(isojax.__file__)}", flush=True)
    for n in args.devices:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip())
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), "--configs", *args.configs,
               *(["--out", args.out] if args.out else [])]
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        for name, h in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"{n} device{'s' if n > 1 else ''} {name}: {h}", flush=True)


if __name__ == "__main__":
    main()
