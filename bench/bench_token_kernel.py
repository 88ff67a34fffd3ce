"""Issue 13: the per-token update of one state, XLA's path against bench/token_sums_kernel.py (GPU).

    python bench/bench_token_kernel.py [--widths 512,1024,2048] [--sweep]

For each Pythia width at the batch the step runs (262,144 rows at 512 and 1024, 65,536 at 2048),
Zipf ids as bench_throughput.py draws them (s = 1 over 50,304 ids: the top id ~8.8% of a batch),
a bf16 state, accumulators of two states in float32: ms per state of stats._update_tokens (the
XLA path: sorted segment sum, then gathers / TwoSum / scatters in rounds; here it reads unit
vectors already in float32, where the step forms them inside its gather and runs faster: RESULTS
10k) and of the kernel with its merge of crossing segments, each jitted with the accumulators
donated; and the largest difference of the two results (hi + lo, float64). --sweep times the
kernel's block shapes too.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import token_sums_kernel as token_kernel
from isojax import stats
from isojax.options import StatsOptions
from workload import random_sentences

ROWS = {512: 262144, 1024: 262144, 2048: 65536, 2560: 32768}
V = 50304


def timed(step, acc, reps: int = 10):
    acc = jax.block_until_ready(step(acc))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        acc = jax.block_until_ready(step(acc))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, acc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="512,1024,2048")
    ap.add_argument("--sweep", action="store_true", help="also time other block shapes of the kernel")
    args = ap.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    for d in map(int, args.widths.split(",")):
        n = ROWS[d]
        ids, _ = random_sentences(np.array([n]), V, seed=d)
        x = jax.random.normal(jax.random.key(d), (n, d), jnp.float32).astype(jnp.bfloat16) + 0.5
        valid = jnp.asarray(np.arange(n) < n - n // 50)  # 2% padding, as packed rows have
        index = jax.jit(lambda i, m: stats.index_tokens(i, m, V))(jnp.asarray(ids), valid)
        xf = jnp.where(valid[:, None], x.astype(jnp.float32), 0.0)
        norm = jnp.sqrt(jnp.sum(xf * xf, axis=1))
        unit = xf / jnp.where(norm > 0, norm, 1.0)[:, None]
        uniq = int(index.rank_N[-1]) + 1
        print(f"\nD = {d}: {n:,} rows, {uniq:,} distinct ids, the most frequent {np.bincount(ids).max():,} times")

        def fresh():
            return stats.init_accumulators(2, d, V)

        xla_step = jax.jit(lambda acc: stats._update_tokens(acc, 1, unit, index, StatsOptions(segment_sum="scatter")),
                           donate_argnums=0)
        ms, acc_x = timed(xla_step, fresh())
        print(f"  {'XLA path (scatter)':<44}{ms:8.3f} ms")
        ref = np.asarray(acc_x.tok_sum_SxVxD.hi[1], np.float64) + np.asarray(acc_x.tok_sum_SxVxD.lo[1], np.float64)
        del acc_x
        shapes = [dict()]
        if args.sweep:
            shapes += [dict(rows=r, cols=c, num_warps=w) for r, c, w in itertools.product((32, 64), (128, 256), (4, 8))]
        for kw in shapes:
            p = token_kernel.plan(index.starts_N, index.rank_N, index.uniq_U, kw.get("rows", token_kernel.ROWS))
            step = jax.jit(lambda acc, kw=kw, p=p: acc.replace(tok_sum_SxVxD=stats.DF(*token_kernel.add_token_sums(
                acc.tok_sum_SxVxD.hi, acc.tok_sum_SxVxD.lo, 1, x, norm, index.order_N, index.rank_N,
                index.uniq_U, p, **kw))), donate_argnums=0)
            try:
                ms, acc_k = timed(step, fresh())
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  kernel {kw}: failed: {str(e).splitlines()[0][:120]}")
                continue
            reps = 11  # timed() runs the step 1 + 10 times on one accumulator
            got = (np.asarray(acc_k.tok_sum_SxVxD.hi[1], np.float64)
                   + np.asarray(acc_k.tok_sum_SxVxD.lo[1], np.float64))
            diff = np.abs(got - ref).max() / reps
            print(f"  {'kernel ' + (str(kw) if kw else '(defaults)'):<44}{ms:8.3f} ms  "
                  f"max |kernel - XLA| per add {diff:.2e}", flush=True)
            del acc_k
    return 0


if __name__ == "__main__":
    sys.exit(main())
