"""Corpus inputs: text files, JSON lines (plain, gzip, zstd), parquet, folders of shards,
hub datasets, and the embedded default corpus (CPython's bundled documentation topics).
Length: every input format's reader and the token budget's per-source stop are one unit (the stop
must know each format's records), tested together.

Local files are read by hand rather than through `datasets`: every bad record is reported
as `file:line`, and an 800 GB corpus is streamed, not first copied into an Arrow cache.
Hub datasets (`hub:NAME[@REVISION][:CONFIG]:SPLIT`) stream through `datasets`.

A record's source label is `meta.pile_set_name` when present (the Pile's format), else the
name of the input it came from: a file's stem, a folder's name, a hub dataset's name.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import numbers
import os
import threading
import zlib
from pathlib import Path
from typing import Iterator

from isojax import storage
from isojax.errors import UserError
from isojax.log import log
from isojax.data.units import SPLITTER, UNITS

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
DEFAULT_NAME = "pydoc-topics"
_MAX_WARNINGS = 10


@dataclasses.dataclass(frozen=True)
class Input:
    kind: str  # "txt" | "jsonl" | "parquet" | "hub" | "default"
    path: str  # file path, hub name, or DEFAULT_NAME
    label: str  # source label of records without meta.pile_set_name
    config: str | None = None
    split: str | None = None
    revision: str | None = None
    byte_range: tuple[int, int] | None = None  # a share of a plain .jsonl: the lines that start in these bytes


def _suffix_kind(name: str) -> str | None:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix.split(".")[1]
    return None


def _stem(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _parse_hub(spec: str) -> Input:
    parts = spec[len("hub:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise UserError(f"{spec}: expected hub:NAME[@REVISION][:CONFIG]:SPLIT")
    name, _, revision = parts[0].partition("@")
    config, split = (None, "train") if len(parts) == 1 else (None, parts[1]) if len(parts) == 2 else parts[1:]
    return Input("hub", name, name.rstrip("/").split("/")[-1], config or None, split, revision or None)


def _expand(spec: str) -> list[Input]:
    if spec.startswith("hub:"):
        return [_parse_hub(spec)]
    if storage.is_remote(spec):  # read from a local copy, fetched once per version of the objects
        spec = storage.local_copy(spec)
    path = Path(spec)
    if not path.exists():
        raise UserError(f"{spec}: no such file or directory")
    if path.is_file():
        kind = _suffix_kind(path.name)
        if kind is None:
            raise UserError(f"{spec}: unsupported file type (expected one of {', '.join(SUFFIXES)})")
        return [Input(kind, str(path), _stem(path.name))]
    shards = sorted(
        p for p in path.rglob("*")
        if p.is_file() and _suffix_kind(p.name) and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    if not shards:
        raise UserError(f"{spec}: folder holds no {', '.join(SUFFIXES)} files")
    label = path.resolve().name
    return [Input(_suffix_kind(p.name), str(p), label) for p in shards]


@dataclasses.dataclass
class Corpus:
    """A lazily read corpus: inputs, unit, optional sources filter. Iterate `documents()`."""

    inputs: tuple[Input, ...]
    unit: str = "sentence"
    sources: frozenset[str] | None = None
    text_field: str = "text"
    max_bad_records: int = 100
    bad_records: int = 0
    seen_sources: set[str] = dataclasses.field(default_factory=set)
    warn: bool = True  # warn about skipped records (the label scan reads them a second time, quietly)
    max_tokens: int | None = None  # a budget split equally over the sources (budget())
    max_tokens_per_source: int | None = None
    _labels: list[str] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _labels_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False,
                                                     compare=False)

    def fingerprint(self) -> str:
        """Hash of inputs (path, size, mtime), unit, sources, splitter; never reads contents.

        The default corpus is hashed by content; a hub dataset by name, config, split and
        revision (pin a revision: an unpinned hub dataset that changes upstream is not seen).
        """
        parts = []
        for inp in self.inputs:
            if inp.kind == "default":
                parts.append([inp.kind, hashlib.sha256(json.dumps(_default_topics()).encode()).hexdigest()])
            elif inp.kind == "hub":
                local = Path(inp.path)
                stats = [_stat(p) for p in sorted(local.rglob("*")) if p.is_file()] if local.is_dir() else []
                parts.append([inp.kind, inp.path, inp.config, inp.split, inp.revision, stats])
            else:
                piece = [list(inp.byte_range)] if inp.byte_range else []
                parts.append([inp.kind, inp.label, *_stat(Path(inp.path)), *piece])
        key = {"inputs": parts, "unit": self.unit, "splitter": SPLITTER if self.unit == "sentence" else None,
               "sources": sorted(self.sources) if self.sources is not None else None, "text_field": self.text_field}
        if self.max_tokens is not None or self.max_tokens_per_source is not None:  # absent: the whole corpus
            key["budget"] = [self.max_tokens, self.max_tokens_per_source]
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def size_bytes(self) -> int | None:
        """Bytes of the local input files (compressed size); None for hub datasets."""
        if any(inp.kind == "hub" for inp in self.inputs):
            return None
        return sum(os.path.getsize(inp.path) if inp.kind != "default" else 500_000 for inp in self.inputs)

    def describe(self) -> str:
        names = [inp.path + (" (bytes {:,}-{:,})".format(*inp.byte_range) if inp.byte_range else "")
                 for inp in self.inputs]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def documents(self, skip=None) -> Iterator[tuple[str, str]]:
        """(source label, text) of every record that passes the sources filter, in order; none
        whose label skip(label) is true: a text file or the default corpus of such a label is not
        even read (its label is its input's)."""
        self.bad_records = 0
        self.seen_sources = set()
        for inp in self.inputs:
            if skip is not None and inp.kind in ("txt", "default") and skip(inp.label):
                continue
            for label, text in _READERS[inp.kind](self, inp):
                self.seen_sources.add(label)
                if (self.sources is None or label in self.sources) and not (skip is not None and skip(label)):
                    yield label, text

    def shareable(self) -> bool:
        """Whether the processes of a multi-host run can each read a share of the input files
        (data/shares.py): local files only, and no token budget (which one process meets by reading
        a prefix of the corpus: split over hosts, each would read its whole share to find its end)."""
        return self.max_tokens is None and self.max_tokens_per_source is None and \
            all(inp.kind in ("txt", "jsonl", "parquet") for inp in self.inputs)

    def share(self, index: int, count: int) -> Corpus:
        """The corpus that process `index` of `count` reads: a contiguous run of pieces of the
        input, the piece whose middle byte falls in the index-th count-th of all bytes going to it.
        A piece is a file, or, of a plain .jsonl larger than a count-th of the bytes, the lines that
        start in one of its count-th parts. In process order the shares are the inputs in order, so
        their records, concatenated, are the corpus's."""
        sizes = [os.path.getsize(inp.path) for inp in self.inputs]
        total, pieces = max(sum(sizes), 1), []
        for inp, size in zip(self.inputs, sizes):
            parts = count if inp.path.endswith(".jsonl") and size * count > total else 1
            cuts = [size * k // parts for k in range(parts + 1)]
            pieces += [(dataclasses.replace(inp, byte_range=(a, b)) if parts > 1 else inp, b - a)
                       for a, b in zip(cuts, cuts[1:])]
        before, mine = 0, []
        for piece, size in pieces:
            if min(int((before + size / 2) * count / total), count - 1) == index:
                mine.append(piece)
            before += size
        return dataclasses.replace(self, inputs=tuple(mine), bad_records=0, seen_sources=set())

    def budget(self) -> tuple[int | None, int | None]:
        """(each source's share of tokens, the number of sources): max_tokens // sources, at most
        max_tokens_per_source; max_tokens_per_source alone; (None, None) without a budget. The
        sources are those --sources names, else the corpus's labels (a JSON lines or parquet input
        is read for them, as a first run does anyway); without max_tokens their number is None
        where it would cost that read."""
        total, each = self.max_tokens, self.max_tokens_per_source
        if total is None and each is None:
            return None, None
        cheap = self.sources is not None or all(inp.kind in ("txt", "default") for inp in self.inputs)
        n = (len(self.sources) if self.sources is not None else len(self.labels())) \
            if total is not None or cheap else None
        if total is None:
            return each, n
        if n and total < n:
            raise UserError(f"--max-tokens {total:,} is less than one token for each of the {n} sources")
        share = total // max(n, 1)
        return (min(share, each) if each is not None else share), n

    def labels(self) -> list[str]:
        """The source labels of the records, in order of first appearance (as a token cache's
        source_names). Text files and the default corpus carry no per-record labels: theirs
        follow from the inputs; other inputs are read (records parsed and checked, the label
        taken; nothing split or tokenized)."""
        keep = lambda label: self.sources is None or label in self.sources
        if all(inp.kind in ("txt", "default") for inp in self.inputs):
            return list(dict.fromkeys(inp.label for inp in self.inputs if keep(inp.label)))
        with self._labels_lock:  # read once: the build's budget and the step's plan both ask, on two threads
            if self._labels is None:
                quiet = dataclasses.replace(self, warn=False)  # its own counters: the build may be reading self
                self._labels = list(dict.fromkeys(label for label, _ in quiet.documents()))
        return list(self._labels)

    def _bad(self, where: str, reason: str) -> None:
        self.bad_records += 1
        if self.bad_records > self.max_bad_records:
            raise UserError(f"{where}: {reason} (more than max_bad_records={self.max_bad_records} bad records)")
        if self.warn and self.bad_records <= _MAX_WARNINGS:
            log(f"warning: {where}: {reason}; record skipped")

    def _record(self, where: str, rec, default_label: str):
        if not isinstance(rec, dict):
            return self._bad(where, f"record is a {type(rec).__name__}, not an object")
        text = rec.get(self.text_field)
        if not isinstance(text, str):
            why = "no" if text is None else f"non-string ({type(text).__name__})"
            return self._bad(where, f"record has {why} {self.text_field!r} field")
        meta = rec.get("meta")
        label = meta.get("pile_set_name") if isinstance(meta, dict) else None
        return (label if isinstance(label, str) else default_label), text


def _stat(path: Path) -> list:
    """A file in a fingerprint: its path, size and time; a copy of gs:// objects by its name under
    the copies' folder (storage.copy_name), so that every host's copy, and one fetched again after
    a preemption, has one fingerprint (the processes of a run trade their shares under it)."""
    st = path.stat()
    copy = storage.copy_name(path)
    return [copy, st.st_size] if copy else [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _read_txt(corpus: Corpus, inp: Input):
    data = Path(inp.path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"{inp.path}:{line}: invalid UTF-8 byte 0x{data[e.start]:02x} at column {col}") from None
    yield inp.label, text.lstrip("\ufeff")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame (pzstd and `zstd -T` write
    several). zstandard's own stream reader ends quietly where the file ends, even inside a
    frame: a cut file would read as a shorter corpus. Here that raises EOFError."""

    def __init__(self, path: str):
        import zstandard

        self._raw = open(path, "rb")
        self._new = lambda: zstandard.ZstdDecompressor(max_window_size=2**31).decompressobj()
        self._obj, self._fed, self._out, self._pos = self._new(), False, b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos == len(self._out):
            data, out = self._raw.read(1 << 16), []
            if not data:
                if self._fed and not self._obj.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while data:  # a chunk may end one frame and start the next
                if self._obj.eof:
                    self._obj = self._new()
                out.append(self._obj.decompress(data))
                self._fed = True
                data = self._obj.unused_data if self._obj.eof else b""
            self._out, self._pos = b"".join(out), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path), 1 << 20)
    return open(path, "rb")


def _skip_to_line(f, start: int) -> int:
    """Move f to the first line that starts at byte `start` or after; the lines before it (read, not
    parsed, so that a bad record is named by its line in the file)."""
    lines, pos, last = 0, 0, b"\n"
    while pos < start:
        chunk = f.read(min(1 << 20, start - pos))
        if not chunk:
            return lines
        lines, pos, last = lines + chunk.count(b"\n"), pos + len(chunk), chunk[-1:]
    if last != b"\n":  # the line that holds byte start - 1 is the piece's before
        lines += f.readline().endswith(b"\n")
    return lines


def _lines_until(f, pos: int, end: int):
    """The lines of f from byte pos on that start before byte end."""
    for raw in f:
        if pos >= end:
            return
        yield raw
        pos += len(raw)


def _read_jsonl(corpus: Corpus, inp: Input):
    lineno = 0
    with _open_binary(inp.path) as f:
        if inp.byte_range is not None:
            lineno = _skip_to_line(f, inp.byte_range[0])
            f = _lines_until(f, f.tell(), inp.byte_range[1])
        try:
            for lineno, raw in enumerate(f, lineno + 1):
                if not raw.strip():
                    continue
                where = f"{inp.path}:{lineno}"
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    corpus._bad(where, f"invalid UTF-8 byte 0x{raw[e.start]:02x} at column {e.start + 1}")
                    continue
                except json.JSONDecodeError as e:
                    corpus._bad(where, f"malformed JSON ({e.msg} at column {e.colno})")
                    continue
                out = corpus._record(where, rec, inp.label)
                if out is not None:
                    yield out
        except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise UserError(f"{inp.path}:{lineno + 1}: corrupt or truncated compressed data ({e})") from None
        except Exception as e:  # zstandard.ZstdError has no importable common base here
            if type(e).__name__ == "ZstdError":
                raise UserError(f"{inp.path}:{lineno + 1}: corrupt or truncated zstd data ({e})") from None
            raise


def _read_parquet(corpus: Corpus, inp: Input):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(inp.path)
    except Exception as e:
        raise UserError(f"{inp.path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if corpus.text_field not in names:
        raise UserError(f"{inp.path}:1: no {corpus.text_field!r} column (columns: {', '.join(names)})")
    columns = [c for c in (corpus.text_field, "meta") if c in names]
    row, batches = 0, pf.iter_batches(batch_size=4096, columns=columns)
    while True:
        try:  # a damaged row group would otherwise end in pyarrow's traceback, or a shorter corpus
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{inp.path}: corrupt parquet data ({e})") from None  # read ahead: no row
        if batch is None:
            break
        cols = {c: batch.column(c).to_pylist() for c in columns}
        for i in range(batch.num_rows):
            row += 1
            out = corpus._record(f"{inp.path}:{row}", {c: cols[c][i] for c in columns}, inp.label)
            if out is not None:
                yield out


def check_hub_dataset(inp: Input) -> None:
    """A hub dataset is streamed: refuse it at once offline (no route to HF_ENDPOINT, or
    HF_HUB_OFFLINE) instead of after `datasets`' retries, and refuse a repository or revision the
    hub does not have before anything is tokenized. A local folder given as hub:PATH is left to
    `datasets`."""
    if Path(inp.path).expanduser().is_dir():
        return
    from isojax.hf.network import hub_endpoint, hub_reachable, why_unreachable
    spec = f"hub:{inp.path}" + (f"@{inp.revision}" if inp.revision else "")
    if not hub_reachable():
        raise UserError(f"{spec}: {why_unreachable()}, and hub datasets are streamed from it (download the "
                        "dataset's files and pass them to --data as paths to run offline)")
    import huggingface_hub
    from huggingface_hub import errors
    try:
        huggingface_hub.HfApi().dataset_info(inp.path, revision=inp.revision, timeout=30)
    except errors.RevisionNotFoundError:
        raise UserError(f"{spec}: the dataset has no revision {inp.revision!r}") from None
    except errors.GatedRepoError:
        from isojax.hf.files import LOGIN_HINT
        raise UserError(f"{spec}: the dataset is gated: accept its terms on its page and {LOGIN_HINT}") from None
    except errors.RepositoryNotFoundError:
        from isojax.hf.files import LOGIN_HINT
        raise UserError(f"{spec}: no such dataset on {hub_endpoint()} (if it is private or gated, "
                        f"{LOGIN_HINT})") from None
    except Exception as e:  # 5xx after retries, a timeout, a dropped connection
        raise UserError(f"{spec}: cannot reach the dataset on {hub_endpoint()} "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None


def _read_hub(corpus: Corpus, inp: Input):
    import datasets

    spec = f"hub:{inp.path}"
    try:
        ds = datasets.load_dataset(inp.path, inp.config, split=inp.split, revision=inp.revision, streaming=True)
    except Exception as e:
        raise UserError(f"{spec}: cannot load dataset ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for i, rec in enumerate(ds, 1):
        out = corpus._record(f"{spec}:{i}", rec, inp.label)
        if out is not None:
            yield out


def _default_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {k: topics[k] for k in sorted(topics)}


def _read_default(corpus: Corpus, inp: Input):
    for text in _default_topics().values():
        yield inp.label, text


_READERS = {"txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_parquet, "hub": _read_hub,
            "default": _read_default}


def default_corpus(*, unit: str = "sentence") -> Corpus:
    """CPython's bundled documentation topics (`pydoc_data.topics`): real English, always offline."""
    return Corpus((Input("default", DEFAULT_NAME, DEFAULT_NAME),), unit=unit)


def load_corpus(paths: list[str] | None, *, unit: str = "sentence", sources=None, text_field: str = "text",
                max_bad_records: int = 100, max_tokens: int | None = None,
                max_tokens_per_source: int | None = None) -> Corpus:
    """Describe a corpus; nothing is read until it is tokenized. None or [] -> the default corpus.

    `paths`: .txt (one file = one document), .jsonl / .jsonl.gz / .jsonl.zst with a `text`
    field, .parquet, folders of such shards (recursive, sorted), or `hub:NAME[@REV][:CONFIG]:SPLIT`.
    `sources`: keep only records whose source label is in this list.
    `max_bad_records`: malformed / undecodable / text-less records are skipped with a warning
    naming file and line; one more than this many raises UserError.
    `max_tokens`, `max_tokens_per_source`: the token budget (Corpus.budget); tokenizing stops
    once every source has its share, the unit that fills it cut to fit.
    """
    if unit not in UNITS:
        raise UserError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    for flag, value in (("--max-tokens", max_tokens), ("--max-tokens-per-source", max_tokens_per_source)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise UserError(f"{flag} must be a positive integer, not {value!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    srcs = None
    if sources is not None:
        srcs = frozenset([sources] if isinstance(sources, str) else sources)
        if not srcs:
            raise UserError("sources: empty list (leave it out to keep every source)")
    if not paths:
        corpus = default_corpus(unit=unit)
    else:
        inputs = [inp for spec in paths for inp in _expand(str(spec))]
        for inp in inputs:  # first: a misspelt dataset is "no such dataset", whatever else is wrong
            if inp.kind == "hub":
                check_hub_dataset(inp)
        if max_tokens is not None and srcs is None and any(inp.kind == "hub" for inp in inputs):
            raise UserError("--max-tokens is split over the sources, and a hub dataset's are known only once it "
                            "is read: name them with --source, or give --max-tokens-per-source alone")
        corpus = Corpus(tuple(inputs), unit=unit)
    corpus.sources, corpus.text_field, corpus.max_bad_records = srcs, text_field, max_bad_records
    corpus.max_tokens, corpus.max_tokens_per_source = (None if v is None else int(v) for v in
                                                        (max_tokens, max_tokens_per_source))
    if max_tokens is not None and (srcs is not None or all(inp.kind in ("txt", "default") for inp in corpus.inputs)):
        corpus.budget()  # a budget too small for its sources is refused now where that reads nothing
    return corpus
