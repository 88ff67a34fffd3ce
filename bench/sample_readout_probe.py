"""The sample's float64 read-out of one checkpoint (issue 47): the per-state path it replaced (one
_batch_anisotropy and one geometry program per state with a host read each, the registered measures
read per state, one _centered_cross program per pair of sample_cka) against the batched one
(sr.sample_metrics and sample_cka as they are), on random float32 states already on the
device. Prints one table: phase, seconds of each (best of --repeat, after a warm-up call that
compiles), and the largest relative difference of their numbers.

    python -m bench.sample_readout_probe                             # pythia-410m: 26 x 16,384 x 1024
    python -m bench.sample_readout_probe --states 6 --k 8192 --d 64  # a CPU look
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from isojax.stats import finalize as fz
from isojax.stats import sample_readout as sr
from isojax.stats import geometry, measures

_geometry = jax.jit(lambda x: (geometry.median_abs(x), geometry.inter_sim_standardized(x)))
_centered_cross = jax.jit(geometry.centered_cross)


def old_sample_metrics(states, count: int, num: int) -> list[dict]:
    """The per-state path: the next state's programs dispatched one state ahead, each state read."""
    batches = count // sr.BATCH

    def dispatch(s):
        x = states(s)
        with jax.enable_x64(True):
            ratios = sr._batch_anisotropy(x[:batches * sr.BATCH].reshape(batches, sr.BATCH, -1)) if batches else None
            return x, ratios, _geometry(x)

    out, ahead, previous = [], dispatch(0), None
    for s in range(num):
        (x, ratios, (median, standardized)), ahead = ahead, dispatch(s + 1) if s + 1 < num else None
        m = {"sample_abs_median": float(median), "inter_sim_standardized": float(standardized)}
        if batches:
            ratios = np.asarray(ratios)
            m["anisotropy_batch_mean"], m["anisotropy_uncentered_batch_mean"] = ratios.mean(0)
        m.update(measures.sample_readout(previous, x))
        previous = x
        out.append(m)
    return out


def old_sample_cka(states, num: int) -> np.ndarray:
    cross, kept, pending = np.zeros((num, num)), [], []
    with jax.enable_x64(True):
        for i in range(num):
            kept.append(states(i))
            pending += [((i, j), _centered_cross(kept[i], kept[j])) for j in range(i + 1)]
        for (i, j), c in pending:
            cross[i, j] = cross[j, i] = float(c)
    return np.array(geometry.cka_matrix(cross), dtype=np.float64)


def best(call, repeat: int):
    result = call()  # compiles
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
    return min(seconds), result


def largest_difference(old: list[dict], new: list[dict]) -> float:
    worst = 0.0
    for a, b in zip(old, new):
        for key, value in a.items():
            if value is not None and b.get(key) is not None:
                worst = max(worst, abs(value - b[key]) / max(abs(value), 1e-300))
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=int, default=26)
    parser.add_argument("--k", type=int, default=16384, help="sampled tokens")
    parser.add_argument("--d", type=int, default=1024, help="width")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jitted-measures", action="store_true",
                        help="the registered measures jitted as on accelerators, also on the CPU")
    args = parser.parse_args(argv)
    if min(args.states, args.k, args.d, args.repeat) < 1:
        parser.error("--states, --k, --d and --repeat must be at least 1")
    if args.jitted_measures:
        measures.on_host = lambda: False
    rng = np.random.default_rng(0)
    scale = jnp.asarray(rng.uniform(0.2, 4.0, size=(args.states, 1, args.d)), jnp.float32)
    data = [jax.random.normal(jax.random.key(s), (args.k, args.d), jnp.float32) * scale[s] + s
            for s in range(args.states)]
    jax.block_until_ready(data)
    states = lambda s: data[s]
    names = [f"s{s}" for s in range(args.states)]
    print(f"{jax.devices()[0].device_kind}: {args.states} states x K {args.k:,} x D {args.d}, "
          f"{sr.sample_chunk(args.k, args.d, args.states)} states a program, measures "
          f"{'on the host' if measures.on_host() else 'jitted'}")
    old_m_s, old_m = best(lambda: old_sample_metrics(states, args.k, args.states), args.repeat)
    new_m_s, new_m = best(lambda: sr.sample_metrics(states, args.k, names, intrinsic=False), args.repeat)
    old_c_s, old_c = best(lambda: old_sample_cka(states, args.states), args.repeat)
    new_c_s, new_c = best(lambda: np.array(sr.sample_cka(states, args.k, names)["matrix"], np.float64), args.repeat)
    cka_diff = float(np.nanmax(np.abs(old_c - new_c) / np.abs(old_c)))
    print(f"{'phase':<16}{'old s':>10}{'new s':>10}{'max rel diff':>14}")
    print(f"{'sample_metrics':<16}{old_m_s:>10.3f}{new_m_s:>10.3f}{largest_difference(old_m, new_m):>14.2e}")
    print(f"{'sample_cka':<16}{old_c_s:>10.3f}{new_c_s:>10.3f}{cka_diff:>14.2e}")


if __name__ == "__main__":
    main()
