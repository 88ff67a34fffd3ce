"""What a sweep's main thread does between one checkpoint's read-out and the next one's loop, with
and without reading the next checkpoint ahead (issue 47, isojax/run/load_ahead.py): per checkpoint
after the first, the seconds from the end of the previous checkpoint's read-out (Results.detach) to
the start of this one's loop, split at the main thread's marks, and the manifest's load and compile
(compile: the plan's wait, the runner and the first batch).

    python -m bench.load_probe                          # pythia-410m, 4 checkpoints x 2M tokens, the GPU
    python -m bench.load_probe --tiny                   # CPU look: 2 layers of width 64, 4 x 3,000 tokens

The revision folders, corpus and caches are bench_sweep's (--workdir, default /tmp/bench_sweep-SHAPE):
a one-checkpoint sweep warms the token and compile caches, then one sweep per variant runs in a
process of its own (`ahead`: as shipped; `plain`: run_sweep(load_ahead=False)). Columns:
  before   from the previous read-out's end to this step's weights' load: the sweep's bookkeeping
           (the previous step's saving handed over, the folder locked), the config, mesh and
           tokenizer (read ahead: taken)
  weights  the main thread's load of the weights (read ahead: taken, waiting for what is still read)
  plan     from the weights to the runner: the waits for the token cache's opening and the step's plan
  runner   the runner (parameters placed, accumulators allocated) and the loop's setup
  gap      their sum: the main thread's time between the read-out and the loop
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = ("before", "weights", "plan", "runner")


def child(argv: list[str], variant: str, record: Path) -> int:
    """One sweep in this process, the main thread's marks around each step's phases written to record."""
    from isojax.extract import main
    from isojax.run import measure, results, sweep
    marks: list[tuple[str, float]] = []

    def wrap(owner, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def marked(*a, **k):
            here = threading.current_thread() is threading.main_thread()
            if here:
                marks.append((name + ">", time.time()))
            try:
                return fn(*a, **k)
            finally:
                if here:
                    marks.append((name + "<", time.time()))
        setattr(owner, name, marked)

    for owner, name in ((measure, "start_measure"), (measure, "load"), (measure, "_start"), (measure, "_loop"),
                        (results.Results, "detach")):
        wrap(owner, name)
    if variant == "plain":
        sweep.run_sweep = functools.partial(sweep.run_sweep, load_ahead=False)
    code = main(argv)
    record.write_text(json.dumps(marks))
    return code


def gaps(marks: list) -> list[dict]:
    """Per step after the first: the marks' intervals from the previous read-out's end to the loop."""
    rows, last_readout, at = [], None, {}
    for name, t in marks:
        at[name] = t
        if name == "_loop>" and last_readout is not None:
            cut = [last_readout, at["load>"], at["load<"], at["_start>"], t]
            rows.append({**{m: b - a for m, a, b in zip(MARKS, cut, cut[1:])}, "gap": t - last_readout})
        if name == "detach<":
            last_readout = t
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="pythia-410m")
    ap.add_argument("--checkpoints", type=int, default=4)
    ap.add_argument("--tokens", type=float, default=None, help="tokens per checkpoint (default 2e6; --tiny: 3000)")
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 64 on CPU, float32: a look, not a measurement")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child", choices=("ahead", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.child:
        return child(rest, args.child, Path(args.record))
    from bench.bench_end_to_end import build_corpus
    from bench.bench_sweep import build_revisions
    import torch
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    tokens = int(args.tokens or (3000 if args.tiny else 2e6))
    work = Path(args.workdir or f"/tmp/bench_sweep-{args.shape}{'-tiny' if args.tiny else ''}")
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"python-2-{tokens}.jsonl.gz"
    if not corpus.exists():
        build_corpus(corpus, 6 * tokens, sources=2)
    revisions = build_revisions(work / "repo", args.checkpoints, args.shape, args.tiny, device)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(ISOJAX_CACHE=str(work / "cache"), HF_HUB_OFFLINE="1", **({"JAX_PLATFORMS": "cpu"} if args.tiny else {}))

    def sweep(variant: str, revs: list[str]) -> list[dict]:
        record, out = work / f"probe-{variant}.json", work / f"probe-out-{variant}"
        cmd = [sys.executable, "-m", "bench.load_probe", "--child", variant, "--record", str(record),
               "--model", str(work / "repo"), "--revisions", ",".join(revs), "--data", str(corpus),
               "--max-tokens", str(tokens), "--no-plots", "--out", str(out), "--overwrite"]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"error: the {variant} sweep failed:\n{p.stderr[-3000:]}")
        rows = gaps(json.loads(record.read_text()))
        for row, rev in zip(rows, revs[1:]):
            t = json.loads(next(out.glob(f"*/{rev}/manifest.json")).read_text())["timings"]
            row.update(revision=rev, load=t["load"], compile=t["compile"], loop=t["loop"])
        print(f"{variant}: {sum(line.count('ahead, while') for line in p.stderr.splitlines())} checkpoints read ahead",
              flush=True)
        return rows

    sweep("plain", revisions[:1])  # warms the token and compile caches
    cols = (*MARKS, "gap", "load", "compile", "loop")
    print(f"{args.shape}{' (tiny)' if args.tiny else ''} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
          f", {len(revisions)} checkpoints x {tokens:,} tokens; seconds on the main thread, per checkpoint after the first")
    print(f"{'variant':<8}{'revision':<12}" + "".join(f"{c:>9}" for c in cols))
    for variant in ("plain", "ahead"):
        for row in sweep(variant, revisions):
            print(f"{variant:<8}{row['revision']:<12}" + "".join(f"{row[c]:>9.3f}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
