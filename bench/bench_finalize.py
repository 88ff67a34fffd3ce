"""Where finalize's seconds go on the device: one state's float64 spectra, piece by piece, and
ways of taking the eigenvalues of its three [D, D] covariances (issue 12).

    python -m bench.bench_finalize                 # D = 2048 (pythia-1.4b), 26 states
    python -m bench.bench_finalize --d 256 --states 3 --repeats 1   # CPU, seconds

Rows (ms per state, median of --repeats):
  read           hi + lo -> float64, covariances (the [3, D, D] stack)
  tridiagonal    Householder reduction of the three on the device, one at a time (cuSOLVER sytrd)
  batched        the same for all --states states' matrices in one batch (stats/tridiagonal.py), per state
  bisection      the tridiagonals' eigenvalues on the device (jax eigh_tridiagonal), one state
  bisection, all  all --states states' 3 tridiagonals in one call, per state (what finalize runs)
  finalize path  read (finalize._whole_spectra) + the batched reduction + the bisection of all states, per state
  host sterf     the tridiagonals' eigenvalues by LAPACK dsterf on the host instead (scipy)
  eigvalsh       jnp.linalg.eigvalsh of the stack (the solver's own eigh), float64
  host LAPACK    numpy eigvalsh of the stack on the host CPU, float64
and the largest relative difference of each way's eigenvalues from host LAPACK (against the top
eigenvalue). The whole-run estimate multiplies by --states.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

jax.config.update("jax_enable_x64", True)

from isojax.stats import finalize
from isojax.stats import accumulators as stats
from isojax.stats import tridiagonal


def timed(fn, repeats: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--states", type=int, default=26)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    d = args.d
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * d, d)).astype(np.float32) * np.linspace(0.1, 3.0, d, dtype=np.float32)
    x += 5.0 * rng.normal(size=d).astype(np.float32)  # a common direction, as in real states
    n = float(len(x))
    sum_D = x.astype(np.float64).sum(0)
    dev = x - x.mean(0)
    m2 = (dev.T @ dev).astype(np.float32)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    udev = u - u.mean(0)
    um2 = (udev.T @ udev).astype(np.float32)
    pair = lambda a: stats.DFPair(jnp.asarray(np.stack([a, np.zeros_like(a)], -1)[None]))
    m2_p, um2_p = pair(m2), pair(um2)
    n_G, sum_GxD = jnp.asarray([n]), jnp.asarray(sum_D[None])

    read = jax.jit(lambda: finalize._covariances(n, jnp.asarray(sum_D), m2_p.hi[0].astype(jnp.float64),
                                                 um2_p.hi[0].astype(jnp.float64))[0])
    mats = jax.block_until_ready(read())
    tri = jax.jit(lambda m: jax.lax.linalg.tridiagonal(m, lower=True)[1:3])
    diag, off = jax.block_until_ready(tri(mats))
    bis = jax.jit(lambda a, b: jax.vmap(lambda d_, e_: jax.scipy.linalg.eigh_tridiagonal(d_, e_, eigvals_only=True))(a, b))
    diag_all, off_all = jnp.tile(diag, (args.states, 1)), jnp.tile(off, (args.states, 1))
    bis_all = lambda: finalize._bisect(diag_all, off_all)[:3]

    def whole():
        return finalize._read_states(lambda s: finalize._whole_spectra(n_G, sum_GxD, sum_GxD, m2_p, um2_p, per_group=False),
                                     args.states, on_cpu=False)[0][0]
    stack = jnp.tile(mats, (args.states, 1, 1))

    def host_sterf(diag_KxD, off_KxD):
        return np.stack([scipy.linalg.eigvalsh_tridiagonal(a, b, lapack_driver="sterf")[::-1]
                         for a, b in zip(diag_KxD, off_KxD)])
    eigvalsh = jax.jit(lambda m: jnp.linalg.eigvalsh(m)[:, ::-1])

    rows = []
    rows.append(("read", *timed(read, args.repeats)))
    rows.append(("tridiagonal", *timed(lambda: tri(mats), args.repeats)))
    ms, _ = timed(lambda: tridiagonal.tridiagonalize(stack), args.repeats)
    rows.append(("batched", ms / args.states, None))
    rows.append(("bisection", *timed(lambda: bis(diag, off), args.repeats)))
    ms, val = timed(bis_all, args.repeats)
    rows.append(("bisection, all", ms / args.states, val))
    ms, val = timed(whole, args.repeats)
    rows.append(("finalize path", ms / args.states, val))
    rows.append(("host sterf", *timed(lambda: host_sterf(np.asarray(diag), np.asarray(off)), args.repeats)))
    rows.append(("eigvalsh", *timed(lambda: eigvalsh(mats), args.repeats)))
    host_m = np.asarray(mats)
    t = time.perf_counter()
    ref = np.linalg.eigvalsh(host_m)[:, ::-1]
    rows.append(("host LAPACK", (time.perf_counter() - t) * 1e3, ref))

    dev0 = jax.devices()[0]
    print(f"device: {dev0.device_kind} ({jax.default_backend()}); jax {jax.__version__}; D = {d}, float64")
    print(f"{'way':<16}{'ms/state':>10}{'x states s':>12}{'max rel err':>13}")
    for name, ms, val in rows:
        err = ""
        if name not in ("read", "tridiagonal", "batched") and val is not None:
            v = np.asarray(val)
            if name == "bisection":  # ascending (finalize._bisect: descending)
                v = v[:, ::-1]
            err = f"{np.abs(v - ref).max() / np.abs(ref).max():.1e}"
        print(f"{name:<16}{ms:>10.1f}{ms * args.states / 1e3:>12.2f}{err:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
