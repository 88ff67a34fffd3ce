"""Each host reads only its share: the corpus of a multi-process run, split over the processes.

Process p of P reads, tokenizes and caches only `Corpus.share(p, P)`: a contiguous run of the input
files, balanced by bytes (a plain .jsonl larger than a P-th of them split into byte ranges, each
the lines that start in it), in its own token cache (its key hashes its
files, so the hosts' caches never collide, even on a shared filesystem). In process order the
shares are the inputs in order, and the token cache holds each unit (windowed per unit) as a
whole-corpus cache does, so the whole corpus's sequences are the shares' sequences one after the
other: sequence i of process p is sequence `base_p + i` of a one-process run, base_p being the
sequences of the processes before it. The batches carry that global index (Batch.sequences_BxT),
so the sample (stats/sample.py keys tokens by sequence index and position) is a one-process run's.

Packing: each process packs its own sequences into its own rows (device/mesh.py local_rows), by
the rules of packing.py (one source per batch, first fit), per source. The processes trade, once
tokenized, their source names, sequence counts and token counts, and once the rows are known, the
tokens and sequences of each of their batches (mesh.exchange: no device involved). The global
source ids are the names in order of first appearance over the processes in order: a one-process
run's. The steps are the same on every process: source by source (global id order), the k-th step
of a source feeding each process's k-th batch of that source, or padding where it has no more;
each step counts the tokens and sequences of all processes' rows. So every token is measured once,
in its own sequence (attention never crosses segments), in its source's group: every statistic is
a sum over the same tokens as one process's, and the metrics equal one process's up to the order
of float additions; only the batches (and padding) differ. A cursor is the steps done so far, the
same on every process, so checkpoints and --resume work as they do with one process.

Not shared: a token budget (one process reads a prefix of each source and stops; split over hosts
each would have to read its whole share to know where the budget ends, so every process reads the
budget's prefix itself, as before), hub datasets (a stream, not files) and the embedded default
corpus. Those runs tokenize the whole corpus on every process (Corpus.shareable). A process whose
share is empty, or holds no text, feeds padding only. The share is tokenized in a background
thread, beside the weights' load, before the first batch (no streaming into the devices).
"""

from __future__ import annotations

import collections
import json
import os
import threading

import numpy as np

from isojax.data.packing import _CURSOR_VERSION, _PLAN_CHUNK, Batch, BatchIterator, PackStats, _materialize, _OpenBatch
from isojax.data.readers import Corpus
from isojax.data.tokens import NoText, TokenCache, _key, backend_tokenizer, tokenize_corpus
from isojax.errors import UserError
from isojax.log import log

_CALLS: collections.Counter = collections.Counter()  # runs of each process: all make the same, so the names agree


class HostShare:
    """The corpus of a multi-process run as one process reads it: its own share tokenized (`local`,
    None when it holds no text), and the whole corpus's names and counts once every process has
    tokenized its share. pack_batches and plan_stats take it in place of a TokenCache."""

    def __init__(self, corpus: Corpus, tokenizer, *, cache_dir, max_len: int, progress: bool = False,
                 index: int | None = None, count: int | None = None, exchange=None, bos: int | None = None):
        import jax

        from isojax.device import mesh as parallel
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count
        self.exchange = exchange or parallel.exchange
        self.corpus, self.whole, self.max_len = corpus.share(self.index, self.count), corpus, max_len
        tok = backend_tokenizer(tokenizer)
        self.bos = bos
        self.fingerprint = _key(corpus, tok, bos)[0]  # the whole corpus's: a one-process run's
        _CALLS[self.index, self.count] += 1
        self._name = f"shares-{_CALLS[self.index, self.count]}-{self.fingerprint}"
        self._error: BaseException | None = None
        self._schedules: dict = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._open, args=(tok, cache_dir, progress), daemon=True,
                                        name="isojax-share")
        self._thread.start()

    def _open(self, tok, cache_dir, progress: bool) -> None:
        try:
            local = None
            try:
                if self.corpus.inputs:
                    local = tokenize_corpus(self.corpus, tok, cache_dir=cache_dir, max_len=self.max_len,
                                            progress=progress and self.index == 0, bos=self.bos)
            except NoText:
                pass
            except BaseException as e:  # the others stop at once too, naming this process and why
                self.exchange(self._name, json.dumps({"error": str(e) or type(e).__name__}).encode())
                raise
            self.local = local
            mine = {"pieces": len(self.corpus.inputs), "bytes": _bytes(self.corpus), "names": [], "sequences": 0,
                    "tokens": 0, "counts": {}, "bad_records": 0, "from_cache": True}
            if local is not None:
                mine.update(names=local.source_names, sequences=local.n_sequences, tokens=local.n_tokens,
                            counts=local.source_counts(), bad_records=local.meta.get("bad_records", 0),
                            from_cache=local.from_cache)
            log(f"process {self.index} of {self.count}: its share, {mine['bytes']:,} of {_bytes(self.whole):,} bytes "
                f"({mine['pieces']} files or parts), {mine['tokens']:,} tokens in {mine['sequences']:,} "
                f"{self.corpus.unit}s"
                + ("" if local is None else " (from its token cache)" if local.from_cache else " tokenized"))
            self.hosts = [json.loads(v) for v in self.exchange(self._name, json.dumps(mine).encode())]
            for p, host in enumerate(self.hosts):
                if "error" in host:
                    raise UserError(f"process {p}: {host['error']}")
            self.source_names = list(dict.fromkeys(n for host in self.hosts for n in host["names"]))
            self.groups = [self.source_names.index(n) for n in mine["names"]]  # local source id -> global
            self.base = sum(host["sequences"] for host in self.hosts[:self.index])
            self.n_tokens = sum(host["tokens"] for host in self.hosts)
            self.n_sequences = sum(host["sequences"] for host in self.hosts)
            self.from_cache = all(host["from_cache"] for host in self.hosts)
            self.meta = {"bad_records": sum(host["bad_records"] for host in self.hosts)}
            if self.n_tokens == 0:
                what = f" with sources {sorted(self.whole.sources)}" if self.whole.sources is not None else ""
                raise NoText(f"{self.whole.describe()}: corpus has no text{what}")
        except BaseException as e:  # noqa: BLE001 -- raised where the share is read
            self._error = e

    def wait(self) -> HostShare:
        """Self, once every process has tokenized its share; the error of this one's, or another's."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self

    def __getattr__(self, name):  # the whole corpus's names and counts: known once all shares are
        if name in ("source_names", "n_tokens", "n_sequences", "from_cache", "meta", "hosts", "local", "groups",
                    "base"):
            return getattr(self.wait(), name)
        raise AttributeError(name)

    def source_counts(self) -> dict[str, dict[str, int]]:
        out = {name: {"tokens": 0, "sequences": 0} for name in self.source_names}
        for host in self.hosts:
            for name, counts in host["counts"].items():
                for k in out[name]:
                    out[name][k] += counts[k]
        return out

    def _steps(self, rows: int, local_rows: int, row_len: int) -> list[tuple[int, int, int]]:
        """(global source id, tokens, sequences) of every step, the same on every process."""
        with self._lock:
            if (rows, local_rows, row_len) not in self._schedules:
                mine, lengths = {}, np.diff(self.local.offsets) if self.local is not None else None
                for lg, g in enumerate(self.groups):
                    sizes = [(int(lengths[np.concatenate(r)].sum()), sum(map(len, r)))
                             for r in _group_plan(self.local, lg, local_rows, row_len)]
                    mine[g] = [[t for t, _ in sizes], [s for _, s in sizes]]
                name = f"{self._name}-plan-{rows}-{local_rows}-{row_len}"
                hosts = [{int(g): v for g, v in json.loads(h).items()}
                         for h in self.exchange(name, json.dumps(mine).encode())]
                steps = []
                for g in range(len(self.source_names)):
                    per = [h.get(g, [[], []]) for h in hosts]
                    for k in range(max(len(t) for t, _ in per)):
                        steps.append((g, sum(t[k] for t, _ in per if k < len(t)),
                                      sum(s[k] for _, s in per if k < len(s))))
                self._schedules[rows, local_rows, row_len] = steps
            return self._schedules[rows, local_rows, row_len]

    def _cursor(self, rows: int, row_len: int, next_batch) -> dict:
        return {"version": _CURSOR_VERSION, "fingerprint": self.fingerprint, "max_len": self.max_len, "rows": rows,
                "row_len": row_len, "plan_chunk": _PLAN_CHUNK, "processes": self.count, "next_batch": next_batch}

    def pack(self, *, rows: int, row_len: int, row_subset, start_cursor=None, prefetch: int = 4) -> BatchIterator:
        """packing.pack_batches over the shares: this process's rows (row_subset, its local_rows) of
        every step; a Batch's tokens and sequences are the step's, over every process."""
        skip = 0
        if start_cursor is not None:
            asked = start_cursor.get("next_batch") if isinstance(start_cursor, dict) else None
            want = self._cursor(rows, row_len, asked)
            if start_cursor != want or not isinstance(want["next_batch"], int):
                raise UserError(f"data cursor {start_cursor} does not match this corpus, its shares over "
                                f"{self.count} processes and packing (rows {rows}, row_len {row_len})")
            skip = want["next_batch"]
        stop = threading.Event()
        return BatchIterator(self._batches(rows, len(row_subset), row_len, skip, stop), prefetch, stop)

    def _batches(self, rows: int, local_rows: int, row_len: int, skip: int, stop: threading.Event):
        steps = self._steps(rows, local_rows, row_len)
        plans = {g: _group_plan(self.local, lg, local_rows, row_len) for lg, g in enumerate(self.groups)}
        for n, (g, n_tok, n_seq) in enumerate(steps):
            if stop.is_set():
                return
            row_list = next(plans[g], None) if g in plans else None  # this process's next batch of g, if any
            if n < skip:
                continue
            if row_list is None:
                tokens, segments, positions, sequences = (np.zeros((local_rows, row_len), np.int32) for _ in range(4))
            else:
                tokens, segments, positions, sequences, _, _ = _materialize(self.local, row_list, local_rows, row_len)
                sequences = np.where(segments > 0, sequences + self.base, 0).astype(np.int32)  # global indices
            yield Batch(tokens, segments, positions, sequences, g, n_tok, n_seq, self._cursor(rows, row_len, n + 1))

    def plan_stats(self, *, rows: int, row_len: int, local_rows: int | None = None) -> PackStats:
        """packing.plan_stats of the steps; local_rows: this process's rows (None: its devices' part)."""
        if local_rows is None:
            import jax
            local_rows = rows * jax.local_device_count() // jax.device_count()
        steps = self._steps(rows, local_rows, row_len)
        return PackStats(len(steps), self.n_tokens, len(steps) * rows * row_len)


def _bytes(corpus: Corpus) -> int:
    return sum(inp.byte_range[1] - inp.byte_range[0] if inp.byte_range else os.path.getsize(inp.path)
               for inp in corpus.inputs)


def _group_plan(cache: TokenCache, group: int, rows: int, row_len: int):
    """The row lists of the batches of one source of the cache, in order: packing._plan's, its
    other sources left out (each source fills its own batches)."""
    batch = None
    for lo in range(0, cache.n_sequences, _PLAN_CHUNK):
        hi = min(lo + _PLAN_CHUNK, cache.n_sequences)
        ids = lo + np.flatnonzero(np.asarray(cache.source_ids[lo:hi]) == group)
        for i, length in zip(ids.tolist(), (cache.offsets[ids + 1] - cache.offsets[ids]).tolist()):
            if batch is None:
                batch = _OpenBatch(rows, row_len)
            if not batch.add(i, length):
                yield batch.row_list()
                batch = _OpenBatch(rows, row_len)
                batch.add(i, length)
    if batch is not None:
        yield batch.row_list()
