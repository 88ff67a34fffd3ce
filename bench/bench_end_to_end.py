"""End to end on one GPU, as a user runs it: wall time of `python -m isojax.extract` (first run,
cached run, cached run with checkpoints) against the Hugging Face peer's end to end (its load,
sentence split, tokenization, loop and finalize), on the same corpus, checkpoint and card.

The setup of issue 12: random weights of pythia-1.4b's shapes saved as float16 safetensors in a
local Hugging Face directory with the real tokenizer; ~10M tokens of Python sources (the
interpreter's own standard library) as .jsonl.gz, sentence unit.

    python -m bench.bench_end_to_end --shape pythia-1.4b --chars 34e6 --workdir /tmp/e2e
    python -m bench.bench_end_to_end --sources 8     # the documents dealt round-robin into 8 sources
    python -m bench.bench_end_to_end --first-only --no-peer --checkpoint-every 0 --sweep 3
    python -m bench.bench_end_to_end --first-only --first-again --no-peer --checkpoint-every 0

Each run reports wall, loop and wall minus loop, and the step's plan (run/plan.py: kernels and the
step's compile beside the weights' load) with the part the run waited for. --sweep N: then N
checkpoints (stand-ins: DIR/step1 ... linked to the model) in one extract process, with a fresh
compilation cache, counting the step's compiles (issue 30: once per shape, not per checkpoint).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_corpus(path: Path, chars: float, sources: int = 1) -> int:
    """Python sources of the standard library as JSON lines, one file per document, passing over
    the library again (the same sources) until `chars` characters; documents labelled python-0,
    python-1, ... in turn when sources > 1 (the paper's setup has eight)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    with gzip.open(path, "wt") as f:
        while total < chars:
            before = total
            for i, src in enumerate(sorted(lib.rglob("*.py"))):
                try:
                    text = src.read_text()
                except (UnicodeDecodeError, OSError):
                    continue
                label = f"python-{i % sources}" if sources > 1 else "python"
                f.write(json.dumps({"text": text, "meta": {"pile_set_name": label}}) + "\n")
                total += len(text)
                if total >= chars:
                    break
            if total == before:
                break
    return total


def build_checkpoint(directory: Path, shape: str) -> None:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    from isojax.hf.family.presets import preset
    cfg = preset(shape)
    hf = GPTNeoXConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                       rotary_pct=cfg.rotary_pct, max_position_embeddings=cfg.max_position_embeddings,
                       use_parallel_residual=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = GPTNeoXForCausalLM(hf).half()
    model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_file=str(REPO / "isojax" / "data" / "gpt-neox-20b-tokenizer.json")
                            ).save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def run_isojax(args: list[str], env: dict, profile: str | None = None, cwd: Path = REPO) -> dict:
    """One `python -m isojax.extract` run; profile: a path for cProfile's stats of it."""
    t = time.time()
    prefix = ["-m", "cProfile", "-o", profile] if profile else []
    p = subprocess.run([sys.executable, *prefix, "-m", "isojax.extract", *args], cwd=cwd, env=env,
                       capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    out = Path(args[args.index("--out") + 1])
    manifest = json.loads((out / "manifest.json").read_text())
    last = [ln for ln in p.stderr.splitlines() if ln.startswith("isojax:")]
    return {"process_s": wall, "wall_s": manifest["seconds_wall"], "tokens": manifest["tokens"],
            "timings": manifest["timings"], "timeline": manifest.get("timeline"), "step_plan_s": manifest["step_plan_s"],
            "log": last[-4:]}


def run_sweep(model_dir: Path, corpus: Path, work: Path, n: int, max_tokens: int, env: dict) -> dict:
    """n checkpoints of the model's shape (DIR/step1 ... linked to model_dir) swept by one extract
    process with a fresh compilation cache (the token cache kept): the step's compiles (jax's log:
    `Compiling jit(step)`, persistent cache reads included) and each checkpoint's plan."""
    repo = work / "sweep-repo"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    for i in range(1, n + 1):
        (repo / f"step{i}").symlink_to(model_dir.resolve(), target_is_directory=True)
    shutil.rmtree(work / "xla-sweep", ignore_errors=True)
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(work / "xla-sweep"), "JAX_LOG_COMPILES": "1"}
    revisions = ",".join(f"step{i}" for i in range(1, n + 1))
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(repo), "--revisions", revisions,
                        "--data", str(corpus), "--max-tokens", str(max_tokens), "--no-plots", "--out",
                        str(work / "sweep-out"), "--overwrite"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    plans = [json.loads((work / "sweep-out" / "sweep-repo" / f"step{i}" / "manifest.json").read_text())["step_plan_s"]
             for i in range(1, n + 1)]
    return {"process_s": wall, "step_compiles": len(re.findall(r"Compiling jit\(step\) ", p.stderr)),
            "step_plan_s": plans}


def run_peer(model_dir: Path, corpus: Path, batch_tokens: int) -> dict:
    """The peer, end to end: load, split sentences (the same splitter), tokenize, loop, finalize."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, GPTNeoXForCausalLM

    from bench import peer_hf
    from isojax.data.units import text_units
    t0 = time.time()
    model = GPTNeoXForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).gpt_neox.to("cuda").eval()
    t_load = time.time() - t0
    t = time.time()
    with gzip.open(corpus, "rt") as f:
        sentences = [u for line in f for u in text_units(json.loads(line)["text"], "sentence")]
    t_split = time.time() - t
    t = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(sentences, add_special_tokens=False)["input_ids"]
    ids = [x[i:i + 512] for x in ids for i in range(0, len(x), 512) if x]
    lengths = np.array([len(x) for x in ids])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for x in ids for t in x), np.int32, int(offsets[-1]))
    t_tok = time.time() - t
    t = time.time()
    cfg = model.config
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size, cfg.intermediate_size)
    res = peer_hf.run_peer(shape, flat, offsets, batch_tokens=batch_tokens, sort_by_length=True, gram=False,
                           model=model, finalize=True, warmup_batches=0)
    t_loop = time.time() - t
    return {"wall_s": time.time() - t0, "load_s": t_load, "split_s": t_split, "tokenize_s": t_tok,
            "loop_and_finalize_s": t_loop, "tokens": int(offsets[-1]), "loop_tokens_per_s": res["tokens_per_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="pythia-1.4b")
    ap.add_argument("--chars", type=float, default=34e6, help="characters of Python source (~10M tokens)")
    ap.add_argument("--workdir", default="/tmp/e2e")
    ap.add_argument("--sources", type=int, default=1, help="sources the documents are dealt into")
    ap.add_argument("--baseline", help="another isojax tree (PYTHONPATH) to run cached beside this one")
    ap.add_argument("--checkpoint-every", type=int, default=2_000_000, help="0: no run with checkpoints")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one more cached run under cProfile: $OUT/cached.pstats")
    ap.add_argument("--peer-batch-tokens", type=int, default=16384)
    ap.add_argument("--first-only", action="store_true", help="no cached run (only the first, without caches)")
    ap.add_argument("--first-again", action="store_true",
                    help="after the first run, another first run on what is then a machine that has run isojax: "
                         "the token cache and compiled programs removed, the kernels' checks kept")
    ap.add_argument("--sweep", type=int, default=0, help="then a sweep of this many checkpoints in one process")
    ap.add_argument("--sweep-max-tokens", type=int, default=2_000_000, help="tokens per checkpoint of the sweep")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus, model_dir = work / f"python-{args.sources}.jsonl.gz", work / "model"
    if not corpus.exists():
        print(f"corpus: {build_corpus(corpus, args.chars, args.sources):,} characters", flush=True)
    if not model_dir.exists():
        build_checkpoint(model_dir, args.shape)
    shutil.rmtree(work / "cache", ignore_errors=True)  # the first run starts with no token or compile cache
    env = {**os.environ, "ISOJAX_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    common = ["--model", str(model_dir), "--data", str(corpus)]
    rows = {}
    rows["isojax first run"] = run_isojax(common + ["--out", str(work / "o1"), "--overwrite"], env)
    print(json.dumps(rows["isojax first run"]), flush=True)
    if args.first_again:
        for kept_not in ("tokens", "xla"):
            shutil.rmtree(work / "cache" / kept_not, ignore_errors=True)
        rows["first run, checks kept"] = run_isojax(common + ["--out", str(work / "o6"), "--overwrite"], env)
        print(json.dumps(rows["first run, checks kept"]), flush=True)
    if not args.first_only:
        rows["isojax cached"] = run_isojax(common + ["--out", str(work / "o2"), "--overwrite"], env)
        print(json.dumps(rows["isojax cached"]), flush=True)
    if args.baseline:
        base_env = {**env, "PYTHONPATH": os.pathsep.join([str(Path(args.baseline).resolve())]
                                                         + [p for p in [env.get("PYTHONPATH")] if p])}
        rows["baseline cached"] = run_isojax(common + ["--out", str(work / "o5"), "--overwrite"], base_env,
                                             cwd=Path(args.baseline))
        print(json.dumps(rows["baseline cached"]), flush=True)
    if args.profile:
        stats = str(Path(os.environ.get("OUT", work)) / "cached.pstats")
        rows["isojax cached, cProfile"] = run_isojax(common + ["--out", str(work / "o4"), "--overwrite"], env, stats)
        print(json.dumps(rows["isojax cached, cProfile"]), flush=True)
    if args.checkpoint_every and not args.first_only:
        rows["isojax cached + checkpoints"] = run_isojax(
            common + ["--out", str(work / "o3"), "--overwrite", "--checkpoint-every-tokens", str(args.checkpoint_every)],
            env)
        print(json.dumps(rows["isojax cached + checkpoints"]), flush=True)
    sweep = run_sweep(model_dir, corpus, work, args.sweep, args.sweep_max_tokens, env) if args.sweep else None
    if sweep:
        print(json.dumps(sweep), flush=True)
    peer = None if args.no_peer else run_peer(model_dir, corpus, args.peer_batch_tokens)
    if peer:
        print(json.dumps(peer), flush=True)

    import jax
    lines = [f"card: {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.shape}, random float16 weights; "
             f"{rows['isojax first run']['tokens']:,} tokens of Python sources in {args.sources} source(s), sentences"]
    lines.append(f"{'run':<30}{'wall s':>8}{'loop':>8}{'wall-loop':>10}{'compile':>9}{'plan':>6}{'waited':>7}"
                 "  other phases (s)")
    for name, r in rows.items():
        t, plan = r["timings"], r["step_plan_s"]
        other = ", ".join(f"{k} {v:.1f}" for k, v in t.items() if k not in ("compile", "loop") and v >= 0.05)
        lines.append(f"{name:<30}{r['wall_s']:>8.1f}{t['loop']:>8.1f}{r['wall_s'] - t['loop']:>10.1f}"
                     f"{t['compile']:>9.1f}{plan['total']:>6.1f}{plan['waited']:>7.1f}  {other}")
    lines.append("compile: the run's wait for the step's plan, its first step and the kernels' checks; plan: the "
                 "plan's seconds beside the load (its step compile included), waited: the part of it the run waited for")
    if sweep:
        lines.append(f"sweep of {args.sweep} checkpoints ({args.sweep_max_tokens:,} tokens each), fresh compilation "
                     f"cache: {sweep['process_s']:.1f} s, the step compiled {sweep['step_compiles']} time(s); step "
                     "compile per checkpoint (s): " + ", ".join(f"{p['compile']:.1f}" for p in sweep["step_plan_s"])
                     + "; waited: " + ", ".join(f"{p['waited']:.1f}" for p in sweep["step_plan_s"]))
    if args.checkpoint_every and not args.first_only:
        with_ck, without = rows["isojax cached + checkpoints"]["timings"], rows["isojax cached"]["timings"]
        n_ck = rows["isojax cached"]["tokens"] // args.checkpoint_every
        per_ck = (with_ck["loop"] - without["loop"]) / max(n_ck, 1)
        rate = rows["isojax cached"]["tokens"] / without["loop"]
        lines.append(f"checkpoints: {n_ck} in the loop, {per_ck:+.2f} s each; at a 20M-token interval "
                     f"{per_ck / (20e6 / rate):+.1%} of the loop")
    if peer:
        lines.append(f"{'HF peer, end to end':<30}{peer['wall_s']:>8.1f}  load {peer['load_s']:.1f}, split "
                     f"{peer['split_s']:.1f}, tokenize {peer['tokenize_s']:.1f}, loop+finalize "
                     f"{peer['loop_and_finalize_s']:.1f} ({peer['loop_tokens_per_s']:,.0f} tok/s)")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_end_to_end.txt").write_text(table + "\n")
        Path(os.environ["OUT"], "bench_end_to_end.json").write_text(json.dumps({"isojax": rows, "sweep": sweep,
                                                                                "peer": peer}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
