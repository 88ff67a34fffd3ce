"""Kernel benchmark of one state's statistics update (isojax.stats.accumulators), one state at a time.

    python -m bench.bench_stats_kernel            # GPU matrix, ~4 min on one H100
    python -m bench.bench_stats_kernel --quick    # tiny sizes, runs on CPU

Per-token variants (all add the unit vectors of N positions into a [V, D] float32 table):
  scatter_add         tok.at[ids].add(u): plain float32 scatter-add, contended, no compensation
  scatter_add_sorted  sort ids first, then the same scatter-add (indices_are_sorted)
  segment_sum_V       tok + segment_sum(u, ids, V): builds a fresh [V, D] array per batch
  segsum_set          sort, segment-sum in the batch, gather U rows, add, scatter-set (no lo)
  compensated         isojax.stats.accumulators: segsum_set with a TwoSum into (hi, lo) rows, the batch's
                      segment sums by scatter-add (StatsOptions(segment_sum="scatter")) or by a
                      segmented associative scan ("scan", no atomics)
Gram variants (Sum (x - m)(x - m)^T of one batch, float32 out) by dot algorithm, and the full
update_state (two Grams, sums, per-token) with the default and one fast Gram algorithm.

GB/s counts the bytes a minimal kernel of the variant must move: read x once, read and write
the U touched accumulator rows (twice for hi and lo); '% copy' compares it with a measured
device copy (read + write). Gram rows report TFLOP/s at 2*N*D^2 flops per Gram, and the
relative Frobenius error against float64 numpy (for the smallest D only, host-side).
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.stats import accumulators as stats, token_sums
from isojax.stats.measures import intra_sim
from isojax.stats.options import StatsOptions

FAST_GRAM = lax.DotAlgorithmPreset.BF16_BF16_F32_X6  # ~float32 accuracy on tensor cores


def _unit(x_NxD):
    x = x_NxD.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=1, keepdims=True)


def tok_scatter_add(tok_VxD, x_NxD, ids_N):
    return tok_VxD.at[ids_N].add(_unit(x_NxD))


def tok_scatter_add_sorted(tok_VxD, x_NxD, ids_N):
    order = jnp.argsort(ids_N)
    return tok_VxD.at[ids_N[order]].add(_unit(x_NxD)[order], indices_are_sorted=True)


def tok_segment_sum_v(tok_VxD, x_NxD, ids_N):
    return tok_VxD + jax.ops.segment_sum(_unit(x_NxD), ids_N, num_segments=tok_VxD.shape[0])


def tok_segsum_set(tok_VxD, x_NxD, ids_N):
    index = stats.index_tokens(ids_N, jnp.ones(ids_N.shape, bool), tok_VxD.shape[0])
    seg_NxD = jax.ops.segment_sum(_unit(x_NxD)[index.order_N], index.rank_N,
                                  num_segments=ids_N.shape[0], indices_are_sorted=True)
    rows_NxD = tok_VxD.at[index.uniq_U].get(mode="fill", fill_value=0.0) + seg_NxD
    return tok_VxD.at[index.uniq_U].set(rows_NxD, mode="drop", unique_indices=True,
                                        indices_are_sorted=True)


def make_compensated(segment_sum):
    opts = StatsOptions(segment_sum=segment_sum)

    def update(acc, x_NxD, ids_N):
        index = stats.index_tokens(ids_N, jnp.ones(ids_N.shape, bool), acc.count_SxV.shape[1])
        return intra_sim.Sums(*token_sums._add_batch(acc.count_SxV, acc.sum_SxVxD, 0, _unit(x_NxD), index, opts))
    return update


def make_gram(precision):
    def gram(x_NxD):
        x = x_NxD.astype(jnp.float32)
        dev = x - jnp.mean(x, axis=0)
        return jnp.einsum("nd,ne->de", dev, dev, precision=precision,
                          preferred_element_type=jnp.float32)
    return gram


def make_update_state(precision):
    opts = StatsOptions(gram_precision="bf16x6" if precision == lax.DotAlgorithmPreset.BF16_BF16_F32_X6 else "highest")

    def update(acc, x_NxD, ids_N):
        return stats.update_state(acc, 0, x_NxD, ids_N, jnp.ones(ids_N.shape, bool), 0, opts=opts)
    return update


def time_fn(fn, state, args, repeats, donate):
    """Median seconds of fn(state, *args); the state is threaded (donated) through calls."""
    f = jax.jit(fn, donate_argnums=(0,) if donate else ())
    for _ in range(2):
        out = f(state, *args)
        state = out if donate else state
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f(state, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        state = out if donate else state
    return statistics.median(times)


def copy_bandwidth(nbytes, repeats):
    a = jnp.ones(nbytes // 4, jnp.float32)
    t = time_fn(lambda a: a + 1.0, a, (), repeats, donate=True)
    return 2 * nbytes / t


def zipf_ids(rng, n, vocab_size, a=1.1):
    perm = rng.permutation(vocab_size)  # frequent ids spread over the table, as in a real vocab
    return perm[(rng.zipf(a, n) - 1) % vocab_size].astype(np.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--dims", type=int, nargs="+", help="override the widths D")
    p.add_argument("--tokens", type=int, nargs="+", help="override the batch sizes N")
    p.add_argument("--vocab", type=int, help="override V")
    args = p.parse_args()
    if args.quick:
        dims, tokens, vocab, repeats, copy_bytes = [32, 64], [1024, 4096], 1000, 3, 1 << 24
    else:
        dims, tokens, vocab, repeats, copy_bytes = [512, 1024, 2048, 4096], [16384, 65536], \
            50304, 10, 1 << 30
    repeats = args.repeats or repeats
    dims, tokens, vocab = args.dims or dims, args.tokens or tokens, args.vocab or vocab
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    lines = []

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    bw = copy_bandwidth(copy_bytes, repeats)
    emit(f"# isojax stats kernel bench | card: {dev.device_kind} ({dev.platform}) | "
         f"jax {jax.__version__} | states {args.dtype} | V={vocab} | Zipf(1.1) ids | "
         f"median of {repeats}")
    emit(f"# device copy (read+write) {bw / 1e9:.1f} GB/s"
         + (" | H100 HBM3 spec 3350 GB/s" if on_gpu else ""))
    emit(f"{'D':>5} {'N':>6} {'U':>6} {'variant':<28} {'ms':>9} {'Mtok/s':>8} "
         f"{'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'rel.err':>9}")
    rng = np.random.default_rng(0)
    gram_algos = {"gram HIGHEST (f32)": lax.Precision.HIGHEST,
                  "gram BF16_BF16_F32_X3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                  "gram BF16_BF16_F32_X6": FAST_GRAM,
                  "gram DEFAULT": lax.Precision.DEFAULT}
    if on_gpu:
        gram_algos["gram TF32_TF32_F32_X3"] = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    for d in dims:
        for n in tokens:
            x = jnp.asarray(rng.normal(size=(n, d)) + 0.5 * rng.normal(size=d), dtype)
            ids_np = zipf_ids(rng, n, vocab)
            ids = jnp.asarray(ids_np)
            uniq = len(np.unique(ids_np))
            x_bytes = n * d * dtype.itemsize

            def row(name, t, arrays=0, flops=0.0, err=None):
                gbs = (x_bytes + arrays * 2 * uniq * d * 4) / t / 1e9 if arrays else None
                emit(f"{d:>5} {n:>6} {uniq:>6} {name:<28} {t * 1e3:>9.3f} {n / t / 1e6:>8.2f} "
                     + (f"{gbs:>8.1f} {100 * gbs * 1e9 / bw:>5.1f}%" if gbs else f"{'':>15}")
                     + (f" {flops / t / 1e12:>8.2f}" if flops else f" {'':>8}")
                     + (f" {err:>9.1e}" if err is not None else ""))

            def attempt(name, thunk, **kw):
                try:
                    row(name, thunk(), **kw)
                except Exception as e:  # an unsupported algorithm must not end the run
                    emit(f"{d:>5} {n:>6} {uniq:>6} {name:<28} n/a: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:60]}")

            table = lambda: jnp.zeros((vocab, d), jnp.float32)
            for name, fn in [("scatter_add", tok_scatter_add),
                             ("scatter_add_sorted", tok_scatter_add_sorted),
                             ("segment_sum_V (fresh [V,D])", tok_segment_sum_v),
                             ("segsum_set", tok_segsum_set)]:
                attempt(name, lambda: time_fn(fn, table(), (x, ids), repeats, True), arrays=1)
            acc = lambda: intra_sim.init(1, 1, 1, vocab, d)  # IntraSim's per-token sums
            for mode in ("scatter", "scan"):
                attempt(f"compensated ({mode} segsum)",
                        lambda: time_fn(make_compensated(mode), acc(), (x, ids), repeats, True),
                        arrays=2)
            ref = None
            if d == dims[0] and n == tokens[0]:
                x64 = np.asarray(x.astype(jnp.float32), np.float64)
                dev64 = x64 - x64.mean(0)
                ref = dev64.T @ dev64
            for name, algo in gram_algos.items():
                def gram_timed():
                    g = make_gram(algo)
                    return time_fn(lambda _, x: g(x), None, (x,), repeats, False)
                err = None
                if ref is not None:
                    try:
                        got = np.asarray(jax.jit(make_gram(algo))(x), np.float64)
                        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    except Exception:
                        pass
                attempt(name, gram_timed, flops=2.0 * n * d * d, err=err)
            for name, algo in [("update_state (HIGHEST)", lax.Precision.HIGHEST),
                               ("update_state (BF16_X6)", FAST_GRAM)]:
                attempt(name, lambda: time_fn(make_update_state(algo), acc(), (x, ids),
                                              repeats, True),
                        arrays=2, flops=4.0 * n * d * d)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_stats_kernel.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
