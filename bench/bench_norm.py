"""Issue 13: a parallel-residual block's two LayerNorms, XLA's two kernels against one Pallas
kernel (isojax.kernels.norm), at each model's batch shape. (GPU only.)

    python -m bench.bench_norm

Prints ms per pair for XLA and for the kernel at 4 and 8 warps, the effective bandwidth (bytes of
one read of x and two writes), the share of outputs that differ from XLA's, and how far each
lies beyond one bf16 rounding of float64 on the first 4,096 rows (norm_kernel.rounding_excess;
<= 0: within).
"""

from __future__ import annotations

import sys


import jax
import jax.numpy as jnp
import numpy as np

from bench.common import timed
from isojax.kernels import norm as norm_kernel
from isojax.model.layers import Norm

SHAPES = {"pythia-70m": (262144, 512), "pythia-410m": (262144, 1024), "pythia-1.4b": (65536, 2048)}


def main() -> int:
    if jax.default_backend() != "gpu":
        print("bench_norm: needs a GPU", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    print(f"{'model':<13}{'N x D':>14}{'XLA ms':>9}{'kernel 4w':>11}{'kernel 8w':>11}{'GB/s (best)':>13}"
          f"{'differ':>9}{'XLA beyond':>12}{'kernel beyond':>15}")
    for name, (n, d) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 5)
        x = (jax.random.normal(keys[0], (n, d), jnp.float32) * 2 + 1).astype(jnp.bfloat16)
        s1, b1, s2, b2 = (jax.random.normal(k, (d,), jnp.float32).astype(jnp.bfloat16) for k in keys[1:])
        ln = lambda x, s, b: Norm("layer", 1e-5, jnp.bfloat16, jnp.bfloat16).apply({"params": {"scale": s, "bias": b}}, x)
        xla = jax.jit(lambda x, s1, b1, s2, b2: (ln(x, s1, b1), ln(x, s2, b2)))
        want = xla(x, s1, b1, s2, b2)
        times = [timed(xla, x, s1, b1, s2, b2)]
        for warps in (4, 8):
            fused = jax.jit(lambda x, s1, b1, s2, b2: norm_kernel.layer_norm_pair(x, s1, b1, s2, b2, eps=1e-5, num_warps=warps))
            got = fused(x, s1, b1, s2, b2)
            times.append(timed(fused, x, s1, b1, s2, b2))
        differ = np.mean([np.mean(np.asarray(g) != np.asarray(w)) for g, w in zip(got, want)])
        rows = slice(0, 4096)
        truth = [norm_kernel.reference(x[rows], s, b, 1e-5) for s, b in ((s1, b1), (s2, b2))]
        beyond = lambda outs: max(norm_kernel.rounding_excess(o[rows], t) for o, t in zip(outs, truth))
        gbps = 3 * n * d * 2 / min(times[1:]) / 1e6
        print(f"{name:<13}{f'{n} x {d}':>14}{times[0]:>9.3f}{times[1]:>11.3f}{times[2]:>11.3f}{gbps:>13,.0f}"
              f"{differ:>9.2%}{beyond(want):>12.2g}{beyond(got):>15.2g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
