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
Unset (every real run), `reached` costs one dictionary lookup."""

from __future__ import annotations

import collections
import os
import signal
import threading

_counts: collections.Counter = collections.Counter()


def reached(point: str) -> None:
    spec = os.environ.get("ISOJAX_FAULT")
    if not spec or not spec.startswith(point + ":"):
        return
    what = spec.split(":", 1)[1]
    if what == "hold":
        threading.Event().wait()
    if what == "sigterm":
        if not _counts[point]:
            os.kill(os.getpid(), signal.SIGTERM)
        _counts[point] += 1
        return
    _counts[point] += 1
    if _counts[point] == int(what):
        os.kill(os.getpid(), signal.SIGKILL)
