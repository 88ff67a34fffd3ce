"""Corpus pipeline throughput on this host: sentence splitters, text -> cached tokens, packing.

    PYTHONPATH=. python -m bench.bench_data [--quick]

Prints tables; also writes $OUT/bench_data.txt when OUT is set. The splitter comparison
runs every candidate that is installed (syntok is required; blingfire, sentencex, pysbd
are optional) and scores sentence boundaries against syntok, the reference chosen by eye.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # workers=1 must mean one core

import argparse
import platform
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from isojax.data import TokenCache, load_corpus, pack_batches, plan_stats, tokenize_corpus
from isojax.data.tokens import _windows
from isojax.data.units import SPLITTER, paragraphs, split_sentences

DATA = Path(os.environ.get("ISOJAX_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
BOOKS = [DATA / "moby-dick.txt", DATA / "tinyshakespeare.txt"]
TRICKY = [
    'Mr. Smith met Dr. Jones at 5 p.m. on Baker St. yesterday. They talked.',
    '"Where are you going?" she asked. "Home," he said.',
    'He paused... Then he left. Wait... what?',
    'See Fig. 3 and Section 2.1 of the paper (Smith et al. 2020). It works.',
]
_RX = re.compile(r'(?<=[.!?])["\')\]]*\s+(?=["\'(\[]?[A-Z0-9])')


def splitters():
    out = {"syntok": split_sentences, "regex": lambda t: [s for p in paragraphs(t) for s in _RX.split(p)]}
    try:
        import blingfire

        out["blingfire"] = lambda t: [s for p in paragraphs(t) for s in blingfire.text_to_sentences(p).split("\n")]
    except ImportError:
        pass
    try:
        import sentencex

        out["sentencex"] = lambda t: [s.strip() for p in paragraphs(t) for s in sentencex.segment("en", p)]
    except ImportError:
        pass
    try:
        import pysbd

        seg = pysbd.Segmenter(language="en", clean=False)
        out["pysbd"] = lambda t: [s.strip() for p in paragraphs(t) for s in seg.segment(p)]
    except ImportError:
        pass
    return out


def boundaries(sents):
    ends, n = set(), 0
    for s in sents[:-1]:
        n += len(s.replace(" ", ""))
        ends.add(n)
    return ends


def bench_splitters(lines, quick):
    paras = [p for book in BOOKS for p in paragraphs(book.read_text())]
    ref = [boundaries(split_sentences(p)) for p in paras]
    lines.append("\n## sentence splitters (both books, paragraphs of collapsed whitespace; P/R of boundaries vs syntok)")
    lines.append(f"{'splitter':10s} {'sents/s':>10s} {'MB/s':>7s} {'P':>6s} {'R':>6s}  tricky cases")
    for name, fn in splitters().items():
        sub = paras if name != "pysbd" else paras[: len(paras) // (40 if quick else 10)]  # pysbd is slow
        t0 = time.perf_counter()
        out = [fn(p) for p in sub]
        dt = time.perf_counter() - t0
        n = sum(map(len, out))
        tp = fp = fn_ = 0
        for s, r in zip(out, ref):
            b = boundaries(s)
            tp, fp, fn_ = tp + len(b & r), fp + len(b - r), fn_ + len(r - b)
        tricky = " | ".join(str(len(fn(t))) for t in TRICKY)
        lines.append(f"{name:10s} {n / dt:10.0f} {sum(map(len, sub)) / dt / 1e6:7.2f} "
                     f"{tp / max(tp + fp, 1):6.3f} {tp / max(tp + fn_, 1):6.3f}  sentences per case: {tricky} "
                     f"(right: 2 | 2 | 3 | 2)")


def cpu_seconds() -> float:
    """User + system time of this process and its reaped children (the tokenizer workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_tokenize(lines, tok, copies):
    tmp = Path(tempfile.mkdtemp())
    paths = []
    for k in range(copies):  # distinct files so each copy is read and tokenized
        for book in BOOKS:
            p = tmp / f"{book.stem}-{k}.txt"
            p.write_text(book.read_text())
            paths.append(str(p))
    mb = sum(os.path.getsize(p) for p in paths) / 1e6
    lines.append(f"\n## text -> cached tokens ({mb:.1f} MB: both books x{copies}, fresh cache each run)")
    lines.append("(cpu s: this process + its workers; tok/cpu-s is immune to other load on the host)")
    lines.append(f"{'unit':9s} {'workers':>7s} {'seconds':>8s} {'tokens':>9s} {'tokens/s':>10s} {'tok/s/core':>10s} "
                 f"{'cpu s':>7s} {'tok/cpu-s':>10s}")
    ncpu = os.cpu_count() or 1
    cache = None
    for unit in ("sentence", "document"):
        for workers in sorted({1, ncpu}):
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            c = tokenize_corpus(load_corpus(paths, unit=unit), tok, cache_dir=tmp / f"c-{unit}-{workers}",
                                max_len=2048, workers=workers)
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
            lines.append(f"{unit:9s} {workers:7d} {dt:8.2f} {c.n_tokens:9d} {c.n_tokens / dt:10.0f} "
                         f"{c.n_tokens / dt / workers:10.0f} {cpu:7.2f} {c.n_tokens / cpu:10.0f}")
            if unit == "sentence":
                cache = c
    t0 = time.perf_counter()
    tokenize_corpus(load_corpus(paths), tok, cache_dir=tmp / f"c-sentence-{ncpu}", max_len=2048)
    lines.append(f"cache hit (sentence): {time.perf_counter() - t0:.3f} s")
    return cache


def tiled(cache: TokenCache, times: int, max_len: int) -> TokenCache:
    """The real sentence cache repeated `times` times (realistic lengths, more tokens), in
    windows of max_len."""
    lengths = np.tile(np.diff(cache.offsets), times)
    offsets, source_ids = _windows(np.concatenate([[0], np.cumsum(lengths)]), np.tile(cache.source_ids, times),
                                   max_len)
    return TokenCache(np.tile(np.asarray(cache.tokens), times), offsets, source_ids,
                      cache.source_names, cache.fingerprint, max_len, cache.path, True, cache.meta)


def bench_packing(lines, cache, times):
    big = tiled(cache, times, 2048)
    mean = big.n_tokens / big.n_sequences
    lines.append(f"\n## cache -> packed rows ({big.n_tokens / 1e6:.1f}M tokens, {big.n_sequences} sentences, "
                 f"mean {mean:.1f} tokens, 2 sources; one process)")
    lines.append(f"{'B x T':>10s} {'what':22s} {'seconds':>8s} {'tokens/s':>12s} {'padding':>8s}")
    for rows, row_len in ((32, 2048), (128, 512), (512, 128)):
        big = tiled(cache, times, row_len)
        t0 = time.perf_counter()
        stats = plan_stats(big, rows=rows, row_len=row_len)
        dt = time.perf_counter() - t0
        lines.append(f"{rows:4d} x {row_len:<4d} {'plan only':22s} {dt:8.2f} {big.n_tokens / dt:12.0f} "
                     f"{stats.padding_fraction:8.4f}")
        for prefetch in (0, 4):
            t0 = time.perf_counter()
            it = pack_batches(big, rows=rows, row_len=row_len, prefetch=prefetch)
            for _ in it:
                pass
            dt = time.perf_counter() - t0
            what = "packed, caller thread" if prefetch == 0 else "packed, prefetch=4"
            lines.append(f"{rows:4d} x {row_len:<4d} {what:22s} {dt:8.2f} {big.n_tokens / dt:12.0f} "
                         f"{it.stats.padding_fraction:8.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller inputs")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(DATA / "gpt-neox-20b-tokenizer.json"))
    load = os.getloadavg()[0]
    lines = [f"# bench_data: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
             f"(load average {load:.1f} at start), "
             f"python {sys.version.split()[0]}, numpy {np.__version__}, tokenizers {tokenizers.__version__}, "
             f"splitter {SPLITTER}"]
    bench_splitters(lines, args.quick)
    cache = bench_tokenize(lines, tok, copies=1 if args.quick else 4)
    bench_packing(lines, cache, times=4 if args.quick else 10)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_data.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
