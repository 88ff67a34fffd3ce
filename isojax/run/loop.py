"""The host side of the device loop: feed batches, count what the devices have finished,
checkpoint every N tokens, resume."""

from __future__ import annotations

import collections
import contextlib
import functools
import signal
import sys
import threading
import time
from pathlib import Path

from isojax import faults
from isojax.device import mesh as parallel
from isojax.errors import Preempted, UserError
from isojax.log import log

IN_FLIGHT = 2  # steps dispatched ahead of the last finished one: enough to keep the devices busy


@contextlib.contextmanager
def _sigterm_flag():
    """Yields a list that holds True once SIGTERM arrived (a cluster preempting the job), where one
    process can checkpoint on its own: the main thread of a single-process run. With several
    processes JAX's preemption service takes SIGTERM (_preempted_together)."""
    flag: list = []
    if jax_processes() > 1 or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    before = signal.signal(signal.SIGTERM, lambda *_: flag.append(True))
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, before)


def _preempted_together(step: int) -> bool:
    """In a multi-process run: whether step is the one at which every process checkpoints and stops,
    SIGTERM having reached one of them. JAX's preemption service takes SIGTERM there (jax.distributed
    installs it) and agrees on the step: each process calls this at every step."""
    if jax_processes() == 1:
        return False
    from jax._src.distributed import global_state
    from jax.experimental import multihost_utils
    return global_state.preemption_sync_manager is not None and multihost_utils.reached_preemption_sync_point(step)


def jax_processes() -> int:
    import jax
    return jax.process_count()


def consume(runner, batches, done: dict, total: int, *, checkpoint_every=None,
            save_checkpoint=None, progress: bool = True, desc: str = "tokens",
            after_first_step=None) -> tuple[dict, float]:
    """Feed batches to the devices until they run out (a token budget is the token cache's: data/tokens.py).
    The progress bar counts tokens the devices have finished, not dispatched, up to `total`: an
    int, or a function giving it once known and None before (the corpus still being tokenized:
    the bar shows count and rate). after_first_step() is called once the first step (its compile)
    is done. Returns (done, seconds of the first step: compile and first batch). SIGTERM (given
    save_checkpoint) checkpoints after the batch in hand and raises Preempted."""
    from tqdm import tqdm

    done = dict(done)
    last_ckpt = done["tokens"]
    known_total = total if callable(total) else lambda: total
    first_total = known_total()
    bar = tqdm(total=first_total, initial=min(done["tokens"], first_total or done["tokens"]), unit="tok",
               unit_scale=True, file=sys.stderr, dynamic_ncols=True, smoothing=0.1, desc=desc,
               disable=None if progress and parallel.is_main_process() else True)
    pending = collections.deque()  # (marker of a dispatched step, its tokens)
    first_step = None

    def finish(keep: int) -> None:
        while len(pending) > keep:
            marker, n = pending.popleft()
            marker.block_until_ready()
            if bar.total is None and known_total() is not None:
                bar.total = known_total()
                bar.n = min(bar.n, bar.total)
            bar.update(n if bar.total is None else min(n, max(bar.total - bar.n, 0)))

    with _sigterm_flag() if save_checkpoint is not None else contextlib.nullcontext([]) as stop:
        try:
            for batch in batches:
                if first_step is None:  # the first collective: every process brings it together
                    parallel.all_processes_here("first step")
                t = time.time()
                pending.append((runner.step(batch.tokens_BxT, batch.segment_ids_BxT, batch.positions_BxT,
                                            batch.group, batch.sequences_BxT), batch.n_tokens))
                if first_step is None:
                    finish(0)
                    first_step = time.time() - t
                    if after_first_step is not None:
                        after_first_step()
                done = {"tokens": done["tokens"] + batch.n_tokens, "sequences": done["sequences"] + batch.n_sequences,
                        "batches": done["batches"] + 1}
                finish(IN_FLIGHT)
                if save_checkpoint is not None and _preempted_together(done["batches"]):
                    stop.append(True)
                if stop or checkpoint_every and done["tokens"] - last_ckpt >= checkpoint_every:
                    save_checkpoint(done, batch.cursor)
                    last_ckpt = done["tokens"]
                    faults.reached("checkpoint_saved")
                if stop:
                    raise Preempted(f"stopped by SIGTERM after {done['tokens']:,} tokens; the checkpoint is written: "
                                    "rerun with --resume to continue")
            finish(0)
        finally:
            bar.close()
            if hasattr(batches, "close"):
                batches.close()
    return done, first_step or 0.0


def _refuse_older(old: dict, settings: dict) -> None:
    """UserError where the checkpoint was written before the accumulators' own streamed measures became step
    measures (issue 46: Step.layer_part, on by default; their sums then lay elsewhere): it cannot resume."""
    from isojax.stats.measures import steps
    moved = [name for name in settings.get("step_measures", {})
             if steps()[name].layer_part and name not in old.get("step_measures", {})]
    if moved:
        raise UserError(f"the checkpoint was written by an older isojax, before {', '.join(moved)} became step "
                        "measures (its accumulators hold them in another layout); start over with --overwrite")


def resume(runner, ckpt_dir: Path, settings: dict, done: dict):
    """(cursor, done) after the newest checkpoint that reads back whole, whose accumulators are
    loaded into runner. A damaged step (a file missing, truncated or failing its checksum) is
    named, removed and the one before it taken; every process takes the same step."""
    from isojax.device import checkpoints as checkpointing
    steps = checkpointing.complete_steps(ckpt_dir)
    if not steps:
        log(f"--resume: no complete checkpoint under {ckpt_dir}: starting from the beginning")
        return None, done
    for step in steps:
        try:
            meta, files = checkpointing.read_meta(ckpt_dir, step)
            if meta["settings"] != settings:
                _refuse_older(meta["settings"], settings)
                diff = [k for k in {**meta["settings"], **settings} if meta["settings"].get(k) != settings.get(k)]
                on = lambda s: ", ".join(f"{k}={v}" for k, v in s.get("step_measures", {}).items()) or "none"
                raise UserError(f"the checkpoint was made with other settings ({', '.join(diff)}"
                                + (f": step measures {on(meta['settings'])} there, {on(settings)} here"
                                   if "step_measures" in diff else "")
                                + "); rerun with the same arguments (and device and process counts) or start over "
                                "with --overwrite")
            # written before the sample or the per-token sums became step measures (issue 46): their leaves read
            # under their older names
            older = {k: any(name.startswith(f"{leaf}.") for name in files)
                     for k, leaf in (("sample", "sample_keys_Kx2"), ("tokens", "tok_count_SxV"))}
            acc = checkpointing.load(ckpt_dir, step, runner.abstract,
                                     functools.partial(runner.older_leaf, **older) if any(older.values())
                                     else lambda leaf: leaf)
            damage = None
        except checkpointing.Damaged as e:
            acc, damage = None, str(e)
        if not parallel.all_processes_agree(damage is None):
            older = [s for s in steps if s < step]
            log(f"checkpoint step {step} under {ckpt_dir} is damaged ({damage or 'on another process'}); "
                + (f"falling back to step {older[0]}" if older else "no earlier checkpoint"))
            checkpointing.discard(ckpt_dir, step)
            continue
        runner.load(acc)
        log(f"resuming after {meta['done']['tokens']:,} tokens (checkpoint step {step})")
        return meta["cursor"], meta["done"]
    raise UserError(f"no checkpoint under {ckpt_dir} reads back whole; start over with --overwrite")
