"""Fault injection for the lifecycle tests (tests/test_extract.py, tests/test_gpu_lane.py,
tests/test_data_integrity.py).

ISOJAX_FAULT=POINT:N kills this process with SIGKILL the N-th time it reaches POINT:
- `checkpoint_write`: while its N-th checkpoint is half written (the shards on disk, no meta.json);
- `checkpoint_written`: once its N-th checkpoint is complete, the loop a few batches further on.
ISOJAX_FAULT=POINT:hold stops every thread that reaches POINT for good (until the process is killed):
- `tokenize_chunk`: a chunk of text about to be split and tokenized (a worker process's task), so
  that a build is surely unfinished when a test kills it.
ISOJAX_FAULT=POINT:sigterm sends this process SIGTERM (a preemption notice) the first time it reaches POINT:
- `checkpoint_saved`: the loop has handed a checkpoint to its writer (the main thread, at a step
  that every process of a run reaches).
  One process: SIGTERM is handled before `reached` returns (the loop stops at this step). Several
  (jax.distributed): `reached` then holds the loop until JAX's preemption service of every process
  has taken the step it is at (_await_preemption_sync), so the step they stop at is set before any
  passes it: the step after this one, whatever the machine's speed.
ISOJAX_FAULT=POINT:raise raises a UserError in the thread that reaches POINT, to test that an error
in a background part of a run ends it with one `error:` line and no partial file:
- `tokens_opened`: the token cache opened, on the thread beside the weights' load (run/measure.py);
- `sources_readout`: finalize's per-source reductions dispatched, before the first is read, on the
  thread beside the figures and the writes (run/results.py).
- `sweep_saving`: a sweep's thread about to write and commit a measured step's results while the
  next step is measured (run/sweep.py): `sweep_saving:2` kills the sweep there at its second step,
  `sweep_saving:hold` keeps every step uncommitted while the next ones measure.
- `weights_ahead`: a sweep's thread about to read the next checkpoint's weights while the current
  one loops (run/load_ahead.py): `weights_ahead:1` kills the sweep there, `weights_ahead:raise`
  fails the read ahead (the next step then reads them itself).
Several faults at once: comma-separated (`sweep_saving:hold,checkpoint_written:3`).
In-process tests order events with `hook(POINT, fn)`: fn() runs in every thread that reaches POINT
(`weights_read`: the main thread about to read the weights, or take those read ahead; the two above; `sweep_saving`;
`weights_ahead`; `plots_drawing`: the figures' thread about to draw its first; `sample_identify`: the
thread that recovers the sampled tokens' ids, about to start).
Unset (every real run), `reached` costs two dictionary lookups."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading

_counts: collections.Counter = collections.Counter()
_hooks: dict = {}


@contextlib.contextmanager
def hook(point: str, fn):
    """fn() runs in each thread that reaches `point` while the block runs (tests only)."""
    _hooks[point] = fn
    try:
        yield
    finally:
        del _hooks[point]


def reached(point: str) -> None:
    fn = _hooks.get(point)
    if fn is not None:
        fn()
    spec = os.environ.get("ISOJAX_FAULT")
    if not spec:
        return
    what = next((one.split(":", 1)[1] for one in spec.split(",") if one.startswith(point + ":")), None)
    if what is None:
        return
    if what == "raise":
        from isojax.errors import UserError
        raise UserError(f"fault injected at {point} (ISOJAX_FAULT)")
    if what == "hold":
        threading.Event().wait()
    if what == "sigterm":
        if not _counts[point]:
            signal.raise_signal(signal.SIGTERM)  # to this thread: its handler has run when this returns
            _await_preemption_sync()
        _counts[point] += 1
        return
    _counts[point] += 1
    if _counts[point] == int(what):
        os.kill(os.getpid(), signal.SIGKILL)


def _await_preemption_sync() -> None:
    """In a run of several processes: wait until every process's preemption service has put its
    step counter (the step of its last reached_preemption_sync_point) in the coordination service.
    From then on no process gets past reached_preemption_sync_point until the stop step is set (the
    sync protocol holds that lock: XLA's preemption_sync_manager.cc), and every process that reaches
    this point first waits here, its counter frozen: the largest counter is this step. The counters'
    key is the service's own (jaxlib 0.10); were it renamed, this waits until the test's timeout."""
    from jax._src.distributed import global_state
    if global_state.preemption_sync_manager is None:
        return
    import jax
    while len(global_state.client.key_value_dir_get("PREEMPTION_CURRENT_COUNTER/")) < jax.process_count():
        threading.Event().wait(0.01)
