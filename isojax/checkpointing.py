"""Atomic run checkpoints: merged accumulators (Orbax) + the data cursor and run settings (JSON).

A checkpoint holds the accumulators merged over devices, so a run may resume on another number
of devices. Orbax writes each step into a temporary directory and renames it when complete, so
a SIGKILL mid-write leaves the previous checkpoint intact and the partial one is ignored.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from isojax.errors import UserError


def _manager(directory: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("acc", "meta"))


def _flat(tree) -> dict:
    """Leaves by path; Orbax refuses zero-size arrays, which carry nothing and are left out."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="__"): v for k, v in leaves if v.size}


def save(directory: Path, step: int, acc_host, meta: dict) -> None:
    with _manager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(acc=ocp.args.StandardSave(_flat(acc_host)),
                                                meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def latest(directory: Path, abstract_acc):
    """(accumulators as numpy, meta) of the newest complete checkpoint, or None if there is none."""
    if not Path(directory).is_dir():
        return None
    with _manager(directory) as mngr:
        step = mngr.latest_step()
        if step is None:
            return None
        target = _flat(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_acc))
        try:
            out = mngr.restore(step, args=ocp.args.Composite(acc=ocp.args.StandardRestore(target),
                                                             meta=ocp.args.JsonRestore()))
        except Exception as e:  # shape mismatch or damage: Orbax raises many types
            raise UserError(f"{directory}: checkpoint step {step} does not fit this run "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
    restored = out["acc"]
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_acc)
    leaves = [restored.get(jax.tree_util.keystr(k, simple=True, separator="__"), np.zeros(a.shape, a.dtype))
              for k, a in paths]
    return jax.tree_util.tree_unflatten(treedef, leaves), out["meta"]
