"""Why the data-parallel step of isojax <= 26fd752 segfaulted in XLA's compile on 2 GPUs, and
whether today's step compiles and runs there. Each variant runs in its own process (a
segfault kills only that process) and prints one line; the table comes last.

    python bench/bisect_multi_gpu.py --old .old     # .old: `git archive 26fd752 isojax configs`
    python bench/bisect_multi_gpu.py --only new_full

Old variants import isojax from --old (the pre-scale-out code): the shard_map step as it was,
then with one part taken out at a time. New variants import the working tree's isojax.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OLD = ["old_full", "old_no_token_stats", "old_xla_attention", "old_no_donation", "old_forward_only",
       "old_stats_only", "old_stats_only_no_tokens", "old_one_device"]
NEW = ["new_full", "new_fsdp"]


def _model(old: bool, attention: str = "cudnn"):
    import jax
    import jax.numpy as jnp
    if jax.default_backend() == "cpu":
        attention = "xla"

    from isojax.config import preset
    from isojax.loading import random_params
    from isojax.model import GPTNeoX
    cfg = preset("pythia-70m")
    if old:
        module = GPTNeoX(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_impl=attention)
    else:
        from isojax.options import ForwardOptions
        module = GPTNeoX(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention=attention))
    return cfg, module, random_params(cfg, "bfloat16")


def _batch(n_dev: int, rows_per_dev: int = 4, t: int = 512, vocab: int = 50000, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    b = rows_per_dev * n_dev
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    seg = np.repeat(np.arange(1, 9), t // 8)[None].repeat(b, 0).astype(np.int32)
    pos = np.tile(np.arange(t // 8), 8)[None].repeat(b, 0).astype(np.int32)
    return tokens, seg, pos


def run_old(variant: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from isojax import runner as runner_lib, stats
    devices = jax.local_devices()[:1] if variant == "old_one_device" else jax.local_devices()
    attention = "xla" if variant == "old_xla_attention" else "cudnn"
    cfg, module, params = _model(True, attention)
    token_stats = variant not in ("old_no_token_stats", "old_xla_attention", "old_stats_only_no_tokens")
    r = runner_lib.Runner(module, params, token_stats=token_stats, devices=devices)
    tokens, seg, pos = _batch(len(devices))
    d = cfg.hidden_size
    if variant in ("old_full", "old_no_token_stats", "old_xla_attention", "old_one_device"):
        step = r._step
    else:
        def local_step(params, acc, tokens_BxT, seg_BxT, pos_BxT, group, centers_SxD):
            acc = jax.tree.map(lambda x: x[0], acc)
            ids_N, valid_N = tokens_BxT.reshape(-1), seg_BxT.reshape(-1) != 0
            vocab = acc.tok_count_SxV.shape[1]
            index = stats.index_tokens(ids_N, valid_N, vocab) if vocab else None
            if variant == "old_forward_only":
                observe = lambda a, s, x: a.replace(norm_sum_GxS=stats.DF(a.norm_sum_GxS.hi + x.astype(jnp.float32).sum(),
                                                                           a.norm_sum_GxS.lo))
                acc = module.apply({"params": params}, tokens_BxT, seg_BxT, pos_BxT, acc, observe)
            elif variant == "old_no_donation":
                observe = lambda a, s, x: stats.update_state(a, s, x.reshape(-1, d), ids_N, valid_N, group, index=index)
                acc = module.apply({"params": params}, tokens_BxT, seg_BxT, pos_BxT, acc, observe)
            else:  # stats only: every state is the embedding
                x_NxD = params["embed_in"][tokens_BxT.reshape(-1)]
                acc = jax.lax.fori_loop(0, cfg.num_states, lambda s, a: stats.update_state(
                    a, s, x_NxD, ids_N, valid_N, group, index=index), acc)
            return jax.tree.map(lambda x: x[None], acc)

        sharded = jax.shard_map(local_step, mesh=r.mesh, in_specs=(P(), P("data"), P("data"), P("data"), P("data"),
                                                                   P(), P()), out_specs=P("data"), check_vma=False)
        step = jax.jit(sharded, donate_argnums=() if variant == "old_no_donation" else (1,))
    rows = jax.device_put((tokens, seg, pos), r.row_sharding)
    t0 = time.time()
    compiled = step.lower(r.params, r.acc, *rows, jnp.int32(0), r.centers_SxD).compile()
    t1 = time.time()
    acc = compiled(r.params, r.acc, *rows, jnp.int32(0), r.centers_SxD)
    jax.block_until_ready(acc)
    print(f"RESULT {variant} ok compile={t1 - t0:.1f}s run={time.time() - t1:.1f}s devices={len(devices)}", flush=True)


def run_new(variant: str) -> None:
    import dataclasses

    import jax

    from isojax import parallel
    from isojax.finalize import finalize
    from isojax.runner import Runner
    cfg, module, params = _model(False)
    n = jax.device_count()
    results = {}
    for k, sizes in ((1, {"data": 1, "model": 1}),
                     (n, {"data": 1, "model": n} if variant == "new_fsdp" else {"data": n, "model": 1})):
        mesh = parallel.make_mesh(sizes, devices=jax.devices()[:k])
        mod = module if k == 1 else module.clone(options=dataclasses.replace(
            module.options, activation_sharding=parallel.rows(mesh)))
        r = Runner(mod, params, mesh)
        t0 = time.time()
        for i in range(4):  # the same 4 batches of 8 rows whatever the device count
            r.step(*_batch(1, 8, seed=i), 0)
        jax.block_until_ready(r.acc)
        t1 = time.time()
        final = finalize(r.merged_layers(), cfg.state_names, token=r.token_readout())
        results[k] = final["layers"]
        print(f"devices={k} mesh={sizes} steps+compile={t1 - t0:.1f}s", flush=True)
    worst = 0.0
    for a, b in zip(results[1], results[n]):
        assert a["count"] == b["count"] and a["intra_tokens"] == b["intra_tokens"]
        for key in ("inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "anisotropy_uncentered", "mean_norm"):
            worst = max(worst, abs(a[key] - b[key]) / max(1.0, abs(a[key])))
    print(f"RESULT {variant} ok devices={n} worst_rel_diff_vs_1_device={worst:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=".old", help="directory holding the pre-scale-out isojax package")
    ap.add_argument("--only", default=None, help="comma-separated variants")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()
    if args.variant:
        (run_old if args.variant.startswith("old") else run_new)(args.variant)
        return
    rows = []
    for v in (args.only.split(",") if args.only else OLD + NEW):
        old = v.startswith("old")
        env = {**os.environ, "PYTHONPATH": str(Path(args.old).resolve() if old else REPO),
               "PYTHONUNBUFFERED": "1"}
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--variant", v], env=env, capture_output=True, text=True,
                               timeout=args.timeout, cwd=str(Path(args.old).resolve()) if old else str(REPO))
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
        where = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("File ")
                 and ("isojax" in ln or "bisect" in ln)][:3]
        status = line.split(" ", 2)[2] if line else f"FAILED rc={rc}: " + " | ".join(where)[-600:]
        rows.append((v, f"{time.time() - t0:.0f}s", status))
        print(f"{v:28s} {rows[-1][1]:>5s}  {status}", flush=True)
    print("\nvariant                      time  result")
    for v, t, status in rows:
        print(f"{v:28s} {t:>5s}  {status}")


if __name__ == "__main__":
    main()
