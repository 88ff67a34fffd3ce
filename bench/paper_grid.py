"""What the paper's whole grid costs: wall time and GPU hours on 1, 4 and 8 GPUs, for isojax and
for the Hugging Face peer, from throughputs measured in this run on this card (issue 30).

The grid (README, "The paper's setup"): every Pythia size over the eight Pile sources of the
paper's Table 4 (12.85B tokens in all, sentence unit), and the training curves of 70m and 410m
(21 checkpoints each) on Enron Emails (107M tokens). The grid is ~100 independent jobs (one per
size, source and checkpoint), so G GPUs run G of them at once: GPU hours are the sum of tokens
over the per-GPU rate, and the wall time on G GPUs is GPU hours / G. Sizes whose per-token
statistics do not fit one card (6.9b and 12b at about 80 GB) run on several GPUs at the per-GPU rate
measured for them where this machine has the GPUs, else are estimated from the model FLOPs per
token at the MFU of the measured sizes around them (interpolated in log parameters; beyond the
largest measured, its MFU); the table marks each estimate.

    python -m bench.paper_grid                                  # measure 70m .. 2.8b here, then the table
    python -m bench.paper_grid --sizes pythia-70m --tokens 1e6  # a quick look
    python -m bench.paper_grid --from-json $OUT/paper_grid.json  # the table again from a saved run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SIZES = ["pythia-70m", "pythia-160m", "pythia-410m", "pythia-1b", "pythia-1.4b", "pythia-2.8b", "pythia-6.9b",
         "pythia-12b"]
# the paper's Table 4: tokens per source (Enron Emails .. Wikipedia (en))
SOURCE_TOKENS = {"Enron Emails": 107_063_699, "NIH ExPorter": 376_537_632, "PhilPapers": 584_403_514,
                 "HackerNews": 1_024_155_017, "EuroParl": 1_519_805_406, "Ubuntu IRC": 1_741_293_414,
                 "DM Mathematics": 3_573_649_454, "Wikipedia (en)": 3_920_248_990}
TRAINING = {"pythia-70m": 21, "pythia-410m": 21}  # checkpoints of the training curves, on Enron Emails
MEASURE_TOKENS = {"pythia-70m": 8e6, "pythia-160m": 6e6, "pythia-410m": 3e6, "pythia-1b": 1.5e6,
                  "pythia-1.4b": 1.2e6, "pythia-2.8b": 6e5}


def grid_tokens() -> dict[str, float]:
    """Tokens each size reads over the whole grid."""
    every = sum(SOURCE_TOKENS.values())
    return {size: every + TRAINING.get(size, 0) * SOURCE_TOKENS["Enron Emails"] for size in SIZES}


def measure(sizes: list[str], tokens: float | None, peer: bool) -> dict:
    """Per size: isojax's and the peer's tokens/s on one GPU of this machine, as extract runs
    (default kernels and batch)."""
    import jax

    from bench import bench_throughput as bt
    from bench.common import random_sentences, sentence_lengths
    from isojax.device.memory import device_batch_tokens
    from isojax.kernels import mlp as mlp_kernel
    from isojax.hf.family.presets import preset
    rate = bt.bf16_matmul_rate()
    out = {"card": jax.devices()[0].device_kind, "jax": jax.__version__, "bf16_flops": rate, "sizes": {}}
    for size in sizes:
        cfg = preset(size)
        n = int(tokens or MEASURE_TOKENS.get(size, 1e6))
        lengths = sentence_lengths(n, seed=1, max_len=512)
        ids, offsets = random_sentences(lengths, 50304, seed=2)
        row = {"flops_per_token": cfg.flops_per_token(gram=True)}
        try:
            row["isojax"] = bt.run_isojax(size, ids, offsets, row_len=512, batch_tokens=device_batch_tokens(cfg),
                                          attention="packed", token_stats=True,
                                          mlp_kernel="mosaic" if mlp_kernel.available() else "xla", norm_kernel="pallas")
        except Exception as e:  # noqa: BLE001 - a size that does not fit is a row of the table, not the end
            row["isojax_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        jax.clear_caches()
        if peer:
            import torch

            from bench.peer_hf import run_peer
            try:
                row["peer"] = run_peer(size, ids, offsets, batch_tokens=16384, sort_by_length=True, gram=False,
                                       max_seconds=30.0)
                row["peer"].pop("stats", None)
            except Exception as e:  # noqa: BLE001
                row["peer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
        print(json.dumps({size: row}, default=str), file=sys.stderr, flush=True)
        out["sizes"][size] = row
        if os.environ.get("OUT"):  # what is measured so far survives a run cut short
            Path(os.environ["OUT"], "paper_grid.json").write_text(json.dumps(out, default=str, indent=1))
    return out


def per_gpu_rates(measured: dict, who: str) -> dict[str, tuple[float, bool]]:
    """size -> (tokens/s per GPU, estimated?): measured where this run has it, else from the
    model's FLOPs per token at an MFU interpolated (in log parameters) between the measured sizes
    around it, or the nearest measured size's beyond them."""
    import numpy as np

    from isojax.hf.family.presets import preset
    got = {s: r[who]["tokens_per_s"] for s, r in measured["sizes"].items() if r.get(who)}
    if not got:
        return {}
    flops = {s: preset(s).flops_per_token(gram=True) for s in SIZES}
    known = sorted(got, key=lambda s: preset(s).param_count())
    x = [np.log(preset(s).param_count()) for s in known]
    mfu = [got[s] * flops[s] / measured["bf16_flops"] for s in known]
    return {s: (got[s], False) if s in got else
            (float(np.interp(np.log(preset(s).param_count()), x, mfu)) * measured["bf16_flops"] / flops[s], True)
            for s in SIZES}


def table(measured: dict) -> str:
    tokens = grid_tokens()
    lines = [f"card: {measured['card']}; jax {measured['jax']}; the paper's grid: {len(SIZES)} sizes x "
             f"{len(SOURCE_TOKENS)} sources ({sum(SOURCE_TOKENS.values()) / 1e9:.2f}B tokens) + training curves "
             f"of 70m and 410m (21 checkpoints x 107M tokens each); * = estimated from FLOPs at the MFU of the "
             f"measured sizes around it (beyond them: the nearest)"]
    lines.append(f"{'size':<13}{'tokens':>9}{'isojax tok/s/GPU':>18}{'peer tok/s/GPU':>16}{'isojax GPU h':>14}"
                 f"{'peer GPU h':>12}")
    rates = {who: per_gpu_rates(measured, who) for who in ("isojax", "peer")}
    hours = {"isojax": 0.0, "peer": 0.0}
    for size in SIZES:
        cells = []
        for who in ("isojax", "peer"):
            r = rates[who].get(size)
            if r is None:
                cells.append((float("nan"), " "))
                continue
            hours[who] += tokens[size] / r[0] / 3600
            cells.append((r[0], "*" if r[1] else " "))
        (ri, ei), (rp, ep) = cells
        lines.append(f"{size:<13}{tokens[size] / 1e9:>8.2f}B{ri:>17,.0f}{ei}{rp:>15,.0f}{ep}"
                     f"{tokens[size] / ri / 3600:>14,.1f}{tokens[size] / rp / 3600:>12,.1f}")
    lines.append(f"{'whole grid':<13}{sum(tokens.values()) / 1e9:>8.2f}B{'':>34}{hours['isojax']:>14,.1f}"
                 f"{hours['peer']:>12,.1f}")
    lines.append("")
    lines.append(f"{'GPUs':<6}{'isojax wall':>14}{'peer wall':>14}{'ratio':>8}")
    for g in (1, 4, 8):
        lines.append(f"{g:<6}{hours['isojax'] / g:>12,.1f} h{hours['peer'] / g:>12,.1f} h"
                     f"{hours['peer'] / hours['isojax'] if hours['isojax'] else float('nan'):>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES[:6]), help="sizes to measure here (the rest: estimated)")
    ap.add_argument("--tokens", type=float, default=None, help="tokens per measurement (default: by size)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--from-json", help="a saved measurement: print its table only")
    args = ap.parse_args(argv)
    if args.from_json:
        measured = json.loads(Path(args.from_json).read_text())
    else:
        measured = measure(args.sizes.split(","), args.tokens, not args.no_peer)
    text = table(measured)
    print(text)
    if os.environ.get("OUT") and not args.from_json:
        Path(os.environ["OUT"], "paper_grid.json").write_text(json.dumps(measured, default=str, indent=1))
        Path(os.environ["OUT"], "paper_grid.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
