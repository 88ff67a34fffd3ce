"""Run checkpoints: the accumulators as they lie on the devices (Orbax, sharded: every process
writes its own shards, nothing goes through one host) + the data cursor and run settings (JSON).

Saves are asynchronous: `save` returns once the arrays are copied off the devices (so the next
step may reuse their buffers) and the files are written in a background thread. Orbax writes
each step into a temporary directory and renames it when complete, so a SIGKILL mid-write
leaves the previous checkpoint intact and the partial one is ignored. The layout depends on the
device count (runner.py), so a checkpoint resumes on as many devices as wrote it.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from isojax.errors import UserError


def _manager(directory: Path, asynchronous: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=asynchronous)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("acc", "meta"))


def _flat(tree) -> dict:
    """Leaves by path; Orbax refuses zero-size arrays, which carry nothing and are left out."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="__"): v for k, v in leaves if v.size}


class Checkpointer:
    """Writes checkpoints of one run, one at a time, in the background."""

    def __init__(self, directory: Path):
        self.manager = _manager(directory, asynchronous=True)

    def save(self, step: int, acc, meta: dict) -> None:
        self.manager.wait_until_finished()  # the previous one first: never two in flight
        self.manager.save(step, args=ocp.args.Composite(acc=ocp.args.StandardSave(_flat(acc)),
                                                        meta=ocp.args.JsonSave(meta)))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def latest(directory: Path, abstract_acc):
    """(accumulators, meta) of the newest complete checkpoint, or None. abstract_acc: the
    accumulators' jax.ShapeDtypeStructs with their shardings; arrays are restored onto them."""
    if not Path(directory).is_dir():
        return None
    with _manager(directory, asynchronous=False) as mngr:
        step = mngr.latest_step()
        if step is None:
            return None
        target = _flat(abstract_acc)
        try:
            out = mngr.restore(step, args=ocp.args.Composite(acc=ocp.args.StandardRestore(target),
                                                             meta=ocp.args.JsonRestore()))
        except Exception as e:  # shape mismatch or damage: Orbax raises many types
            raise UserError(f"{directory}: checkpoint step {step} does not fit this run "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
    restored = out["acc"]
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_acc)

    def leaf(path, a):
        got = restored.get(jax.tree_util.keystr(path, simple=True, separator="__"))
        if got is not None:
            return got
        return jax.device_put(np.zeros(a.shape, a.dtype), a.sharding) if a.sharding is not None else \
            np.zeros(a.shape, a.dtype)

    return jax.tree_util.tree_unflatten(treedef, [leaf(k, a) for k, a in paths]), out["meta"]
