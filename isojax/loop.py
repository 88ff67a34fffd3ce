"""The host side of the device loop: feed batches, count what the devices have finished,
checkpoint every N tokens, resume."""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from isojax import parallel
from isojax.errors import UserError

IN_FLIGHT = 2  # steps dispatched ahead of the last finished one: enough to keep the devices busy


def log(msg: str) -> None:
    print(f"isojax: {msg}", file=sys.stderr, flush=True)


def consume(runner, batches, done: dict, total: int, *, max_tokens=None, checkpoint_every=None,
            save_checkpoint=None, progress: bool = True, desc: str = "tokens",
            after_first_step=None) -> tuple[dict, float]:
    """Feed batches to the devices until they run out or max_tokens is reached (whole batches).
    The progress bar counts tokens the devices have finished, not dispatched, up to `total`: an
    int, or a function giving it once known and None before (the corpus still being tokenized:
    the bar shows count and rate). after_first_step() is called once the first step (its compile)
    is done. Returns (done, seconds of the first step: compile and first batch)."""
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

    try:
        for batch in batches:
            if max_tokens and done["tokens"] >= max_tokens:
                break
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
            if checkpoint_every and done["tokens"] - last_ckpt >= checkpoint_every:
                save_checkpoint(done, batch.cursor)
                last_ckpt = done["tokens"]
        finish(0)
    finally:
        bar.close()
        if hasattr(batches, "close"):
            batches.close()
    return done, first_step or 0.0


def resume(runner, ckpt_dir: Path, settings: dict, done: dict):
    """(cursor, done) after the newest checkpoint, whose accumulators are loaded into runner."""
    from isojax import checkpointing
    found = checkpointing.latest(ckpt_dir)
    if found is None:
        log(f"no complete checkpoint under {ckpt_dir}: starting from the beginning")
        return None, done
    step, meta = found
    if meta["settings"] != settings:
        diff = [k for k in settings if meta["settings"].get(k) != settings[k]]
        raise UserError(f"the checkpoint was made with other settings ({', '.join(diff)}); rerun with the same "
                        "arguments (and device and process counts) or start over with --overwrite")
    runner.load(checkpointing.load(ckpt_dir, step, runner.abstract))
    log(f"resuming after {meta['done']['tokens']:,} tokens")
    return meta["cursor"], meta["done"]
