"""One ~1B model of each family against its Hugging Face PyTorch peer, in one process on one GPU
(issue 32): isojax's step (forward + every statistic of every state, fused into the layer scan) with
the kernels `extract` chooses for that model, and transformers' AutoModel of the same config.json
(random weights, bf16, SDPA, output_hidden_states, length-sorted padded batches, the statistics of
bench/peer_hf.py's run_peer: unit sums and per-token index_add_, no Gram unless --peer-gram), over
the same synthetic tokens (bench/common.py's workload, ids below the family's vocabulary).

Models: the `random:` presets of configs/ (gpt2-xl, opt-1.3b, falcon-mqa-1b, llama-1b, mistral-1b,
qwen2-1.5b, olmo-1b, olmo2-1b, gemma-2b, phi-2; pythia-1b for GPT-NeoX). All peers run first, then isojax: JAX's
allocator keeps what it grows, torch's empty_cache gives it back, and qwen2-1.5b's per-token sums
(151,936 ids) take ~57 GB in isojax and ~28 GB in the peer, which do not fit one card together.

    python -m bench.bench_families                                   # every family, ~6 min on one H100
    python -m bench.bench_families --families llama,qwen2 --tokens 2e6
    python -m bench.bench_families --tiny                             # CPU look: 2 layers, width 64, float32
    python -m bench.bench_families --per-process                      # each peer, each isojax in a fresh process

With OUT set, OUT/bench_families.{txt,json} (the JSON rewritten after every run, so a run cut short
keeps what it measured). A family that fails is a row with its error. In one process, JAX's memory
grows piece by piece beside torch's (XLA_PYTHON_CLIENT_PREALLOCATE=false) and the larger families can
fail to find a contiguous block that extract, which takes its memory at the start, finds (phi-2,
gemma-2b: bench/RESULTS.md 14b); --per-process measures them as extract runs them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

# the peers run first and give their memory back: isojax may then take what extract takes (qwen2-1.5b
# needs ~65 GB of an 80 GB card)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

from bench import bench_throughput as bt  # noqa: E402  (sets XLA's flags as extract does, then imports jax)
from bench.common import random_sentences, sentence_lengths  # noqa: E402

import jax  # noqa: E402

FAMILIES = {"gpt_neox": "pythia-1b", "gpt2": "gpt2-xl", "opt": "opt-1.3b", "falcon": "falcon-mqa-1b",
            "llama": "llama-1b", "mistral": "mistral-1b", "qwen2": "qwen2-1.5b", "olmo": "olmo-1b",
            "olmo2": "olmo2-1b", "gemma": "gemma-2b", "phi": "phi-2"}
# config.json names of (width, layers, heads, MLP width) by family; the others: the Llama family's
SHAPE_KEYS = {"gpt2": ("n_embd", "n_layer", "n_head", "n_inner"),
              "opt": ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim"),
              "falcon": ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_hidden_size")}
LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
TINY = dict(width=64, layers=2, heads=4, vocab=512)


def preset_json(name: str) -> dict:
    from isojax.hf.family.presets import CONFIGS_DIR
    return json.loads((CONFIGS_DIR / f"{name}.json").read_text())


def tiny(raw: dict, cfg) -> dict:
    """The config.json of `raw` shrunk to TINY: same family and options, width 64 in 4 heads of 16,
    the MLP at the model's ratio, the key/value heads at its grouping, 2 layers, 512 ids."""
    raw = dict(raw)
    d_key, l_key, h_key, f_key = SHAPE_KEYS.get(raw.get("model_type"), LLAMA_KEYS)
    width, heads = TINY["width"], TINY["heads"]
    raw.update({d_key: width, l_key: TINY["layers"], h_key: heads, "vocab_size": min(raw["vocab_size"], TINY["vocab"])})
    if raw.get(f_key) is not None or f_key == "intermediate_size":
        raw[f_key] = max(16, round(cfg.intermediate_size / cfg.hidden_size * width / 16) * 16)
    if "num_key_value_heads" in raw:
        raw["num_key_value_heads"] = max(1, heads * cfg.kv_heads // cfg.num_heads)
    if "head_dim" in raw:
        raw["head_dim"] = width // heads
    if "word_embed_proj_dim" in raw:
        raw["word_embed_proj_dim"] = width
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # none past the small vocabulary (transformers'
        raw[key] = raw[key] if isinstance(raw.get(key), int) and raw[key] < raw["vocab_size"] else None  # defaults)
    return raw


def family_models(families: list[str], shrink: bool) -> list[tuple[str, str, dict, object]]:
    """(family, preset, config.json dict, ModelConfig) of each family asked for."""
    from isojax.hf.family import from_hf_dict
    from isojax.hf.family.presets import preset
    out = []
    for family in families:
        name = FAMILIES[family]
        raw, cfg = preset_json(name), preset(name)
        if shrink:
            raw = tiny(raw, cfg)
            cfg = from_hf_dict({k: v for k, v in raw.items() if k != "_comment"}, name=f"{name}-tiny")
        out.append((family, name, raw, cfg))
    return out


def kernels(cfg, dtype: str, rows: int, row_len: int, mlp: str = "auto", attention: str = "auto") -> dict:
    """The kernels `extract` runs for this model and batch (isojax/run/measure.py: attention auto is
    packed on a GPU in bf16, then choose_attention; the MLP (as `mlp` says: auto or xla) and norms
    auto, per device's rows); attention "cudnn" or "packed": that kernel, for an A/B."""
    from isojax.device.kernel_choice import choose_attention, choose_mlp_kernel, choose_norm_kernel
    auto = attention == "auto"
    if auto:
        attention = {"gpu": "packed" if dtype == "bfloat16" else "xla", "tpu": "pallas"}.get(jax.default_backend(), "xla")
    return dict(attention=choose_attention(attention, auto, cfg, dtype, row_len)[0],
                mlp_kernel=choose_mlp_kernel(mlp, cfg, dtype, rows * row_len)[0],
                norm_kernel=choose_norm_kernel("auto", cfg, dtype, rows * row_len)[0])


def memory_estimate(cfg, dtype: str, tokens_per_device: int) -> int:
    """What extract's plan (isojax.device.memory) expects this step to take on one device."""
    from isojax.device.memory import memory_per_device, step_bytes
    need, weights = memory_per_device(cfg, True, dtype, 1, 1, 1)
    return need + weights + step_bytes(cfg, dtype, tokens_per_device, 1)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def run_peers(models, workloads, rows_out, args, save) -> None:
    import torch

    from bench.peer_hf import build_family_model, run_peer
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for (family, name, raw, cfg), (ids, offsets), row in zip(models, workloads, rows_out):
        t0 = time.perf_counter()
        model = None
        try:
            model = build_family_model(raw, device=device, dtype=dtype)
            row["peer_build_s"] = time.perf_counter() - t0
            row["peer"] = run_peer(None, ids, offsets, model=model, device=device, dtype=dtype,
                                   batch_tokens=args.peer_batch_tokens, sort_by_length=True, gram=args.peer_gram,
                                   max_seconds=args.peer_seconds, flops=cfg.flops_per_token(gram=args.peer_gram))
            row["peer"].pop("stats", None)
            print(f"{family} ({name}): peer {row['peer']['tokens_per_s']:,.0f} tok/s", flush=True)
        except Exception as e:  # noqa: BLE001 - a family that fails is a row of the table, not the end
            row["peer_error"] = error_text(e)
            print(f"{family} ({name}): peer failed: {row['peer_error']}", flush=True)
            traceback.print_exc()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        save()


def run_isojax_all(models, workloads, rows_out, args, save) -> None:
    from isojax.device.memory import device_batch_tokens
    dtype = "bfloat16" if not args.tiny else "float32"
    row_len = args.row_len
    for (family, name, raw, cfg), (ids, offsets), row in zip(models, workloads, rows_out):
        try:
            batch_tokens = args.batch_tokens or device_batch_tokens(cfg, jax.default_backend() != "cpu")
            rows = max(1, batch_tokens // row_len)
            chosen = kernels(cfg, dtype, rows, row_len, args.mlp_kernel, args.attention)
            row["kernels"] = chosen
            row["memory_estimate_bytes"] = memory_estimate(cfg, dtype, rows * row_len)
            print(f"{family} ({name}): isojax with attention {chosen['attention']}, MLP {chosen['mlp_kernel']}, "
                  f"norms {chosen['norm_kernel']}; {rows} x {row_len} rows", flush=True)
            res = bt.run_isojax(cfg, ids, offsets, row_len=row_len, batch_tokens=batch_tokens, token_stats=True,
                                dtype=dtype, **chosen)
            res["mfu"] = res["tokens_per_s"] * res["flops_per_token"] / args.rate
            row["isojax"] = res
            print(f"{family} ({name}): isojax {res['tokens_per_s']:,.0f} tok/s, compile {res['compile_s']:.1f} s, "
                  f"MFU {res['mfu']:.1%}", flush=True)
        except Exception as e:  # noqa: BLE001
            row["isojax_error"] = error_text(e)
            print(f"{family} ({name}): isojax failed: {row['isojax_error']}", flush=True)
            traceback.print_exc()
        jax.clear_caches()
        save()


def size(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def table(out: dict) -> str:
    lines = [f"card: {out['card']}; jax {out['jax']}; torch {out.get('torch', '-')}; transformers "
             f"{out.get('transformers', '-')}; measured bf16 matmul {out['bf16_flops'] / 1e12:.1f} TFLOP/s; "
             f"{out['dtype']}; rows of {out['row_len']}; peer: SDPA, length-sorted batches of "
             f"{out['peer_batch_tokens']} tokens, Gram {'on' if out['peer_gram'] else 'off'}"]
    head = (f"{'family':<9}{'preset':<15}{'params':>8}{'isojax tok/s':>14}{'peer tok/s':>12}{'speedup':>9}"
            f"{'MFU':>7}{'peer MFU':>9}{'compile s':>10}{'est/peak GB':>13}  kernels (attention/MLP/norms)")
    lines += [head, "-" * len(head)]
    for r in out["rows"]:
        iso, peer = r.get("isojax"), r.get("peer")
        speed = iso["tokens_per_s"] / peer["tokens_per_s"] if iso and peer else math.nan
        k = r.get("kernels")
        mem = f"{r['memory_estimate_bytes'] / 1e9:.1f}/" if r.get("memory_estimate_bytes") else "-/"
        mem += f"{iso['peak_mem_bytes'] / 1e9:.1f}" if iso and iso.get("peak_mem_bytes") else "-"
        lines.append(
            f"{r['family']:<9}{r['preset']:<15}{size(r['params']):>8}"
            f"{iso['tokens_per_s'] if iso else math.nan:>14,.0f}{peer['tokens_per_s'] if peer else math.nan:>12,.0f}"
            f"{speed:>9.2f}{iso['mfu'] if iso else math.nan:>7.1%}"
            f"{peer['tflops'] * 1e12 / out['bf16_flops'] if peer else math.nan:>9.1%}"
            f"{iso['compile_s'] if iso else math.nan:>10.1f}{mem:>13}  "
            + (f"{k['attention']}/{k['mlp_kernel']}/{k['norm_kernel']}" if k else "-"))
        for who in ("isojax", "peer"):
            if r.get(f"{who}_error"):
                lines.append(f"{'':<9}{who} error: {r[who + '_error']}")
    return "\n".join(lines)


def run_per_process(families: list[str], args) -> int:
    """main's table with each family measured by two processes of its own, `python -m
    bench.bench_families --families F --no-isojax` (the peer) and then `... --no-peer` (isojax, with
    JAX's memory taken at its start, XLA_PYTHON_CLIENT_PREALLOCATE=true, as extract's is: in one
    process beside torch it grows piece by piece, and phi-2's second 17.8 GB block of per-token
    sums found no contiguous room, bench/RESULTS.md 14b), the same options; their JSON read back
    from folders of their own. A process that wrote none leaves its side of the row as the
    process's last error line."""
    import subprocess
    import tempfile

    flags = [f"--{name.replace('_', '-')}" for name in ("peer_gram", "tiny") if getattr(args, name)]
    for name in ("tokens", "row_len", "batch_tokens", "peer_batch_tokens", "peer_seconds", "mlp_kernel", "attention"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    where = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    sides = [("peer", ["--no-isojax"], {}), ("isojax", ["--no-peer"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})]
    sides = [side for side in sides if not getattr(args, f"no_{side[0]}")]
    results = []  # per family: {side: its process's JSON, or a row holding the process's error}

    def measured(family: str, side: str, got: dict | None, proc) -> dict:
        if got is not None:
            return got
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]
        return {"rows": [{"family": family, "preset": FAMILIES[family], "params": 0,
                          f"{side}_error": f"its process wrote no result: {why}"}]}

    def gathered() -> dict | None:
        headed = [r for family in results for r in family.values() if "card" in r]
        if not headed:
            return None
        head = next((r for family in results for side, r in family.items() if side == "isojax" and "card" in r),
                    headed[0])
        rows = []
        for family in results:
            row = {}
            for side, r in family.items():
                got = r["rows"][0]
                row.update({k: v for k, v in got.items() if k not in ("peer", "isojax", "peer_error", "isojax_error")})
                row.update({k: got[k] for k in (side, f"{side}_error", "peer_build_s") if k in got})
            rows.append(row)
        info = {k: r[k] for r in headed for k in ("torch", "transformers") if k in r}
        # every process measures the card's bf16 rate; one can catch the clocks low (616 against
        # ~780 TFLOP/s once on an H100): MFU against the median of the processes' rates
        rate = float(sorted(r["bf16_flops"] for r in headed)[len(headed) // 2])
        for row in rows:
            if row.get("isojax"):
                row["isojax"]["mfu"] = row["isojax"]["tokens_per_s"] * row["isojax"]["flops_per_token"] / rate
        return {**head, **info, "bf16_flops": rate, "rows": rows, "per_process": True}

    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            results.append({})
            for side, side_flags, env in sides:
                folder = Path(tmp) / f"{family}-{side}"
                folder.mkdir()
                proc = subprocess.run([sys.executable, "-m", "bench.bench_families", "--families", family, *side_flags,
                                       *flags], env={**os.environ, **env, "OUT": str(folder)}, capture_output=True,
                                      text=True, cwd=Path(__file__).resolve().parents[1])
                print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(f"{family} (")), flush=True)
                try:
                    got = json.loads((folder / "bench_families.json").read_text())
                except (OSError, ValueError):
                    got = None
                results[-1][side] = measured(family, side, got, proc)
            if where is not None and gathered():  # after every family: a run cut short keeps what it measured
                (where / "bench_families.json").write_text(json.dumps(gathered(), default=str, indent=1))
    out = gathered()
    if out is None:
        print("bench_families: no family's process wrote a result", file=sys.stderr)
        return 1
    text = table(out)
    print(text)
    if where is not None:
        (where / "bench_families.json").write_text(json.dumps(out, default=str, indent=1))
        (where / "bench_families.txt").write_text(text + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--tokens", type=float, default=None,
                    help="synthetic tokens per family (default 1e6; --tiny: 6000); the peer stops at --peer-seconds")
    ap.add_argument("--row-len", type=int, default=None, help="isojax's rows (default 512; --tiny: 128)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="isojax's token slots per step (default: extract's, device_batch_tokens; --tiny: 1024)")
    ap.add_argument("--peer-batch-tokens", type=int, default=None, help="default 16384 (--tiny: 1024)")
    ap.add_argument("--peer-seconds", type=float, default=None, help="cap on each peer run (default 8; --tiny: 5)")
    ap.add_argument("--peer-gram", action="store_true", help="the peer also sums x and x x^T (isojax always does)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-isojax", action="store_true", help="the peers only")
    ap.add_argument("--mlp-kernel", default="auto", choices=["auto", "xla"],
                    help="isojax's MLP: auto (extract's choice, default) or xla (the fused kernels off, for an A/B)")
    ap.add_argument("--attention", default="auto", choices=["auto", "cudnn", "packed"],
                    help="isojax's attention: auto (extract's choice, default), or cudnn or packed (for an A/B)")
    ap.add_argument("--per-process", action="store_true",
                    help="each family's peer and each family's isojax in a process of its own, the rows gathered "
                         "into one table: JAX's allocator starts empty for each and, in isojax's processes, takes "
                         "its memory at the start as extract's does (grown piece by piece beside torch, the larger "
                         "families did not find a contiguous block for their per-token sums)")
    ap.add_argument("--tiny", action="store_true",
                    help="every preset shrunk to 2 layers of width 64 (512 ids), float32 on CPU: a look that the "
                         "whole bench runs, not a measurement")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; have {', '.join(FAMILIES)}")
    if args.per_process:
        return run_per_process(families, args)
    tiny_mode = args.tiny
    args.tokens = int(args.tokens or (6000 if tiny_mode else 1e6))
    args.row_len = args.row_len or (128 if tiny_mode else 512)
    args.batch_tokens = args.batch_tokens or (1024 if tiny_mode else None)
    args.peer_batch_tokens = args.peer_batch_tokens or (1024 if tiny_mode else 16384)
    args.peer_seconds = args.peer_seconds if args.peer_seconds is not None else (5.0 if tiny_mode else 8.0)

    args.rate = bt.bf16_matmul_rate(512 if tiny_mode or jax.default_backend() == "cpu" else 8192)
    models = family_models(families, tiny_mode)
    lengths = sentence_lengths(args.tokens, seed=1, max_len=args.row_len)  # longer ones would be windows
    workloads = [random_sentences(lengths, cfg.vocab_size, seed=2) for _, _, _, cfg in models]
    out = {"card": jax.devices()[0].device_kind, "jax": jax.__version__, "bf16_flops": args.rate,
           "dtype": "float32" if tiny_mode else "bfloat16", "row_len": args.row_len, "tokens": args.tokens,
           "peer_batch_tokens": args.peer_batch_tokens, "peer_gram": args.peer_gram, "tiny": tiny_mode,
           "rows": [{"family": f, "preset": n, "params": cfg.param_count(), "config": cfg.to_dict()}
                    for f, n, _, cfg in models]}
    where = Path(os.environ["OUT"]) if os.environ.get("OUT") else None

    def save():
        if where is not None:
            (where / "bench_families.json").write_text(json.dumps(out, default=str, indent=1))
            (where / "bench_families.txt").write_text(table(out) + "\n")

    print(f"card {out['card']}, bf16 matmul {args.rate / 1e12:.1f} TFLOP/s; {len(models)} families, "
          f"{args.tokens:,} tokens each", flush=True)
    if not args.no_peer:
        import torch
        import transformers
        out["torch"], out["transformers"] = torch.__version__, transformers.__version__
        run_peers(models, workloads, out["rows"], args, save)
    if not args.no_isojax:
        run_isojax_all(models, workloads, out["rows"], args, save)
    text = table(out)
    print(text)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
