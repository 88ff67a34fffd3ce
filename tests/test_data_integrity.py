"""Issue 26, inputs and the token cache: inputs that end early are errors, a damaged cache is
rebuilt (never read), memory stays bounded for one huge record, and a killed build leaves no
worker processes and no `.tmp-*` folder behind. CPU, offline."""

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from isojax.data import load_corpus, tokenize_corpus, units
from isojax.data import tokens as tokens_mod
from isojax.errors import UserError

DATA = Path(__file__).resolve().parent / "data"  # excerpts: characters 20,000-70,000 of each book
TOKENIZER = Path(__file__).resolve().parents[1] / "isojax" / "data" / "gpt-neox-20b-tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER))


def book(n, name="moby-dick.txt"):
    """n characters of the book's excerpt, repeated as often as n needs."""
    text = (DATA / name).read_text()
    return (text * (n // len(text) + 1))[:n]


def records(n=400):
    """Distinct records (a zstd frame of near-duplicates would be one block: nothing before a cut)."""
    paras = [p for p in book(400_000).split("\n\n") if p.strip()]
    return [{"text": paras[i % len(paras)] + f" ({i})", "meta": {"pile_set_name": "Books3"}} for i in range(n)]


def jsonl_bytes(recs):
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def build(paths, tok, cache_dir, **kwargs):
    return tokenize_corpus(load_corpus(paths, **kwargs), tok, cache_dir=cache_dir, max_len=64, workers=1)


# ---- inputs that end early are errors, naming the file ----

@pytest.mark.parametrize("frames", [1, 2])
def test_truncated_zstd_is_an_error(tmp_path, tok, frames):
    recs = records()
    first = jsonl_bytes(recs[:150]) if frames == 2 else b""  # today: 150 of 400 records, exit 0
    last = zstandard.ZstdCompressor().compress(jsonl_bytes(recs[150:] if frames == 2 else recs))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes((zstandard.ZstdCompressor().compress(first) if first else b"") + last[: len(last) // 2])
    with pytest.raises(UserError, match=r"cut\.jsonl\.zst:\d+: corrupt or truncated .*ends inside a zstd frame"):
        build([str(path)], tok, tmp_path / "c")
    assert not list((tmp_path / "c").glob(".tmp*"))


def test_zstd_of_several_frames_reads_them_all(tmp_path, tok):
    recs = records()
    raw = [jsonl_bytes(recs[:150]), jsonl_bytes(recs[150:])]  # as pzstd and `zstd -T` write
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(r) for r in raw))
    texts = [t for _, t in load_corpus([str(path)]).documents()]
    assert texts == [r["text"] for r in recs]


def test_gzip_with_a_corrupt_body_is_an_error(tmp_path, tok):
    data = bytearray(gzip.compress(jsonl_bytes(records())))
    for i in range(1000, 1064):
        data[i] ^= 0xFF  # today: zlib.error ("invalid distance too far back"), a traceback
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"bad\.jsonl\.gz:\d+: corrupt or truncated compressed data"):
        build([str(path)], tok, tmp_path / "c")


def test_corrupt_and_truncated_parquet_are_errors(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(records()), path, row_group_size=50, compression="zstd")
    data = bytearray(path.read_bytes())
    (tmp_path / "cut.parquet").write_bytes(bytes(data[: len(data) // 2]))
    data[len(data) // 2: len(data) // 2 + 300] = bytes(300)  # a row group's pages; the footer intact
    (tmp_path / "bad.parquet").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"cut\.parquet: not a readable parquet file"):
        build([str(tmp_path / "cut.parquet")], tok, tmp_path / "c")
    with pytest.raises(UserError, match=r"bad\.parquet: corrupt parquet data"):
        build([str(tmp_path / "bad.parquet")], tok, tmp_path / "c")


# ---- the token cache proves its integrity ----

@pytest.fixture
def cached(tmp_path, tok):
    """(input paths, cache dir, the cache's folder, its arrays) of a two-source corpus."""
    recs = records(60)
    for i, r in enumerate(recs):
        r["meta"]["pile_set_name"] = ["Books3", "PG-19"][i % 2]
    path = tmp_path / "c.jsonl"
    path.write_bytes(jsonl_bytes(recs))
    cache = build([str(path)], tok, tmp_path / "cache")
    arrays = {name: np.fromfile(cache.path / name, dtype) for name, dtype in
              (("tokens.bin", np.int32), ("offsets.bin", np.int64), ("source_ids.bin", np.int16))}
    return [str(path)], tmp_path / "cache", cache.path, arrays


def _poke(folder, name, dtype, index, value, fix_checksum):
    a = np.fromfile(folder / name, dtype)
    a[index] = value
    a.tofile(folder / name)
    if fix_checksum:  # so that the id range checks are what catches it
        meta = json.loads((folder / "meta.json").read_text())
        meta["crc32"][name] = zlib.crc32(a.tobytes())
        (folder / "meta.json").write_text(json.dumps(meta))


DAMAGE = {
    "token_minus_one": (lambda f: _poke(f, "tokens.bin", np.int32, 5, -1, False), r"tokens\.bin: checksum mismatch"),
    "token_replaced": (lambda f: _poke(f, "tokens.bin", np.int32, 7, 123, False), r"tokens\.bin: checksum mismatch"),
    "token_minus_one_crc_fixed": (lambda f: _poke(f, "tokens.bin", np.int32, 5, -1, True),
                                  r"tokens\.bin: token ids outside the tokenizer's vocabulary \(-1 at 5; allowed 0\.\.50280\)"),
    "token_huge_crc_fixed": (lambda f: _poke(f, "tokens.bin", np.int32, 9, 0x7F7F7F7F, True),
                             r"tokens\.bin: token ids outside .*\(2139062143 at 9; allowed 0\.\.50280\)"),
    "source_id_crc_fixed": (lambda f: _poke(f, "source_ids.bin", np.int16, 3, 2, True),
                            r"source_ids\.bin: source ids outside source_names"),
    "offsets_crc_fixed": (lambda f: _poke(f, "offsets.bin", np.int64, 4, 1, True),
                          r"offsets\.bin: offsets do not rise"),
    "tokens_truncated": (lambda f: os.truncate(f / "tokens.bin", 40), r"tokens\.bin: 40 bytes, expected"),
    "source_ids_missing": (lambda f: (f / "source_ids.bin").unlink(), r"source_ids\.bin: missing"),
    "meta_truncated": (lambda f: os.truncate(f / "meta.json", 30), r"meta\.json: JSONDecodeError"),
    "meta_no_source_names": (lambda f: (f / "meta.json").write_text(json.dumps(
        {k: v for k, v in json.loads((f / "meta.json").read_text()).items() if k != "source_names"})),
        r"meta\.json: KeyError: 'source_names'"),
    "meta_missing": (lambda f: (f / "meta.json").unlink(), r"meta\.json: FileNotFoundError"),
}
FAST_DAMAGE = {"token_minus_one_crc_fixed", "tokens_truncated", "meta_missing"}  # the rest: -m slow


@pytest.mark.parametrize("damage", [pytest.param(d, marks=[] if d in FAST_DAMAGE else pytest.mark.slow) for d in DAMAGE])
def test_a_damaged_cache_is_rebuilt_with_a_warning(cached, tok, damage, capsys):
    paths, cache_dir, folder, arrays = cached
    harm, why = DAMAGE[damage]
    harm(folder)
    capsys.readouterr()
    again = build(paths, tok, cache_dir)
    assert re.fullmatch(rf"isojax: warning: token cache \S*{folder.name} is damaged \({why}.*\); rebuilding it\n",
                        capsys.readouterr().err)
    assert not again.from_cache and again.path == folder and again.source_names == ["Books3", "PG-19"]
    for name, a in arrays.items():
        np.testing.assert_array_equal(np.fromfile(folder / name, a.dtype), a)
    assert sorted(p.name for p in cache_dir.iterdir()) == [folder.name]  # the damaged copy is gone
    assert build(paths, tok, cache_dir).from_cache  # and the rebuilt one passes its checks


def test_meta_holds_checksums_of_the_files(cached):
    _, _, folder, arrays = cached
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["crc32"] == {name: zlib.crc32((folder / name).read_bytes()) for name in arrays}


# ---- bounded memory for any record ----

@pytest.mark.slow
def test_a_long_paragraph_is_split_a_window_at_a_time(monkeypatch):
    one = " ".join(book(100_000).split())  # one paragraph, as a one-line file is
    whole = units.split_sentences(one)
    monkeypatch.setattr(units, "_WINDOW", 3000, raising=False)
    assert units.split_sentences(one) == whole  # the same sentences
    long_sentence = "word " * 3000 + "end. Next one."  # a window with no sentence end is a unit
    pieces = units.split_sentences(long_sentence)
    assert " ".join(pieces) == long_sentence.strip() and pieces[-1] == "Next one." and pieces[-2].endswith("end.")
    assert all(len(p) <= 3000 for p in pieces) and len(pieces) > 5
    tracemalloc.start()
    try:
        units.split_sentences(one)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * len(one), peak  # today: ~40 bytes a character (syntok's tokens of all of it)


@pytest.mark.parametrize("window", [1 << 16, 2000])
def test_sentences_of_normal_text_are_syntoks_of_each_whole_paragraph(monkeypatch, window):
    """Reference: syntok itself over each whole paragraph (whitespace collapsed by str.split), no
    windows, no pieces; windows of 2000 characters cut every paragraph of the books' excerpts."""
    from syntok.segmenter import split
    from syntok.tokenizer import Tokenizer as Words

    monkeypatch.setattr(units, "_WINDOW", window)
    for name in ("moby-dick.txt", "tinyshakespeare.txt"):
        text = (DATA / name).read_text()
        for block in [text, " ".join(text.split())]:  # its paragraphs, and all of it as one
            want = []
            for para in (" ".join(b.split()) for b in block.split("\n\n") if b.strip()):
                starts = [sent[0].offset for sent in split(Words().tokenize(para)) if sent]
                starts[0] = 0
                want += [para[a:b].strip() for a, b in zip(starts, starts[1:] + [len(para)])]
            assert max(map(len, want)) < window * 7 // 8
            assert units.split_sentences(block) == want


def test_a_long_unit_is_tokenized_in_bounded_pieces(monkeypatch, tok):
    text = book(200_000).replace("the", "the    \t x")  # runs of whitespace: added tokens in GPT-NeoX
    seen = []

    class Spy:
        def encode_batch_fast(self, texts, **kw):
            seen.append([len(t) for t in texts])
            return tok.encode_batch_fast(texts, **kw)

    monkeypatch.setattr(tokens_mod, "_PIECE_CHARS", 3000)
    monkeypatch.setattr(tokens_mod, "_ENCODE_CHARS", 20_000)
    lengths, srcs, flat = tokens_mod.encode_chunk("document", [text, "Short one."], [0, 1], Spy())
    assert flat.tolist() == tok.encode(text, add_special_tokens=False).ids + tok.encode("Short one.").ids
    assert lengths.tolist() == [len(flat) - len(tok.encode("Short one.").ids), len(tok.encode("Short one.").ids)]
    assert srcs.tolist() == [0, 1]
    assert max(max(s) for s in seen) <= 3000 and max(map(sum, seen)) < 20_000 + 3000


# ---- nothing left behind ----

def _workers(pid):
    """The pool workers (multiprocessing spawn_main) started by process pid."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_build_leaves_no_workers_and_its_tmp_folder_is_cleaned(tmp_path, tok):
    text = " ".join(book(1_000_000).split())
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):  # 6 MB: a few 1 MB worker tasks
        (folder / f"t{i}.txt").write_text(text)
    script = ("import sys\nfrom tokenizers import Tokenizer\nfrom isojax.data import load_corpus, tokenize_corpus\n"
              f"tokenize_corpus(load_corpus([{str(folder)!r}]), Tokenizer.from_file({str(TOKENIZER)!r}), "
              f"cache_dir={str(tmp_path / 'cache')!r}, max_len=64, workers=2)\n")
    # the workers stop at their first task: the build is unfinished when it is killed, at any speed
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "ISOJAX_FAULT": "tokenize_chunk:hold"})
    try:
        deadline = time.time() + 120
        while len(_workers(proc.pid)) < 2 or not list((tmp_path / "cache").glob(".tmp-*/tokens.bin")):
            assert proc.poll() is None and time.time() < deadline, "the build ended or never started its workers"
            time.sleep(0.2)
        workers = _workers(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 60  # they end within a second of it (tokens.py); a loaded machine is slower
    while any(map(_running, workers)) and time.time() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if _running(pid)]
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, "worker processes outlived their killed parent"
    stale = list((tmp_path / "cache").glob(".tmp-*"))
    assert len(stale) == 1 and (stale[0] / "writer").read_text().split() == [socket.gethostname(), str(proc.pid)]
    (tmp_path / "small.txt").write_text("A small corpus. Built next.")
    build([str(tmp_path / "small.txt")], tok, tmp_path / "cache")  # the next build in that folder
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_only_stale_tmp_folders_are_cleaned(tmp_path):
    cache_dir = tmp_path / "cache"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    folders = {"dead": f"{host} {dead.pid}", "alive": f"{host} {os.getpid()}", "other_host": f"elsewhere {dead.pid}",
               "young_no_writer": None, "old_no_writer": None, "old_other_host": f"elsewhere {os.getpid()}"}
    for name, writer in folders.items():
        (cache_dir / f".tmp-{name}").mkdir(parents=True)
        (cache_dir / f".tmp-{name}" / "tokens.bin").write_bytes(b"x")
        if writer:
            (cache_dir / f".tmp-{name}" / "writer").write_text(writer)
        if name.startswith("old"):
            old = time.time() - 2 * 86400
            for p in [*(cache_dir / f".tmp-{name}").iterdir(), cache_dir / f".tmp-{name}"]:
                os.utime(p, (old, old))
    (cache_dir / "finished").mkdir()  # a finished cache is never touched
    tmp = tokens_mod._new_tmp(cache_dir, "k")
    left = sorted(p.name for p in cache_dir.iterdir())
    assert left == sorted([".tmp-alive", ".tmp-other_host", ".tmp-young_no_writer", "finished", tmp.name])
