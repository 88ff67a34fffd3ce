"""Smallest programs that run on several GPUs, one per process, to find what crashes (see
bisect_multi_gpu.py). Prints a line per probe: ok, or the signal and the last stage reached.

    python bench/probe_multi_gpu.py                   # all probes
    XLA_FLAGS=... python bench/probe_multi_gpu.py     # the same under other XLA flags
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBES = ["take_replicated_input", "old_like_step", "put", "jit_add", "gspmd_matmul", "shard_map_add", "shard_map_psum", "shard_map_matmul_bf16",
          "shard_map_scan", "shard_map_take", "shard_map_sort", "shard_map_fori_scatter", "shard_map_while_dynamic"]


def probe(name: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("d"))
    stage = lambda s: print(f"stage {s}", flush=True)
    x = jax.device_put(jnp.arange(n * 8 * 128, dtype=jnp.float32).reshape(n * 8, 128), rows)
    stage("put")
    sm = lambda f, out=P("d"): jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=out, check_vma=False))
    if name == "put":
        y = x
    elif name == "take_replicated_input":  # a table passed in replicated, as the parameters are
        table = jax.device_put(jnp.ones((1000, 128), jnp.bfloat16), NamedSharding(mesh, P()))
        f = jax.jit(jax.shard_map(lambda t, a: jnp.take(t, a[:, 0].astype(jnp.int32) % 1000, axis=0),
                                  mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"), check_vma=False))
        y = f(table, x)
    elif name == "old_like_step":  # replicated params + per-device accumulators with a leading axis, donated
        w = jax.device_put(jnp.ones((128, 128), jnp.bfloat16), NamedSharding(mesh, P()))
        acc = jax.device_put(jnp.zeros((n, 128)), rows)

        def local(w, acc, a):
            h = a.astype(jnp.bfloat16) @ w
            return acc + h.astype(jnp.float32).sum(0, keepdims=True)

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d"),
                                  check_vma=False), donate_argnums=(1,))
        y = f(w, acc, x)
    elif name == "jit_add":
        y = jax.jit(lambda a: a * 2 + 1)(x)
    elif name == "gspmd_matmul":
        w = jax.device_put(jnp.ones((128, 64)), NamedSharding(mesh, P()))
        y = jax.jit(lambda a, w: a @ w)(x, w)
    elif name == "shard_map_add":
        y = sm(lambda a: a + 1)(x)
    elif name == "shard_map_psum":
        y = sm(lambda a: lax.psum(a, "d"))(x)
    elif name == "shard_map_matmul_bf16":
        y = sm(lambda a: (a.astype(jnp.bfloat16) @ a.T.astype(jnp.bfloat16)).astype(jnp.float32))(x)
    elif name == "shard_map_scan":
        y = sm(lambda a: lax.scan(lambda c, _: (c @ jnp.eye(128) + 1, None), a, None, length=4)[0])(x)
    elif name == "shard_map_take":
        table = jnp.ones((1000, 128))
        y = sm(lambda a: jnp.take(table, a[:, 0].astype(jnp.int32) % 1000, axis=0))(x)
    elif name == "shard_map_sort":
        y = sm(lambda a: jnp.sort(a, axis=0))(x)
    elif name == "shard_map_fori_scatter":
        y = sm(lambda a: lax.fori_loop(0, 3, lambda i, c: c.at[i].add(1.0), a))(x)
    elif name == "shard_map_while_dynamic":
        y = sm(lambda a: lax.fori_loop(0, a[0, 0].astype(jnp.int32) % 3 + 1, lambda i, c: c.at[i].add(1.0), a))(x)
    stage("compiled+dispatched")
    jax.block_until_ready(y)
    print(f"RESULT ok sum={float(jnp.sum(y)):.3e}", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        probe(sys.argv[2])
        return
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else PROBES
    for name in only:
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--probe", name], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = (p.stdout + p.stderr).splitlines()
        res = next((ln for ln in lines if ln.startswith("RESULT")), None)
        stages = [ln for ln in lines if ln.startswith("stage")]
        where = [ln.strip() for ln in lines if ln.strip().startswith("File ")][:3]
        print(f"{name:28s} {res or f'rc={p.returncode} after {stages[-1] if stages else None}'}"
              + ("" if res else f"  at {where}"), flush=True)


if __name__ == "__main__":
    main()
