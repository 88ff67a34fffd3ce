"""Packing token sequences into fixed [B, T] rows, one source per batch.

Row layout (B = rows, T = row_len):
  tokens_BxT       token ids; 0 in padding
  segment_ids_BxT  0 = padding, 1, 2, ... = the sequences of a row, left to right
  positions_BxT    0, 1, ... restarting in every segment; 0 in padding

Order is a pure function of (cache, B, T): sequences are read in corpus order, in chunks;
each source fills its own open batch, next-fit (a row is closed when the next sequence
does not fit); a batch is emitted when its B rows are closed; at the end each source's
last, partly filled batch follows, in source order. A cursor is therefore just "batches
done so far": resuming replans (cheap, offsets only) and skips them, nothing lost or
repeated.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Iterator

import numpy as np

from isojax.errors import UserError
from isojax.data.tokens import TokenCache

_PLAN_CHUNK = 1 << 20  # sequences per planning step (part of the order: do not change lightly)
_CURSOR_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens_BxT: np.ndarray  # int32
    segment_ids_BxT: np.ndarray  # int32
    positions_BxT: np.ndarray  # int32
    group: int  # source id: index into TokenCache.source_names
    n_tokens: int  # real (non-padding) tokens
    n_sequences: int
    cursor: dict  # JSON-serializable; pack_batches(start_cursor=cursor) yields the batches after this one


@dataclasses.dataclass
class PackStats:
    batches: int = 0
    tokens: int = 0
    slots: int = 0  # batches * B * T

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def _rows(lengths: np.ndarray, seqs: np.ndarray, row_len: int, final: bool) -> tuple[list[np.ndarray], int]:
    """Next-fit rows over `seqs`; an open last row is kept back unless `final`. -> rows, consumed."""
    ends = np.concatenate([[0], np.cumsum(lengths[seqs])])
    rows, start = [], 0
    while start < len(seqs):
        stop = int(np.searchsorted(ends, ends[start] + row_len, side="right")) - 1
        if stop == len(seqs) and not final:
            break
        rows.append(seqs[start:stop])
        start = stop
    return rows, start


def _plan(cache: TokenCache, rows: int, row_len: int) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(group, [B or fewer arrays of sequence ids, one per row]) for every batch, in order."""
    lengths = np.diff(cache.offsets)
    n_groups = len(cache.source_names)
    pending = [np.empty(0, np.int64) for _ in range(n_groups)]
    n = cache.n_sequences
    for lo in range(0, n, _PLAN_CHUNK):
        sid = np.asarray(cache.source_ids[lo:lo + _PLAN_CHUNK])
        order = np.argsort(sid, kind="stable") + lo
        bounds = np.concatenate([[0], np.cumsum(np.bincount(sid, minlength=n_groups))])
        present, first = np.unique(sid, return_index=True)
        for g in present[np.argsort(first)]:
            seqs = np.concatenate([pending[g], order[bounds[g]:bounds[g + 1]]])
            row_list, used = _rows(lengths, seqs, row_len, final=False)
            n_full = len(row_list) // rows * rows
            for i in range(0, n_full, rows):
                yield int(g), row_list[i:i + rows]
            # closed rows short of a full batch are planned again next time: next-fit from
            # the same start gives the same rows, so the plan does not depend on chunking
            pending[g] = seqs[used - sum(len(r) for r in row_list[n_full:]):]
    for g in range(n_groups):
        row_list, _ = _rows(lengths, pending[g], row_len, final=True)
        for i in range(0, len(row_list), rows):
            yield g, row_list[i:i + rows]


def _materialize(cache: TokenCache, row_list: list[np.ndarray], rows: int, row_len: int):
    counts = np.array([len(r) for r in row_list])
    seqs = np.concatenate(row_list)
    starts = cache.offsets[seqs]
    lengths = cache.offsets[seqs + 1] - starts
    row_of = np.repeat(np.arange(len(row_list)), counts)
    first_in_row = np.cumsum(counts) - counts
    segment = np.arange(len(seqs)) - np.repeat(first_in_row, counts) + 1
    seq_end = np.cumsum(lengths)
    seq_begin = seq_end - lengths
    col0 = seq_begin - np.repeat(seq_begin[first_in_row], counts)  # column where each sequence starts
    owner = np.repeat(np.arange(len(seqs)), lengths)  # sequence of each real token
    within = np.arange(int(seq_end[-1])) - seq_begin[owner]
    dst = (row_of * row_len + col0)[owner] + within
    tokens = np.zeros(rows * row_len, np.int32)
    segments = np.zeros(rows * row_len, np.int32)
    positions = np.zeros(rows * row_len, np.int32)
    tokens[dst] = cache.tokens[starts[owner] + within]
    segments[dst] = segment[owner]
    positions[dst] = within
    shape = (rows, row_len)
    return tokens.reshape(shape), segments.reshape(shape), positions.reshape(shape), len(owner), len(seqs)


def _cursor(cache: TokenCache, rows: int, row_len: int, next_batch: int) -> dict:
    return {"version": _CURSOR_VERSION, "fingerprint": cache.fingerprint, "max_len": cache.max_len,
            "rows": rows, "row_len": row_len, "plan_chunk": _PLAN_CHUNK, "next_batch": next_batch}


def _batches(cache: TokenCache, rows: int, row_len: int, skip: int) -> Iterator[Batch]:
    for k, (group, row_list) in enumerate(_plan(cache, rows, row_len)):
        if k < skip:
            continue
        tokens, segments, positions, n_tok, n_seq = _materialize(cache, row_list, rows, row_len)
        yield Batch(tokens, segments, positions, group, n_tok, n_seq, _cursor(cache, rows, row_len, k + 1))


def _check(cache: TokenCache, rows: int, row_len: int, start_cursor) -> int:
    if rows < 1 or row_len < 1:
        raise ValueError(f"rows and row_len must be positive, got {rows}, {row_len}")
    longest = int(np.diff(cache.offsets).max()) if cache.n_sequences else 0
    if longest > row_len:
        raise ValueError(f"row_len={row_len} is shorter than the longest sequence ({longest}); "
                         f"tokenize with max_len <= row_len")
    if start_cursor is None:
        return 0
    want = _cursor(cache, rows, row_len, start_cursor.get("next_batch") if isinstance(start_cursor, dict) else None)
    if not isinstance(start_cursor, dict) or start_cursor != want or not isinstance(want["next_batch"], int):
        raise UserError(f"data cursor {start_cursor} does not match this corpus and packing "
                        f"(fingerprint {cache.fingerprint}, max_len {cache.max_len}, rows {rows}, row_len {row_len})")
    return want["next_batch"]


def _produce(source: Iterator[Batch], out: queue.Queue, stop: threading.Event) -> None:
    """Producer thread body; holds no reference to the BatchIterator, so dropping the
    iterator stops the thread."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    try:
        for batch in source:
            if not put(batch):
                return
        put(_END)
    except BaseException as e:  # handed to the consumer, raised there
        put(e)


_END = object()


class BatchIterator:
    """Iterator over Batch; a daemon thread keeps up to `prefetch` batches ready.
    `stats` counts the batches handed out so far (padding_fraction for reports)."""

    def __init__(self, source: Iterator[Batch], prefetch: int):
        self.stats = PackStats()
        self._source = source
        self._queue = None
        self._done = False
        if prefetch > 0:
            self._queue = queue.Queue(maxsize=prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop),
                                            name="isojax-pack", daemon=True)
            self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        if self._queue is None:
            batch = next(self._source)
        else:
            batch = self._queue.get()
            if batch is _END:
                self._done = True
                raise StopIteration
            if isinstance(batch, BaseException):
                self._done = True
                raise batch
        self.stats.batches += 1
        self.stats.tokens += batch.n_tokens
        self.stats.slots += batch.tokens_BxT.size
        return batch

    def close(self) -> None:
        """Stop the producer thread (also done when the iterator is garbage collected)."""
        self._done = True
        if self._queue is not None:
            self._stop.set()
            self._thread.join()

    def __del__(self):
        if getattr(self, "_queue", None) is not None:
            self._stop.set()


def pack_batches(cache: TokenCache, *, rows: int, row_len: int, start_cursor=None, prefetch: int = 4) -> BatchIterator:
    """Packed [rows, row_len] batches of `cache`, each of a single source (`Batch.group`).

    `start_cursor`: a `Batch.cursor`; yields exactly the batches after that one.
    `prefetch`: batches a background thread keeps ready (0 = produce in the caller's thread).
    """
    skip = _check(cache, rows, row_len, start_cursor)
    return BatchIterator(_batches(cache, rows, row_len, skip), prefetch)


def plan_stats(cache: TokenCache, *, rows: int, row_len: int) -> PackStats:
    """Batches, tokens and padding fraction of a whole pass, from the plan alone (no tokens read)."""
    _check(cache, rows, row_len, None)
    lengths = np.diff(cache.offsets)
    stats = PackStats()
    for _, row_list in _plan(cache, rows, row_len):
        stats.batches += 1
        stats.tokens += int(sum(lengths[r].sum() for r in row_list))
    stats.slots = stats.batches * rows * row_len
    return stats
