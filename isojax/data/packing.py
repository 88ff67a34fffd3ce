"""Packing token sequences into fixed [B, T] rows, one source per batch.

Row layout (B = rows, T = row_len):
  tokens_BxT       token ids; 0 in padding
  segment_ids_BxT  0 = padding, 1, 2, ... = the sequences of a row, left to right
  positions_BxT    0, 1, ... restarting in every segment; 0 in padding
  sequences_BxT    the index in the token cache of each token's sequence (its identity, with
                   its position: stats/sample.py); 0 in padding

Order is a pure function of (cache, B, T): sequences are read in corpus order; each source
fills its own open batch, first-fit over its B rows (a sequence goes into the first row with
room for it); the first sequence that fits in no row closes the batch, which is emitted, and
opens the next one. So each batch holds a contiguous run of its source's sequences, and the
rows are nearly full: 0.15% padding on the benchmark's sentences at 128 x 512, where next-fit
(close a row when the next sequence does not fit it) left 6.9%. At the end each source's last,
partly filled batch follows, in source order. A cursor is therefore just "batches done so
far": resuming replans (offsets only, ~0.6M sequences/s) and skips them, nothing lost or
repeated.

The plan is a fold over the sequences in order, so it can follow a token cache that is still
being written (tokens.TokenStream): batches close as the sequences arrive and are exactly those
of the finished cache. Where each process of a multi-process run reads only its share of the
corpus, shares.py packs each process's rows of a step by these rules from its own sequences.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Iterator

import numpy as np

from isojax.errors import UserError
from isojax.data.tokens import TokenCache, TokenStream

_PLAN_CHUNK = 1 << 20  # sequences per planning step (part of the order: do not change lightly)
_CURSOR_VERSION = 2  # 1: next-fit rows
_POLL_S = 0.1  # how often a packer waiting on a growing cache checks whether it was closed


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens_BxT: np.ndarray  # int32
    segment_ids_BxT: np.ndarray  # int32
    positions_BxT: np.ndarray  # int32
    sequences_BxT: np.ndarray  # int32
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


class _OpenBatch:
    """The B rows of one source's open batch, filled first-fit."""

    def __init__(self, rows: int, row_len: int):
        self.room = np.full(rows, row_len, np.int64)
        self.rows: list[list[int]] = [[] for _ in range(rows)]

    def add(self, seq: int, length: int) -> bool:
        """Put sequence `seq` into the first row with room; False when no row has room."""
        r = int(np.argmax(self.room >= length))
        if self.room[r] < length:
            return False
        self.room[r] -= length
        self.rows[r].append(seq)
        return True

    def row_list(self) -> list[np.ndarray]:
        # rows fill in order (a row is opened only when the ones before it have no room), so
        # the used rows are a prefix
        return [np.asarray(r, np.int64) for r in self.rows if r]


def _runs(source: TokenCache | TokenStream, stop: threading.Event | None = None):
    """(cache, lo, hi): consecutive runs of sequences [lo, hi), each as soon as the cache (the
    latest one a growing source gave) holds it; ends early when stop is set."""
    lo, cache, finished = 0, source, isinstance(source, TokenCache)
    while True:
        written = None
        while not finished and written is None:
            if stop is not None and stop.is_set():
                return
            written = source.wait(lo, timeout=_POLL_S)
        if written is not None:
            cache, finished = written
        for a in range(lo, cache.n_sequences, _PLAN_CHUNK):
            yield cache, a, min(a + _PLAN_CHUNK, cache.n_sequences)
        lo = cache.n_sequences
        if finished:
            return


def _plan(source: TokenCache | TokenStream, rows: int, row_len: int, stop=None):
    """(cache, group, [B or fewer arrays of sequence ids, one per row]) for every batch, in order;
    cache holds the batch's sequences."""
    open_batches: dict[int, _OpenBatch] = {}
    for cache, lo, hi in _runs(source, stop):
        lengths = np.diff(cache.offsets[lo:hi + 1]).tolist()
        groups = np.asarray(cache.source_ids[lo:hi]).tolist()
        for i, (g, length) in enumerate(zip(groups, lengths), start=lo):
            batch = open_batches.get(g)
            if batch is None:
                batch = open_batches[g] = _OpenBatch(rows, row_len)
            if not batch.add(i, length):
                yield cache, g, batch.row_list()
                batch = open_batches[g] = _OpenBatch(rows, row_len)
                batch.add(i, length)
    if stop is not None and stop.is_set():
        return
    for g in sorted(open_batches):
        yield cache, g, open_batches[g].row_list()


def _materialize(cache: TokenCache, row_list: list[np.ndarray], rows: int, row_len: int, subset=None):
    """[rows, row_len] arrays of the planned rows, or only of the global rows in `subset` (a
    process's share); the token and sequence counts are always the whole batch's."""
    every = np.concatenate(row_list)
    n_tok, n_seq = int((cache.offsets[every + 1] - cache.offsets[every]).sum()), len(every)
    if subset is not None:
        row_list = [row_list[r] if r < len(row_list) else every[:0] for r in subset]
        rows = len(subset)
    shape = (rows, row_len)
    tokens, segments, positions, sequences = (np.zeros(rows * row_len, np.int32) for _ in range(4))
    counts = np.array([len(r) for r in row_list], np.int64)
    if counts.sum():
        seqs = np.concatenate(row_list)
        starts = cache.offsets[seqs]
        lengths = cache.offsets[seqs + 1] - starts
        row_of = np.repeat(np.arange(len(row_list)), counts)
        first_in_row = np.cumsum(counts) - counts
        segment = np.arange(len(seqs)) - np.repeat(first_in_row, counts) + 1
        seq_end = np.cumsum(lengths)
        seq_begin = seq_end - lengths
        used = counts > 0
        col0 = seq_begin - np.repeat(seq_begin[first_in_row[used]], counts[used])  # column of each sequence
        owner = np.repeat(np.arange(len(seqs)), lengths)  # sequence of each real token
        within = np.arange(int(seq_end[-1])) - seq_begin[owner]
        dst = (row_of * row_len + col0)[owner] + within
        tokens[dst] = cache.tokens[starts[owner] + within]
        segments[dst] = segment[owner]
        positions[dst] = within
        sequences[dst] = seqs[owner]
    return (tokens.reshape(shape), segments.reshape(shape), positions.reshape(shape), sequences.reshape(shape),
            n_tok, n_seq)


def _cursor(cache: TokenCache, rows: int, row_len: int, next_batch: int) -> dict:
    return {"version": _CURSOR_VERSION, "fingerprint": cache.fingerprint, "max_len": cache.max_len,
            "rows": rows, "row_len": row_len, "plan_chunk": _PLAN_CHUNK, "next_batch": next_batch}


def _batches(source, rows: int, row_len: int, skip: int, subset, stop) -> Iterator[Batch]:
    for k, (cache, group, row_list) in enumerate(_plan(source, rows, row_len, stop)):
        if k < skip:
            continue
        tokens, segments, positions, sequences, n_tok, n_seq = _materialize(cache, row_list, rows, row_len, subset)
        yield Batch(tokens, segments, positions, sequences, group, n_tok, n_seq, _cursor(cache, rows, row_len, k + 1))


def _check(cache: TokenCache | TokenStream, rows: int, row_len: int, start_cursor) -> int:
    if rows < 1 or row_len < 1:
        raise ValueError(f"rows and row_len must be positive, got {rows}, {row_len}")
    if isinstance(cache, TokenStream):  # no sequence is longer than its windows
        longest = cache.max_len
    else:
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
    `stats` counts the batches handed out so far (padding_fraction for reports).
    `stop`: set by close(); the source ends when it sees it."""

    def __init__(self, source: Iterator[Batch], prefetch: int, stop: threading.Event):
        self.stats = PackStats()
        self._source = source
        self._queue = None
        self._done = False
        self._stop = stop
        if prefetch > 0:
            self._queue = queue.Queue(maxsize=prefetch)
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
        self._stop.set()
        if self._queue is not None:
            self._thread.join()

    def __del__(self):
        if getattr(self, "_queue", None) is not None:
            self._stop.set()


def pack_batches(cache: TokenCache | TokenStream, *, rows: int, row_len: int, start_cursor=None,
                 prefetch: int = 4, row_subset=None) -> BatchIterator:
    """Packed [rows, row_len] batches of `cache`, each of a single source (`Batch.group`).

    `cache`: a TokenCache, or a TokenStream still being written: the batches follow it as it
    grows (waiting for more) and are those of the finished cache; its builder's error is raised;
    or a shares.HostShare (a multi-process run's share of the corpus: its own schedule of steps).
    `start_cursor`: a `Batch.cursor`; yields exactly the batches after that one.
    `prefetch`: batches a background thread keeps ready (0 = produce in the caller's thread).
    `row_subset`: global row indices to materialize (a process's share of every batch; the
    batches' token and sequence counts stay those of the whole batch); None: all rows.
    """
    if not isinstance(cache, (TokenCache, TokenStream)):  # a process's share of the corpus (data/shares.py)
        return cache.pack(rows=rows, row_len=row_len, row_subset=row_subset, start_cursor=start_cursor,
                          prefetch=prefetch)
    skip = _check(cache, rows, row_len, start_cursor)
    stop = threading.Event()
    return BatchIterator(_batches(cache, rows, row_len, skip, row_subset, stop), prefetch, stop)


def plan_stats(cache: TokenCache, *, rows: int, row_len: int) -> PackStats:
    """Batches, tokens and padding fraction of a whole pass, from the plan alone (no tokens read)."""
    if not isinstance(cache, TokenCache):  # a process's share of the corpus (data/shares.py)
        return cache.plan_stats(rows=rows, row_len=row_len)
    _check(cache, rows, row_len, None)
    lengths = np.diff(cache.offsets)
    stats = PackStats()
    for _, _, row_list in _plan(cache, rows, row_len):
        stats.batches += 1
        stats.tokens += int(sum(lengths[r].sum() for r in row_list))
    stats.slots = stats.batches * rows * row_len
    return stats
