"""Text -> token ids, cached on disk.
Length: the token cache's format, its integrity checks and the worker pool that fills it change together.

Cache layout: `CACHE_DIR/<key>/` with raw little-endian arrays `tokens.bin` (int32),
`offsets.bin` (int64, n_seq+1) and `source_ids.bin` (int16, n_seq), and `meta.json`.
`key` hashes the corpus fingerprint (input paths + sizes + mtimes, unit, sources,
splitter version, token budget), the tokenizer (sha256 of its JSON, truncation/padding
removed) and the BOS id put before each unit, if any (a cache built without BOS is never read as
one with it, nor the reverse; meta.json's "bos" says which), so every model sharing a tokenizer reuses one cache. The cache holds whole units; windows of
`max_len` are cut when it is opened, so it is shared across context lengths too.

A cache is built in a temporary sibling folder, its files fsynced, and renamed into place
only when complete. A crash leaves a `.tmp-*` folder that is never read; the next build in the
same cache folder removes it once its writer (host and pid in its `writer` file) is no longer
running on this host, or when nothing in it changed for a day. Worker processes end within a
second of the process that started them (they watch their parent), so a killed run leaves none.

Integrity: meta.json, written last, holds the crc32 of each file; opening a cache checks
the sizes, the checksums, token ids against the tokenizer's vocabulary, source ids against
`source_names`, and offsets (from 0, never decreasing, ending at the token count). A cache that
fails is damaged: it is moved aside, a warning names it and what failed, and it is rebuilt
(as if absent: the inputs it came from are at hand, its key says they are unchanged). The
check reads every byte of tokens.bin on each opening, which is worth it: zlib.crc32 ran at
2.0-2.3 GB/s on an idle Xeon core (400 MiB in 0.19 s) and 0.6-1.0 GB/s on a shared 2-core VM,
where the whole check of a 400 MB tokens.bin (read, crc32, max) took 0.9-1.1 s from the page
cache: about 1 s per 100M tokens cached, small against measuring them. A cache just built
is not re-read.

Memory is bounded for any record: units.py gives syntok a long paragraph a window at a time,
and a unit longer than _PIECE_CHARS is tokenized in pieces cut before a single whitespace
character between two others; byte-level BPE (GPT-NeoX's) splits words there too, so the ids
are the whole unit's ids.

A token budget (Corpus.budget: max_tokens split equally over the sources, or
max_tokens_per_source) is applied while building: each source keeps its first `share` tokens, the
unit that fills it cut (_cut), and the build stops reading once every source is full (a text file
of a full source is not opened). A source's text is split and encoded only about
_BUDGET_CHARS_PER_TOKEN characters per token it still wants at a time (encode_chunk's room; a long
unit in pieces of that size), so a 50 MB one-line text under a budget of 4096 tokens is tokenized in
0.8 s, not minutes; with no sentence end in it too (units.py cuts such a run into units of a window). The budget is
in the key: a cache serves only the budget it was built under.

On a first run `stream_tokens` builds the cache in a background thread (`TokenStream`) and the
packer follows the growing files, so the devices start on the first batches while the rest is
still tokenized.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import socket
import threading
import time
import uuid
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from isojax import faults
from isojax.atomic import fsync_dir
from isojax.errors import UserError
from isojax.log import log
from isojax.data.readers import Corpus
from isojax.data.units import text_units

CACHE_VERSION = 2  # 2: checksums in meta.json, long units split in bounded windows
_CHUNK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough to stream
_CHUNK_CHARS_IN_PROCESS = 1 << 16  # no IPC to amortize: small chunks give a streamed run its first batch sooner
_SMALL_CORPUS = 4 << 20  # bytes; below this, starting worker processes (~2 s) costs more than it saves
_PIECE_CHARS = 1 << 16  # a longer unit is tokenized in pieces: the tokenizer's memory grows with its input
_ENCODE_CHARS = 1 << 20  # characters per encode_batch_fast call, so its Encodings stay bounded too
_BUDGET_CHARS_PER_TOKEN = 8  # a source that wants n more tokens has 8n characters encoded at once,
_BUDGET_MIN_CHARS = 1 << 12  # at least this many
_FILES = ("tokens.bin", "offsets.bin", "source_ids.bin")
_STALE_SECONDS = 86400  # a .tmp-* folder unchanged this long is a dead build's, whatever its host


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """A tokenized corpus. Sequence i is `tokens[offsets[i]:offsets[i+1]]`, of source
    `source_names[source_ids[i]]`; no sequence is longer than `max_len`."""

    tokens: np.ndarray  # int32 [n_tokens], memory-mapped
    offsets: np.ndarray  # int64 [n_sequences + 1]
    source_ids: np.ndarray  # int16 [n_sequences]
    source_names: list[str]
    fingerprint: str
    max_len: int
    path: Path
    from_cache: bool  # True when nothing was tokenized by this call
    meta: dict

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_sequences(self) -> int:
        return len(self.source_ids)

    def sequence(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])

    def source_counts(self) -> dict[str, dict[str, int]]:
        """{source: {"tokens": n, "sequences": n}} after windowing."""
        lengths = np.diff(self.offsets)
        k = len(self.source_names)
        toks = np.bincount(self.source_ids, weights=lengths, minlength=k)
        seqs = np.bincount(self.source_ids, minlength=k)
        return {name: {"tokens": int(toks[i]), "sequences": int(seqs[i])} for i, name in enumerate(self.source_names)}


def backend_tokenizer(tokenizer) -> Tokenizer:
    """A `tokenizers.Tokenizer` copy of a Tokenizer or transformers fast tokenizer, with
    truncation and padding off (they would silently change the corpus)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"need a tokenizers.Tokenizer or a transformers fast tokenizer, got {type(tokenizer).__name__}")
    tok = Tokenizer.from_str(backend.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


_WORKER_TOKENIZER: Tokenizer | None = None
_LAST_CUT = re.compile(r"(?s).*\S(?=\s\S)")  # ends where the last such whitespace character starts


def _init_worker(tok_json: str, parent: int) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER_TOKENIZER = Tokenizer.from_str(tok_json)
    threading.Thread(target=_exit_with, args=(parent,), name="isojax-watch-parent", daemon=True).start()


def _exit_with(parent: int) -> None:
    """End this worker once its parent is gone (re-parented: getppid changes). A killed parent
    closes no pool: its workers would otherwise live on, each holding a core's task."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _pieces(text: str, n: int):
    """text in consecutive pieces of at most n characters (one piece when it is shorter), cut
    before a whitespace character that has non-whitespace on both sides; byte-level BPE splits
    there too (" word" starts a pre-token), so the pieces' ids are the text's. Runs of
    whitespace, which GPT-NeoX encodes as added tokens, are never cut."""
    lo = 0
    while len(text) - lo > n:
        m = _LAST_CUT.match(text, lo, lo + n)
        cut = m.end() if m else lo + n  # no such place: one giant word, cut anywhere
        yield text[lo:cut]
        lo = cut
    yield text[lo:]


def encode_chunk(unit: str, texts: list[str], srcs: list[int], tok: Tokenizer | None = None,
                 room: dict[int, int] | None = None, bos: int | None = None):
    """Units of the texts -> (lengths int32 [n], source ids int16 [n], tokens int32 flat); bos: an
    id put before each unit's tokens (None: none; the tokenizer itself never adds special tokens).
    Encoded _ENCODE_CHARS at a time, a long unit in pieces (_pieces), so memory stays bounded.
    room: {source id: tokens still wanted} (None: all): a source's text is split and encoded only
    a little past that many tokens (_budget_chars at a time), then no further; the caller cuts
    the excess (_cut)."""
    faults.reached("tokenize_chunk")
    tok = tok or _WORKER_TOKENIZER
    left = None if room is None else dict(room)
    lengths, owners, flats, batch, firsts, batch_srcs = [], [], [], [], [], []

    def encode():
        ids = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
        if bos is not None:
            ids = [[bos] + piece_ids if first else piece_ids for first, piece_ids in zip(firsts, ids)]
        for first, piece_ids, src in zip(firsts, ids, batch_srcs):
            if first:
                lengths.append(len(piece_ids))
            else:  # a further piece of the unit before
                lengths[-1] += len(piece_ids)
            if left is not None:
                left[src] -= len(piece_ids)
        flats.append(np.fromiter(itertools.chain.from_iterable(ids), np.int32, sum(map(len, ids))))
        for pending in (batch, firsts, batch_srcs):
            pending.clear()

    full = lambda src: left is not None and left[src] <= 0
    size = 0
    for text, src in zip(texts, srcs):
        if full(src):
            continue
        for unit_text in text_units(text, unit):
            owners.append(src)
            piece_chars = _PIECE_CHARS if left is None else min(_PIECE_CHARS, _budget_chars(left[src]))
            for k, piece in enumerate(_pieces(unit_text, piece_chars)):
                batch.append(piece)
                firsts.append(k == 0)
                batch_srcs.append(src)
                size += len(piece)
                if size >= (_ENCODE_CHARS if left is None else _budget_chars(left[src])):
                    encode()
                    size = 0
                    if full(src):
                        break
            if full(src):
                break
    if batch:
        encode()
    lengths = np.asarray(lengths, np.int64)
    keep = lengths > 0
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int32)
    return lengths[keep].astype(np.int32), np.asarray(owners, np.int16)[keep], flat


def _budget_chars(tokens_left: int) -> int:
    """Characters to encode at once for a source that wants tokens_left more: rarely more than
    it needs (a token is 4-5 characters of English), never so few that calls cost more than text."""
    return min(_ENCODE_CHARS, max(_BUDGET_MIN_CHARS, _BUDGET_CHARS_PER_TOKEN * tokens_left))


def _cut(lengths: np.ndarray, srcs: np.ndarray, flat: np.ndarray, room: dict[int, int], share: int):
    """(lengths, srcs, flat) of a chunk's sequences within each source's room (its share less
    what earlier chunks wrote, updated here): sequences past it dropped, the one that fills it cut."""
    ends = np.cumsum(lengths, dtype=np.int64)
    kept = lengths.astype(np.int64)
    for src in np.unique(srcs).tolist():
        mine = srcs == src
        upto = np.cumsum(kept[mine])
        left = room.get(src, share)
        kept[mine] = np.clip(left - (upto - kept[mine]), 0, kept[mine])
        room[src] = max(left - int(upto[-1]), 0)
    if np.array_equal(kept, lengths):
        return lengths, srcs, flat
    owner = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(flat)) - np.repeat(ends - lengths, lengths)
    keep = kept > 0
    return kept[keep].astype(np.int32), srcs[keep], flat[within < kept[owner]]


def _chunks(corpus: Corpus, names: dict[str, int], chunk_chars: int, skip=None):
    """(texts, source ids) of consecutive documents, about chunk_chars characters at a time; the
    first chunks are smaller (from _CHUNK_CHARS_IN_PROCESS, doubling), so that a streamed run's
    first tokens come after little reading and splitting. skip: Corpus.documents'."""
    texts, srcs, size = [], [], 0
    want = min(chunk_chars, _CHUNK_CHARS_IN_PROCESS)
    for label, text in corpus.documents(skip):
        if label not in names:
            if len(names) >= np.iinfo(np.int16).max:
                raise UserError(f"{corpus.describe()}: more than {np.iinfo(np.int16).max} sources")
            names[label] = len(names)
        texts.append(text)
        srcs.append(names[label])
        size += len(text)
        if size >= want:
            yield texts, srcs
            texts, srcs, size = [], [], 0
            want = min(2 * want, chunk_chars)
    if texts:
        yield texts, srcs


class _Cancelled(Exception):
    pass


class NoText(UserError):
    """The corpus holds no token (a host's share may: data/shares.py)."""


def _build(corpus: Corpus, tok: Tokenizer, tmp: Path, workers: int, progress: bool, publish=None,
           stop: threading.Event | None = None, bos: int | None = None) -> dict:
    """Tokenize into tmp's files (bos: encode_chunk's). publish(lengths, source ids, names), when given, is called after
    each chunk is written and flushed; stop, when set, ends the build with _Cancelled."""
    names: dict[str, int] = {}
    crc = dict.fromkeys(_FILES, 0)
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress)
    try:
        return _build_into(corpus, tok, tmp, workers, publish, stop, bar, names, crc, bos)
    except BaseException:  # the error is the last line: the bar is cleared, not drawn again after it
        bar.leave = False
        bar.close()
        raise


def _build_into(corpus, tok, tmp, workers, publish, stop, bar, names, crc, bos) -> dict:
    n_tok = n_seq = 0
    share, n_sources = corpus.budget()
    room: dict[int, int] = {}  # source id -> tokens its share still wants (share: none written yet)
    counts: dict[int, int] = {}  # source id -> tokens written
    full = lambda label: share is not None and label in names and room.get(names[label], share) <= 0
    met = lambda: n_sources is not None and sum(1 for v in room.values() if v <= 0) >= n_sources
    with open(tmp / "tokens.bin", "wb") as ft, open(tmp / "offsets.bin", "wb") as fo, \
            open(tmp / "source_ids.bin", "wb") as fs:
        def put(f, data: bytes) -> None:
            f.write(data)
            name = Path(f.name).name
            crc[name] = zlib.crc32(data, crc[name])

        put(fo, np.zeros(1, np.int64).tobytes())

        def write(result):
            nonlocal n_tok, n_seq
            lengths, srcs, flat = result if share is None else _cut(*result, room, share)
            put(ft, flat.tobytes())
            put(fo, (n_tok + np.cumsum(lengths, dtype=np.int64)).tobytes())
            put(fs, srcs.tobytes())
            n_tok += len(flat)
            n_seq += len(lengths)
            for src, n in zip(srcs.tolist(), lengths.tolist()):
                counts[src] = counts.get(src, 0) + n
            bar.update(len(flat))
            if publish is not None:
                ft.flush()
                publish(lengths, srcs, list(names))

        def chunks(chunk_chars):
            for chunk in _chunks(corpus, names, chunk_chars, full if share is not None else None):
                if stop is not None and stop.is_set():
                    raise _Cancelled
                yield chunk
                if met():  # every source has its share: nothing more is read
                    return

        def wanted(srcs):
            return None if share is None else {s: room.get(s, share) for s in set(srcs)}

        if workers <= 1:
            for texts, srcs in chunks(_CHUNK_CHARS_IN_PROCESS):
                write(encode_chunk(corpus.unit, texts, srcs, tok, wanted(srcs), bos))
        else:
            ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX or rayon threads run
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                     initargs=(tok.to_str(), os.getpid())) as pool:
                pending = collections.deque()  # bounded: the reader never runs far ahead
                for texts, srcs in chunks(_CHUNK_CHARS):
                    # a budget's room as written so far: the chunks in flight may encode a little past it
                    pending.append(pool.submit(encode_chunk, corpus.unit, texts, srcs, None, wanted(srcs), bos))
                    # in order, as soon as each is done (a streamed run reads them), and at most
                    # 2 x workers in flight
                    while pending and (pending[0].done() or len(pending) >= 2 * workers):
                        write(pending.popleft().result())
                while pending:
                    write(pending.popleft().result())
        for f in (ft, fo, fs):
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    if corpus.bad_records:
        log(f"warning: {corpus.describe()}: skipped {corpus.bad_records} bad records in total")
    if n_tok == 0:
        what = f" with sources {sorted(corpus.sources)} (sources seen: {sorted(corpus.seen_sources)})" \
            if corpus.sources is not None else ""
        raise NoText(f"{corpus.describe()}: corpus has no text{what}")
    _warn_empty(list(names), [counts.get(i, 0) for i in range(len(names))])
    return {"version": CACHE_VERSION, "source_names": list(names), "n_tokens": n_tok, "n_sequences": n_seq,
            "unit": corpus.unit, "corpus": corpus.describe(), "bad_records": corpus.bad_records, "crc32": crc,
            "budget": {"share": share, "sources": n_sources} if share is not None else None}


def _warn_empty(names: list[str], tokens: list[int]) -> None:
    """One warning line for each source that ended with no tokens (its records hold no text)."""
    for name, n in zip(names, tokens):
        if n == 0:
            log(f"warning: source {name} has no tokens (its records hold no text): its metrics are empty")


def _windows(offsets: np.ndarray, source_ids: np.ndarray, max_len: int):
    """Cut sequences longer than max_len into consecutive windows of max_len tokens."""
    lengths = np.diff(offsets)
    if len(lengths) == 0 or lengths.max() <= max_len:
        return offsets, source_ids
    n_win = -(-lengths // max_len)
    first = np.cumsum(n_win) - n_win
    k = np.arange(int(n_win.sum())) - np.repeat(first, n_win)
    starts = np.repeat(offsets[:-1], n_win) + k * max_len
    return np.append(starts, offsets[-1]), np.repeat(source_ids, n_win)


class _Damaged(Exception):
    """A token cache that fails a check; the message names the file and what failed."""


def _scan(path: Path, dtype) -> tuple[int, int]:
    """crc32 and the largest value read as unsigned (a negative one is larger than any
    allowed: one pass checks both ends) of a file of dtype values, non-empty."""
    buf, crc, hi = np.empty(64 << 20, np.uint8), 0, 0  # 64 MB at a time
    unsigned = np.dtype(dtype.replace("int", "uint"))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(buf[:n], crc)
            hi = max(hi, int(buf[:n].view(unsigned).max()))
    return crc, hi


def _check(path: Path, vocab: int | None) -> dict:
    """meta.json of the cache at path, after checking the files' sizes against it, and with vocab
    (a cache found on disk) their checksums and id ranges too (module docstring). _Damaged else."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        n_tok, n_seq, names, crc = meta["n_tokens"], meta["n_sequences"], meta["source_names"], meta["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Damaged(f"meta.json: {type(e).__name__}: {e}") from None
    if not (type(n_tok) is int and type(n_seq) is int and n_tok > 0 and n_seq > 0 and isinstance(names, list)
            and names and all(isinstance(n, str) for n in names) and isinstance(crc, dict) and set(crc) == set(_FILES)):
        raise _Damaged("meta.json: missing or malformed fields")
    files = {"tokens.bin": ("int32", n_tok), "offsets.bin": ("int64", n_seq + 1), "source_ids.bin": ("int16", n_seq)}
    for name, (dtype, n) in files.items():
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size != n * np.dtype(dtype).itemsize:
            raise _Damaged(f"{name}: {'missing' if size is None else f'{size} bytes'}, "
                           f"expected {n * np.dtype(dtype).itemsize}")
    if vocab is None:
        return meta
    ranges = {"tokens.bin": (vocab - 1, "token ids outside the tokenizer's vocabulary"),
              "offsets.bin": (n_tok, "offsets outside the tokens"),
              "source_ids.bin": (len(names) - 1, "source ids outside source_names")}
    for name, (dtype, n) in files.items():
        got, hi = _scan(path / name, dtype)
        if got != crc[name]:
            raise _Damaged(f"{name}: checksum mismatch (crc32 {got:08x}, meta.json says {crc[name]:08x})")
        allowed, what = ranges[name]
        if hi > allowed:
            a = np.memmap(path / name, dtype, "r", shape=(n,))
            bad = np.flatnonzero((a < 0) | (a > allowed))[0]
            raise _Damaged(f"{name}: {what} ({a[bad]} at {bad}; allowed 0..{allowed})")
    offsets = np.memmap(path / "offsets.bin", np.int64, "r", shape=(n_seq + 1,))
    if offsets[0] != 0 or offsets[-1] != n_tok or np.any(offsets[1:] < offsets[:-1]):
        raise _Damaged(f"offsets.bin: offsets do not rise from 0 to the {n_tok} tokens")
    return meta


def _open(path: Path, key: str, max_len: int, from_cache: bool, vocab: int | None = None) -> TokenCache:
    """The cache at path (checked by _check; vocab: fully), windows of max_len cut."""
    try:
        meta = _check(path, vocab)
    except _Damaged as e:
        if vocab is not None:
            raise
        raise UserError(f"token cache {path} is damaged ({e}); delete {path}") from None  # another process's
    n_tok, n_seq = meta["n_tokens"], meta["n_sequences"]
    tokens = np.memmap(path / "tokens.bin", np.int32, "r", shape=(n_tok,))
    offsets = np.memmap(path / "offsets.bin", np.int64, "r", shape=(n_seq + 1,))
    source_ids = np.memmap(path / "source_ids.bin", np.int16, "r", shape=(n_seq,))
    offsets, source_ids = _windows(offsets, source_ids, max_len)
    return TokenCache(tokens, offsets, source_ids, meta["source_names"], key, max_len, path, from_cache, meta)


def _open_found(final: Path, key: str, max_len: int, vocab: int) -> TokenCache | None:
    """The finished cache at final, or None: absent, or damaged (moved aside with a warning, so
    that it is rebuilt; the inputs it came from are unchanged, its key says so)."""
    if not final.exists():
        return None
    try:
        return _open(final, key, max_len, from_cache=True, vocab=vocab)
    except _Damaged as e:
        why = e
    aside = final.parent / f".tmp-damaged-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        pass  # another process moved it first
    except OSError as e:
        raise UserError(f"token cache {final} is damaged ({why}) and cannot be moved aside ({e}); "
                        f"delete {final}") from None
    shutil.rmtree(aside, ignore_errors=True)
    log(f"warning: token cache {final} is damaged ({why}); rebuilding it")
    return None


def _key(corpus: Corpus, tok: Tokenizer, bos: int | None = None) -> tuple[str, str]:
    """(the cache's key, the tokenizer's sha256). A BOS id is in the key (a cache without BOS is the
    key a cache had before the option: those stay in use)."""
    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()
    with_bos = "" if bos is None else f":bos={int(bos)}"
    return hashlib.sha256(f"{CACHE_VERSION}:{corpus.fingerprint()}:{tok_hash}{with_bos}".encode()).hexdigest()[:32], \
        tok_hash


def _new_tmp(cache_dir: Path, key: str) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    _clean_stale(cache_dir)
    tmp = cache_dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    (tmp / "writer").write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        pass
    return True


def _clean_stale(cache_dir: Path) -> None:
    """Remove the .tmp-* folders of dead builds: their writer ran on this host and is not
    running, or nothing in them changed for _STALE_SECONDS (another host's, or a reused pid).
    A folder just made, its writer file not yet written, is young: kept."""
    host = socket.gethostname()
    for tmp in cache_dir.glob(".tmp-*"):
        try:
            writer = (tmp / "writer").read_text().split() if (tmp / "writer").exists() else []
            changed = max([tmp.stat().st_mtime] + [p.stat().st_mtime for p in tmp.iterdir()])
        except OSError:  # removed meanwhile, or unreadable: not ours to judge
            continue
        dead = len(writer) == 2 and writer[0] == host and writer[1].isdigit() and not _alive(int(writer[1]))
        if dead or time.time() - changed > _STALE_SECONDS:
            shutil.rmtree(tmp, ignore_errors=True)


def _default_workers(corpus: Corpus) -> int:
    size = corpus.size_bytes()
    # what a budget reads, about (max_tokens itself: its sources may be known only by reading)
    share, n_sources = corpus.budget() if corpus.max_tokens is None else (corpus.max_tokens, 1)
    if share is not None and n_sources is not None:
        size = min(size if size is not None else np.inf, share * n_sources * _BUDGET_CHARS_PER_TOKEN)
    return 1 if size is not None and size < _SMALL_CORPUS else os.cpu_count() or 1


def _make(corpus: Corpus, tok: Tokenizer, tok_hash: str, tmp: Path, final: Path, workers: int, progress: bool,
          publish=None, stop=None, bos: int | None = None) -> None:
    """Build the cache in tmp and rename it to final; tmp is gone afterwards, whatever happens."""
    try:
        meta = _build(corpus, tok, tmp, workers, progress, publish, stop, bos)
        meta["tokenizer_sha256"], meta["bos"] = tok_hash, bos
        (tmp / "writer").unlink()
        with open(tmp / "meta.json", "w") as f:  # last: its checksums vouch for the files
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same cache first; theirs is identical
            if not (final / "meta.json").exists():
                raise
        fsync_dir(final.parent)  # the rename itself survives a power cut
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lookup(corpus: Corpus, tokenizer, cache_dir, max_len: int, bos: int | None):
    """(the finished cache or None, backend tokenizer, key, tokenizer hash, final folder)."""
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    # backend_tokenizer's copy (Tokenizer.from_str: ~0.13 s for Pythia's) only where the cache is built or
    # the tokenizer truncates or pads; else its JSON, and so the key, is the copy's (tests/test_tokens.py)
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    plain = isinstance(backend, Tokenizer) and backend.truncation is None and backend.padding is None
    tok = backend if plain else backend_tokenizer(tokenizer)
    if bos is not None and not 0 <= bos < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"bos {bos} is not an id of the tokenizer")
    key, tok_hash = _key(corpus, tok, bos)
    final = Path(cache_dir) / key
    found = _open_found(final, key, max_len, tok.get_vocab_size(with_added_tokens=True))
    if found is not None:
        _warn_empty(found.source_names, [c["tokens"] for c in found.source_counts().values()])
    elif plain:  # a build tokenizes with a copy of its own, not the caller's object
        tok = backend_tokenizer(tokenizer)
    return found, tok, key, tok_hash, final


def tokenize_corpus(corpus: Corpus, tokenizer, *, cache_dir, max_len: int, workers: int | None = None,
                    progress: bool = False, bos: int | None = None) -> TokenCache:
    """Tokenize `corpus` (no special tokens but `bos`, put before each unit) or reuse its cache; cut
    windows of `max_len` (a unit longer than that: only its first window starts with the BOS).

    `workers`: processes that split and tokenize (default: all cores, or this process alone
    for corpora under 4 MB); 1 = in this process.
    `progress`: show a tqdm bar of tokens written.
    """
    found, tok, key, tok_hash, final = _lookup(corpus, tokenizer, cache_dir, max_len, bos)
    if found is not None:
        return found
    tmp = _new_tmp(Path(cache_dir), key)
    _make(corpus, tok, tok_hash, tmp, final, workers or _default_workers(corpus), progress, bos=bos)
    return _open(final, key, max_len, from_cache=False)


def stream_tokens(corpus: Corpus, tokenizer, *, cache_dir, max_len: int,
                  workers: int | None = None, bos: int | None = None) -> TokenCache | TokenStream:
    """The corpus's token cache (windows of `max_len`) where it exists, else a TokenStream that
    builds it in a background thread, readable while it grows (`packing.pack_batches` takes either)."""
    found, tok, key, tok_hash, _ = _lookup(corpus, tokenizer, cache_dir, max_len, bos)
    if found is not None:
        return found
    return TokenStream(corpus, tok, tok_hash, Path(cache_dir), key, max_len, workers or _default_workers(corpus), bos)


class _Growing:
    """An array that only grows at its end (capacity doubled); views of it stay valid."""

    def __init__(self, dtype, first=()):
        self._buf = np.zeros(max(1024, len(first)), dtype)
        self.n = 0
        self.extend(np.asarray(first, dtype))

    def extend(self, x: np.ndarray) -> None:
        if self.n + len(x) > len(self._buf):
            bigger = np.zeros(max(2 * len(self._buf), self.n + len(x)), self._buf.dtype)
            bigger[:self.n] = self._buf[:self.n]
            self._buf = bigger
        self._buf[self.n:self.n + len(x)] = x
        self.n += len(x)

    def view(self) -> np.ndarray:
        return self._buf[:self.n]


class TokenStream:
    """A token cache being built by a background thread (the process pool of `_build` behind it)
    in its `.tmp-*` folder, renamed into place when complete, as `tokenize_corpus` does.

    After each chunk is written and flushed the builder publishes its sequences (windowed, as
    `_open` cuts them); `wait(n)` gives a TokenCache of everything written so far, its tokens
    memory-mapped from the temporary file, once it holds more than n sequences, and the
    finished cache (`_open`ed from its final place: the same sequences, the same order) at the
    end. The builder's error (a UserError for bad input) is raised by `wait` and `result`."""

    def __init__(self, corpus: Corpus, tok: Tokenizer, tok_hash: str, cache_dir: Path, key: str, max_len: int,
                 workers: int, bos: int | None = None):
        self.fingerprint, self.max_len, self.corpus = key, max_len, corpus
        self._offsets = _Growing(np.int64, [0])  # windowed, as _open cuts them
        self._source_ids = _Growing(np.int16)
        self._names: list[str] = []
        self._finished: TokenCache | None = None
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        tmp = _new_tmp(cache_dir, key)
        (tmp / "tokens.bin").touch()
        self._tokens_file = open(tmp / "tokens.bin", "rb")  # the same file after the rename
        self._thread = threading.Thread(target=self._run, name="isojax-tokenize", daemon=True,
                                        args=(corpus, tok, tok_hash, tmp, cache_dir / key, workers, bos))
        self._thread.start()

    def _run(self, corpus, tok, tok_hash, tmp, final, workers, bos) -> None:
        try:
            _make(corpus, tok, tok_hash, tmp, final, workers, False, self._publish, self._stop, bos)
            cache, error = _open(final, self.fingerprint, self.max_len, from_cache=False), None
        except BaseException as e:  # raised in the threads that read the stream
            cache, error = None, e
        with self._changed:
            self._finished, self._error = cache, error
            self._tokens_file.close()
            self._changed.notify_all()

    def _publish(self, lengths: np.ndarray, srcs: np.ndarray, names: list[str]) -> None:
        n_tok = int(self._offsets.view()[-1])
        ends = n_tok + np.cumsum(lengths, dtype=np.int64)
        offsets, source_ids = _windows(np.append(np.int64(n_tok), ends), srcs, self.max_len)
        with self._changed:
            self._offsets.extend(offsets[1:])
            self._source_ids.extend(source_ids)
            self._names = names
            self._changed.notify_all()

    def done(self) -> bool:
        return self._finished is not None or self._error is not None

    def wait(self, n_sequences: int, timeout: float | None = None) -> tuple[TokenCache, bool] | None:
        """(the cache as far as written, finished?) once it holds more than n_sequences sequences
        or is finished; None when timeout passes first."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done() or self._source_ids.n > n_sequences, timeout):
                return None
            if self._error is not None:
                raise self._error
            if self._finished is not None:
                return self._finished, True
            offsets, source_ids = self._offsets.view(), self._source_ids.view()
            n_tok = int(offsets[-1])
            tokens = np.memmap(self._tokens_file, np.int32, "r", shape=(n_tok,)) if n_tok else np.zeros(0, np.int32)
            return TokenCache(tokens, offsets, source_ids, list(self._names), self.fingerprint, self.max_len,
                              Path(self._tokens_file.name).parent, False, {}), False

    def tokens_at_least(self, n: int) -> int:
        """Tokens written, once there are at least n or the cache is finished."""
        with self._changed:
            self._changed.wait_for(lambda: self.done() or int(self._offsets.view()[-1]) >= n)
            if self._error is not None:
                raise self._error
            return self._finished.n_tokens if self._finished is not None else int(self._offsets.view()[-1])

    def result(self) -> TokenCache:
        """The finished cache (waits for the build)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._finished

    def cancel(self) -> None:
        """Stop the build (its temporary folder is removed); nothing if it has finished."""
        self._stop.set()
        self._thread.join()
