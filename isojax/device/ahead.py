"""The step compiled ahead of its arguments: from their shapes (device/runner.py Layout and
signature), before the weights arrive, once per shape in a process. A sweep's checkpoints of one
shape are new arguments to the same executable; a Runner runs it where its own arguments have
the shapes it was compiled for (`matches`)."""

from __future__ import annotations

import threading

import jax
import numpy as np

from isojax.device import mesh as parallel
from isojax.device.runner import Layout, signature

_executables: dict = {}  # (the jitted step, its signature's key) -> its Compiled
_lock = threading.Lock()  # one compile per key, whichever thread asks first


def key(sig: tuple) -> tuple:
    leaves, tree = jax.tree.flatten(sig)
    return tree, tuple(leaves)


def matches(sig: tuple, other: tuple) -> bool:
    return key(sig) == key(other)


def compile_step(layout: Layout, params, rows: int, row_len: int) -> tuple:
    """(Compiled step, its signature) for batches of rows x row_len, params: ShapeDtypeStructs
    (hf.loading.abstract_params). Compiled once per shape in this process (also the persistent
    compilation cache's, where one is set)."""
    cfg = layout.module.cfg
    centers = jax.ShapeDtypeStruct((cfg.num_states, 0), np.float32, sharding=parallel.replicated(layout.mesh))
    sig = signature(params, layout.abstract, layout.mesh, rows, row_len, centers)
    step = layout.step()
    with _lock:
        k = (step, key(sig))
        if k not in _executables:
            _executables[k] = step.lower(*sig).compile()
        return _executables[k], sig


def runner_signature(runner, rows: int, row_len: int) -> tuple:
    """A Runner's step arguments for batches of rows x row_len, as shapes (what compile_step compiles)."""
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return signature(jax.tree.map(abstract, runner.params), runner.abstract, runner.mesh, rows, row_len,
                     abstract(runner.centers_SxD))
