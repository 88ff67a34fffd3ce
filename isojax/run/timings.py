"""Seconds per phase of a run (the manifest's "timings" and "timeline"), and the one background
thread a run uses for work that overlaps the loop."""

from __future__ import annotations

import concurrent.futures
import time

TIMED = ("load", "convert", "tokenize", "compile", "loop", "merge", "finalize", "write", "plots")


class Timings(dict):
    """Seconds per phase of a run (manifest "timings"); `with timings("loop"): ...` adds to one.
    timeline: [phase, start s, end s] of each such span since the run began (manifest "timeline")."""

    def __init__(self):
        super().__init__({k: 0.0 for k in TIMED})
        self.start = time.time()
        self.timeline: list[list] = []

    def __call__(self, phase: str):
        timings = self

        class _Phase:
            def __enter__(self):
                self.t = time.time()

            def __exit__(self, *exc):
                end = time.time()
                timings[phase] += end - self.t
                timings.timeline.append([phase, round(self.t - timings.start, 3), round(end - timings.start, 3)])

        return _Phase()


def in_background(fn) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="isojax")
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future
