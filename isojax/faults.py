"""Fault injection for the lifecycle tests (tests/test_extract.py, tests/test_gpu_lane.py).

ISOJAX_FAULT=POINT:N kills this process with SIGKILL the N-th time it reaches POINT:
- `checkpoint_write`: while its N-th checkpoint is half written (the shards on disk, no meta.json);
- `checkpoint_written`: once its N-th checkpoint is complete, the loop a few batches further on.
Unset (every real run), `reached` costs one dictionary lookup."""

from __future__ import annotations

import collections
import os
import signal

_counts: collections.Counter = collections.Counter()


def reached(point: str) -> None:
    spec = os.environ.get("ISOJAX_FAULT")
    if not spec or not spec.startswith(point + ":"):
        return
    _counts[point] += 1
    if _counts[point] == int(spec.split(":", 1)[1]):
        os.kill(os.getpid(), signal.SIGKILL)
