"""Seconds per phase of a run (the manifest's "timings" and "timeline"), and the background
threads a run uses for work that overlaps the main thread's."""

from __future__ import annotations

import concurrent.futures
import threading
import time

TIMED = ("load", "convert", "tokenize", "compile", "loop", "merge", "finalize", "write", "plots")
BESIDE = " (beside)"  # the timeline's name of a span run on a background thread: "tokenize (beside)"


class Timings(dict):
    """Seconds per phase of a run (manifest "timings"); `with timings("loop"): ...` adds to one.
    The seconds are the main thread's, so they sum to the wall time; work on a background thread
    (`with timings.beside("tokenize"): ...`) is in them only as the main thread's wait for it.
    timeline: [phase, start s, end s] of each span since the run began (manifest "timeline"),
    background spans included, named "<phase> (beside)": what ran beside what."""

    def __init__(self):
        super().__init__({k: 0.0 for k in TIMED})
        self.start = time.time()
        self.timeline: list[list] = []

    def __call__(self, phase: str):
        return _Span(self, phase, counted=True)

    def beside(self, phase: str):
        """A span of `phase` on a background thread: in the timeline only."""
        return _Span(self, phase + BESIDE, counted=False)


class _Span:
    def __init__(self, timings: Timings, phase: str, counted: bool):
        self.timings, self.phase, self.counted = timings, phase, counted

    def __enter__(self):
        self.t = time.time()

    def __exit__(self, *exc):
        end, timings = time.time(), self.timings
        if self.counted:
            timings[self.phase] += end - self.t
        timings.timeline.append([self.phase, round(self.t - timings.start, 3), round(end - timings.start, 3)])


def in_background(fn, daemon: bool = False, name: str = "isojax") -> concurrent.futures.Future:
    """fn() on a thread; its result, or its error, comes from the Future. By default the
    interpreter waits for the thread at a normal exit: a job that may still be running when its
    caller returns (the per-source read-out, the sample's token ids, a compile) must be one, since
    a daemon thread still inside JAX or XLA when the interpreter finalizes aborts the process
    ("terminate called ...", SIGABRT). daemon: a thread that may block for ever (on the token
    stream) and is always done, its result taken, before a run returns; an error exit does not
    wait for it (errors.exit_with skips finalization). Its error, a KeyboardInterrupt included,
    comes from the Future."""
    if not daemon:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        future = pool.submit(fn)
        pool.shutdown(wait=False)
        return future
    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to the thread that takes the result
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future
