"""A sweep against its Hugging Face peer in the same run (issue 47): N local revision folders of
random weights (DIR/step1000/, DIR/step2000/, ...: a local repository, --model DIR --revisions ...),
T tokens of a 2-source corpus (the standard library's Python sources, bench_end_to_end.build_corpus),
`python -m isojax.extract` over all N as one sweep, and per checkpoint the peer of bench/peer_hf.py
(load, then unit sums and per-token index_add_ and its float64 finalize, no Gram) over the same
token ids: the sequences of isojax's own token cache, cut into its windows.

    python -m bench.bench_sweep --shape pythia-410m --checkpoints 8 --tokens 2e6 --sample-states 0,4096
    python -m bench.bench_sweep --first                # also a first run with empty caches (it warms them)
    python -m bench.bench_sweep --tiny                 # CPU look: 2 layers of width 64, float32, 2 x 3,000 tokens

isojax runs first, cached: a warm-up sweep of the first checkpoint fills the token and compile caches
(or --first: the whole sweep from empty caches, reported), then one timed sweep per --sample-states
value (0: none). Per checkpoint both sides' phases: isojax's from each step's manifest.json timings
(load = load + convert, compile = the step's setup, the step itself compiled beside the load, so that
the loop holds every batch, the first included; finalize = merge + finalize, figures = plots, other =
the step's wall less these), the peer's timed here (finalize = run_peer's time outside its loop: host batches, the
float64 read-out). Sweep wall: the extract process's. Targets (issue 47): sweep wall <= 1.25 x sum
of loops + the first checkpoint's compile; per checkpoint the peer's wall >= 1.5 x isojax's; the
sample's sweep at most 1.1 x the one without; a first run at most 1.5 x the cached sweep.
--json PATH writes every number; `inter_sim` of the two sides is compared as a check that both
measured the same tokens of the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.bench_end_to_end import REPO, build_corpus
from bench.common import CONFIGS_DIR

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
PHASES = ("load", "compile", "loop", "finalize", "figures", "write", "other")


def build_revisions(repo: Path, n: int, shape: str, tiny: bool, device: str) -> list[str]:
    """n revision folders of random weights (seeds 0 ... n-1) in Hugging Face layout, made on the
    device and saved as float16 (float32 with --tiny); folders already there are kept."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast
    raw = {k: v for k, v in json.loads((CONFIGS_DIR / f"{shape}.json").read_text()).items()
           if k not in ("model_type", "hub_id")}
    raw.update(TINY if tiny else {})
    revisions = [f"step{1000 * (i + 1)}" for i in range(n)]
    for i, rev in enumerate(revisions):
        if (repo / rev).is_dir():
            have = json.loads((repo / rev / "config.json").read_text())
            if all(have.get(k) == v for k, v in raw.items() if k in TINY):
                continue
            shutil.rmtree(repo / rev)  # another shape's
        torch.manual_seed(i)
        with torch.device(device):
            model = GPTNeoXForCausalLM(GPTNeoXConfig(**raw)).to(torch.float32 if tiny else torch.float16)
        tmp = repo / f".{rev}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        PreTrainedTokenizerFast(tokenizer_file=str(REPO / "isojax" / "data" / "gpt-neox-20b-tokenizer.json")
                                ).save_pretrained(tmp)
        tmp.rename(repo / rev)
        del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return revisions


def run_extract(repo: Path, revisions: list[str], corpus: Path, tokens: int, sample: int, plots: bool,
                out: Path, env: dict) -> dict:
    """One `python -m isojax.extract` sweep: its process wall and each step's phases."""
    cmd = [sys.executable, "-m", "isojax.extract", "--model", str(repo), "--revisions", ",".join(revisions),
           "--data", str(corpus), "--max-tokens", str(tokens), "--out", str(out), "--overwrite"]
    cmd += ([] if plots else ["--no-plots"]) + (["--sample-states", str(sample)] if sample else [])
    t = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[1:])} failed:\n{p.stderr[-3000:]}")
    steps = []
    for rev in revisions:
        folder = next(out.glob(f"*/{rev}"))
        manifest = json.loads((folder / "manifest.json").read_text())
        t = manifest["timings"]
        step = {"revision": rev, "load": t["load"] + t["convert"], "compile": t["compile"], "loop": t["loop"],
                "finalize": t["merge"] + t["finalize"], "figures": t["plots"], "write": t["write"],
                "wall": manifest["seconds_wall"], "tokens": manifest["tokens"], "timeline": manifest.get("timeline"),
                "row_len": manifest["settings"]["row_len"], "token_cache": manifest["settings"]["corpus"],
                "inter_sim": [layer["inter_sim"] for layer in json.loads((folder / "metrics.json").read_text())["layers"]]}
        step["other"] = step["wall"] - sum(step[k] for k in PHASES[:-1])
        steps.append(step)
    loops = sum(s["loop"] for s in steps)
    return {"sample_states": sample, "plots": plots, "wall": wall, "steps": steps, "sum_loops": loops,
            "first_compile": steps[0]["compile"], "outside_steps": wall - sum(s["wall"] for s in steps),
            "target_ratio": wall / (1.25 * loops + steps[0]["compile"])}


def same_tokens(cache: Path, key: str, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """isojax's measured sequences: its token cache's ids, cut into its windows of row_len."""
    from isojax.data.tokens import _windows
    folder = cache / "tokens" / key
    tokens = np.fromfile(folder / "tokens.bin", np.int32)
    offsets = np.fromfile(folder / "offsets.bin", np.int64)
    return tokens, _windows(offsets, np.zeros(len(offsets) - 1, np.int16), row_len)[0]


def run_peers(repo: Path, revisions: list[str], tokens, offsets, device: str, batch_tokens: int) -> list[dict]:
    """Per checkpoint: from_pretrained onto the device (load), then peer_hf.run_peer with its finalize."""
    import torch
    from transformers import GPTNeoXForCausalLM

    from bench import peer_hf
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for rev in revisions:
        t0 = time.time()
        model = GPTNeoXForCausalLM.from_pretrained(repo / rev, torch_dtype=dtype, attn_implementation="sdpa"
                                                   ).gpt_neox.to(device).eval()
        if device == "cuda":
            torch.cuda.synchronize()
        load = time.time() - t0
        t = time.time()
        got = peer_hf.run_peer(None, tokens, offsets, device=device, dtype=dtype, batch_tokens=batch_tokens,
                               sort_by_length=True, gram=False, model=model, finalize=True, warmup_batches=0)
        rest = time.time() - t
        rows.append({"revision": rev, "load": load, "compile": None, "loop": got["seconds"],
                     "finalize": rest - got["seconds"], "figures": None, "write": None, "other": None,
                     "wall": time.time() - t0, "tokens": got["tokens_processed"],
                     "inter_sim": [layer["inter_sim"] for layer in got["metrics"]["layers"]]})
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def cell(v) -> str:
    return f"{'-':>9}" if v is None else f"{v:>9.2f}"


def table(doc: dict) -> str:
    lines = [f"card: {doc['card']}; {doc['shape']}{' (tiny)' if doc['tiny'] else ''}, random weights, "
             f"{len(doc['revisions'])} checkpoints x {doc['measured']:,} tokens (2 sources, sentences)",
             f"{'checkpoint':<12}{'side':<16}" + "".join(f"{p:>9}" for p in PHASES) + f"{'wall':>9}{'peer/isojax':>13}"]
    peers = {p["revision"]: p for p in doc["peer"]}
    for label, run in doc["isojax"].items():
        for s in run["steps"]:
            vs = f"{peers[s['revision']]['wall'] / s['wall']:>12.2f}x" if peers else ""
            lines.append(f"{s['revision']:<12}{label:<16}" + "".join(cell(s[k]) for k in PHASES) + cell(s["wall"]) + vs)
        lines.append(f"  {label}: sweep wall {run['wall']:.1f} s (outside the steps {run['outside_steps']:.1f}), "
                     f"sum of loops {run['sum_loops']:.1f}, first compile {run['first_compile']:.1f}; "
                     f"wall / (1.25 x loops + compile) = {run['target_ratio']:.2f} (target <= 1)")
        if peers:
            later = [peers[s["revision"]]["wall"] / s["wall"] for s in run["steps"][1:] or run["steps"]]
            diff = max(abs(a - b) for s in run["steps"] for a, b in zip(s["inter_sim"], peers[s["revision"]]["inter_sim"]))
            lines.append(f"  {label}: peer wall / isojax wall after the first checkpoint, median "
                         f"{statistics.median(later):.2f} (target >= 1.5); inter_sim max |isojax - peer| {diff:.1e}")
    for p in doc["peer"]:
        lines.append(f"{p['revision']:<12}{'peer':<16}" + "".join(cell(p[k]) for k in PHASES) + cell(p["wall"]))
    if peers:
        lines.append(f"  peer: sum of walls {sum(p['wall'] for p in doc['peer']):.1f} s, of loops "
                     f"{sum(p['loop'] for p in doc['peer']):.1f} s")
    runs = list(doc["isojax"].values())
    if len(runs) > 1:
        lines.append("  sweep wall against the first variant's: " + ", ".join(
            f"{label} {run['wall'] / runs[0]['wall']:.2f}x" for label, run in doc["isojax"].items()) + " (sample: <= 1.1)")
    if doc.get("first"):
        first = doc["first"]
        lines.append(f"  first run (empty caches, {first['label']}): {first['wall']:.1f} s, "
                     f"{first['wall'] / doc['isojax'][first['label']]['wall']:.2f}x the cached sweep (target <= 1.5); "
                     f"its first compile {first['first_compile']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="pythia-410m", help="a GPT-NeoX preset of configs/ (default pythia-410m)")
    ap.add_argument("--checkpoints", type=int, default=None, help="revision folders (default 8; --tiny: 2)")
    ap.add_argument("--tokens", type=float, default=None, help="tokens per checkpoint (default 2e6; --tiny: 3000)")
    ap.add_argument("--sample-states", default="0", help="comma list of K: a timed sweep per value, 0 = no sample")
    ap.add_argument("--plots", action="store_true", help="isojax draws its figures (default: --no-plots)")
    ap.add_argument("--first", action="store_true", help="first a sweep with empty caches (reported; it warms them)")
    ap.add_argument("--peer-batch-tokens", type=int, default=None, help="default 16384 (--tiny: 1024)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--workdir", default=None, help="default /tmp/bench_sweep-SHAPE (the weights are kept there)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 64 on CPU, float32: a look, not a measurement")
    args = ap.parse_args(argv)
    try:
        samples = [int(k) for k in args.sample_states.split(",")]
    except ValueError:
        ap.error(f"--sample-states: a comma list of integers, got {args.sample_states!r}")
    n, tokens = args.checkpoints or (2 if args.tiny else 8), int(args.tokens or (3000 if args.tiny else 2e6))
    if n < 1 or tokens < 2 or min(samples) < 0:
        ap.error("--checkpoints and --tokens must be positive, --sample-states at least 0")
    import torch
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    work = Path(args.workdir or f"/tmp/bench_sweep-{args.shape}{'-tiny' if args.tiny else ''}")
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"python-2-{tokens}.jsonl.gz"
    if not corpus.exists():
        build_corpus(corpus, 6 * tokens, sources=2)  # ~3.4 characters per token: each source fills its half
    revisions = build_revisions(work / "repo", n, args.shape, args.tiny, device)
    cache = work / "cache"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # isojax's own, in cache
    env.update(ISOJAX_CACHE=str(cache), HF_HUB_OFFLINE="1", **({"JAX_PLATFORMS": "cpu"} if args.tiny else {}))
    label = lambda k: f"isojax K={k}" if k else "isojax"
    doc = {"shape": args.shape, "tiny": args.tiny, "tokens": tokens, "revisions": revisions, "isojax": {}, "peer": []}
    for i, k in enumerate(samples):  # each variant's caches filled: a first run, or a sweep of one checkpoint
        if i == 0 and args.first:
            shutil.rmtree(cache, ignore_errors=True)
            doc["first"] = {"label": label(k), **run_extract(work / "repo", revisions, corpus, tokens, k, args.plots,
                                                             work / "out", env)}
            print(f"first run (empty caches): {doc['first']['wall']:.1f} s", flush=True)
        else:
            warm = run_extract(work / "repo", revisions[:1], corpus, tokens, k, args.plots, work / "out", env)
            print(f"{label(k)}: warm-up sweep of {revisions[0]}: {warm['wall']:.1f} s", flush=True)
    for k in samples:
        doc["isojax"][label(k)] = run_extract(work / "repo", revisions, corpus, tokens, k, args.plots, work / "out", env)
        print(f"{label(k)}: sweep wall {doc['isojax'][label(k)]['wall']:.1f} s", flush=True)
    first = next(iter(doc["isojax"].values()))["steps"][0]
    doc["measured"] = first["tokens"]
    if not args.no_peer:
        ids, offsets = same_tokens(cache, first["token_cache"], first["row_len"])
        doc["peer"] = run_peers(work / "repo", revisions, ids, offsets, device,
                                args.peer_batch_tokens or (1024 if args.tiny else 16384))
    doc["card"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
