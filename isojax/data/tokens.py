"""Text -> token ids, cached on disk.

Cache layout: `CACHE_DIR/<key>/` with raw little-endian arrays `tokens.bin` (int32),
`offsets.bin` (int64, n_seq+1) and `source_ids.bin` (int16, n_seq), and `meta.json`.
`key` hashes the corpus fingerprint (input paths + sizes + mtimes, unit, sources,
splitter version) and the tokenizer (sha256 of its JSON, truncation/padding removed), so
every model sharing a tokenizer reuses one cache. The cache holds whole units; windows of
`max_len` are cut when it is opened, so it is shared across context lengths too.

A cache is built in a temporary sibling folder and renamed into place only when complete:
a crash leaves a `.tmp-*` folder that is never read (and is safe to delete).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import uuid
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from isojax.errors import UserError
from isojax.data.readers import Corpus
from isojax.data.units import text_units

CACHE_VERSION = 1
_CHUNK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough to stream
_SMALL_CORPUS = 4 << 20  # bytes; below this, starting worker processes (~2 s) costs more than it saves


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


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(backend_tokenizer(tokenizer).to_str().encode()).hexdigest()


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tok_json: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER_TOKENIZER = Tokenizer.from_str(tok_json)


def encode_chunk(unit: str, texts: list[str], srcs: list[int], tok: Tokenizer | None = None):
    """Units of the texts -> (lengths int32 [n], source ids int16 [n], tokens int32 flat)."""
    tok = tok or _WORKER_TOKENIZER
    pieces, owners = [], []
    for text, src in zip(texts, srcs):
        units = text_units(text, unit)
        pieces.extend(units)
        owners.extend([src] * len(units))
    ids = [e.ids for e in tok.encode_batch_fast(pieces, add_special_tokens=False)] if pieces else []
    lengths = np.fromiter(map(len, ids), np.int32, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(lengths.sum()))
    keep = lengths > 0
    return lengths[keep], np.asarray(owners, np.int16)[keep], flat


def _chunks(corpus: Corpus, names: dict[str, int]):
    texts, srcs, size = [], [], 0
    for label, text in corpus.documents():
        if label not in names:
            if len(names) >= np.iinfo(np.int16).max:
                raise UserError(f"{corpus.describe()}: more than {np.iinfo(np.int16).max} sources")
            names[label] = len(names)
        texts.append(text)
        srcs.append(names[label])
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield texts, srcs
            texts, srcs, size = [], [], 0
    if texts:
        yield texts, srcs


def _build(corpus: Corpus, tok: Tokenizer, tmp: Path, workers: int, progress: bool) -> dict:
    names: dict[str, int] = {}
    n_tok = n_seq = 0
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress)
    with open(tmp / "tokens.bin", "wb") as ft, open(tmp / "offsets.bin", "wb") as fo, \
            open(tmp / "source_ids.bin", "wb") as fs:
        fo.write(np.zeros(1, np.int64).tobytes())

        def write(result):
            nonlocal n_tok, n_seq
            lengths, srcs, flat = result
            ft.write(flat.tobytes())
            fo.write((n_tok + np.cumsum(lengths, dtype=np.int64)).tobytes())
            fs.write(srcs.tobytes())
            n_tok += len(flat)
            n_seq += len(lengths)
            bar.update(len(flat))

        if workers <= 1:
            for texts, srcs in _chunks(corpus, names):
                write(encode_chunk(corpus.unit, texts, srcs, tok))
        else:
            ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX or rayon threads run
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                     initargs=(tok.to_str(),)) as pool:
                pending = collections.deque()  # bounded: the reader never runs far ahead
                for texts, srcs in _chunks(corpus, names):
                    pending.append(pool.submit(encode_chunk, corpus.unit, texts, srcs))
                    if len(pending) >= 2 * workers:
                        write(pending.popleft().result())
                while pending:
                    write(pending.popleft().result())
        for f in (ft, fo, fs):
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    if corpus.bad_records:
        warnings.warn(f"{corpus.describe()}: skipped {corpus.bad_records} bad records in total", stacklevel=3)
    if n_tok == 0:
        what = f" with sources {sorted(corpus.sources)} (sources seen: {sorted(corpus.seen_sources)})" \
            if corpus.sources is not None else ""
        raise UserError(f"{corpus.describe()}: corpus has no text{what}")
    return {"version": CACHE_VERSION, "source_names": list(names), "n_tokens": n_tok, "n_sequences": n_seq,
            "unit": corpus.unit, "corpus": corpus.describe(), "bad_records": corpus.bad_records}


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


def _open(path: Path, key: str, max_len: int, from_cache: bool) -> TokenCache:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path / 'meta.json'}: token cache is damaged ({e}); delete {path}") from None
    sizes = {"tokens.bin": 4 * meta["n_tokens"], "offsets.bin": 8 * (meta["n_sequences"] + 1),
             "source_ids.bin": 2 * meta["n_sequences"]}
    for name, size in sizes.items():
        if not (path / name).exists() or (path / name).stat().st_size != size:
            raise UserError(f"{path / name}: token cache is damaged (expected {size} bytes); delete {path}")
    tokens = np.memmap(path / "tokens.bin", np.int32, "r", shape=(meta["n_tokens"],))
    n_seq = meta["n_sequences"]
    offsets = np.memmap(path / "offsets.bin", np.int64, "r", shape=(n_seq + 1,))
    source_ids = np.memmap(path / "source_ids.bin", np.int16, "r", shape=(n_seq,))
    offsets, source_ids = _windows(offsets, source_ids, max_len)
    return TokenCache(tokens, offsets, source_ids, meta["source_names"], key, max_len, path, from_cache, meta)


def tokenize_corpus(corpus: Corpus, tokenizer, *, cache_dir, max_len: int, workers: int | None = None,
                    progress: bool = False) -> TokenCache:
    """Tokenize `corpus` (no special tokens) or reuse its cache; cut windows of `max_len`.

    `workers`: processes that split and tokenize (default: all cores, or this process alone
    for corpora under 4 MB); 1 = in this process.
    `progress`: show a tqdm bar of tokens written.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be positive, got {max_len}")
    tok = backend_tokenizer(tokenizer)
    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()
    key = hashlib.sha256(f"{CACHE_VERSION}:{corpus.fingerprint()}:{tok_hash}".encode()).hexdigest()[:32]
    cache_dir = Path(cache_dir)
    final = cache_dir / key
    if (final / "meta.json").exists():
        return _open(final, key, max_len, from_cache=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if workers is None:
            size = corpus.size_bytes()
            workers = 1 if size is not None and size < _SMALL_CORPUS else os.cpu_count() or 1
        meta = _build(corpus, tok, tmp, workers, progress)
        meta["tokenizer_sha256"] = tok_hash
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same cache first; theirs is identical
            if not (final / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _open(final, key, max_len, from_cache=False)
