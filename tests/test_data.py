"""Corpus pipeline: readers, units, token cache, packing, resume, bad input. CPU, offline.

Expected token ids are computed here by encoding the texts directly with `tokenizers`.
"""

import gzip
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from isojax.data import load_corpus, pack_batches, plan_stats, split_sentences, tokenize_corpus
from isojax.data import packing, tokens as tokens_mod
from isojax.errors import UserError

DATA = Path(__file__).resolve().parent / "data"  # excerpts: characters 20,000-70,000 of each book
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "isojax" / "data" / "gpt-neox-20b-tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def records():
    """~120 documents from both books, two Pile-style sources interleaved unevenly."""
    rng = np.random.default_rng(0)
    out = []
    for book, source in (("moby-dick.txt", "Books3"), ("tinyshakespeare.txt", "Gutenberg (PG-19)")):
        text = (DATA / book).read_text()[:40_000]
        out += [{"text": p, "meta": {"pile_set_name": source}} for p in text.split("\n\n") if p.strip()][:60]
    return [out[i] for i in rng.permutation(len(out))]


def write_jsonl(path, recs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_zst(path, recs):
    data = "".join(json.dumps(r) + "\n" for r in recs).encode()
    Path(path).write_bytes(zstandard.ZstdCompressor().compress(data))
    return str(path)


def write_parquet(path, recs):
    pq.write_table(pa.Table.from_pylist(recs), path)
    return str(path)


def expected(tok, recs, sources=None):
    seqs = [(r["meta"]["pile_set_name"], encode(tok, r["text"])) for r in recs
            if sources is None or r["meta"]["pile_set_name"] in sources]
    per = {}
    for s, ids in seqs:
        per.setdefault(s, {"tokens": 0, "sequences": 0})
        per[s]["tokens"] += len(ids)
        per[s]["sequences"] += 1
    return seqs, per


def check_cache(cache, seqs, per):
    assert cache.n_sequences == len(seqs)
    assert cache.n_tokens == sum(len(ids) for _, ids in seqs)
    assert cache.source_counts() == per
    for i, (source, ids) in enumerate(seqs):
        assert cache.source_names[cache.source_ids[i]] == source
        assert cache.sequence(i).tolist() == ids


@pytest.mark.slow
def test_formats_and_sources_agree(tmp_path, tok, records):
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    a, b, c = records[:40], records[40:90], records[90:]
    write_jsonl(shards / "00.jsonl", a)
    write_jsonl(shards / "01.jsonl.gz", b, gzip.open)
    write_parquet(shards / "sub" / "02.parquet", c)  # sorted by relative path: sub/02 comes last
    (shards / "README.md").write_text("not a shard")
    variants = {
        "jsonl": [write_jsonl(tmp_path / "c.jsonl", records)],
        "gz": [write_jsonl(tmp_path / "c.jsonl.gz", records, gzip.open)],
        "zst": [write_zst(tmp_path / "c.jsonl.zst", records)],
        "parquet": [write_parquet(tmp_path / "c.parquet", records)],
        "folder": [str(shards)],
    }
    seqs, per = expected(tok, records)
    assert len(per) == 2
    for name, paths in variants.items():
        cache = tokenize_corpus(load_corpus(paths, unit="document"), tok, cache_dir=tmp_path / "cache",
                                max_len=100_000, workers=1)
        check_cache(cache, seqs, per)
    for keep in (["Books3"], ["Gutenberg (PG-19)"], ["Books3", "Gutenberg (PG-19)", "Pile-CC"]):
        s_seqs, s_per = expected(tok, records, keep)
        for paths in (variants["zst"], variants["folder"]):
            cache = tokenize_corpus(load_corpus(paths, unit="document", sources=keep), tok,
                                    cache_dir=tmp_path / "cache", max_len=100_000, workers=1)
            check_cache(cache, s_seqs, s_per)


@pytest.mark.slow
def test_worker_processes_match_in_process(tmp_path, tok, records):
    path = write_jsonl(tmp_path / "c.jsonl", records * 3)
    one = tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp_path / "a", max_len=64, workers=1)
    two = tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp_path / "b", max_len=64, workers=2)
    assert one.fingerprint == two.fingerprint and not two.from_cache
    np.testing.assert_array_equal(one.tokens, two.tokens)
    np.testing.assert_array_equal(one.offsets, two.offsets)
    np.testing.assert_array_equal(one.source_ids, two.source_ids)


def test_sentences_of_txt(tmp_path, tok):
    sents = ['Mr. Smith met Dr. Jones at 5 p.m. on Baker St. yesterday.', 'They talked.',
             '"Where are you going?" she asked.', '"Home," he said.', 'He paused...', 'Then he left.']
    text = "\ufeff" + " ".join(sents[:3]) + "\n" + " ".join(sents[3:5]) + "\n\n  " + sents[5] + "\n"
    (tmp_path / "story.txt").write_text(text, encoding="utf-8")
    cache = tokenize_corpus(load_corpus([str(tmp_path / "story.txt")]), tok, cache_dir=tmp_path / "c",
                            max_len=2048, workers=1)
    assert [cache.sequence(i).tolist() for i in range(cache.n_sequences)] == [encode(tok, s) for s in sents]
    assert cache.source_names == ["story"]


def test_long_sequences_split_into_windows(tmp_path, tok, records):
    path = write_jsonl(tmp_path / "c.jsonl", records)
    seqs, _ = expected(tok, records)
    cache = tokenize_corpus(load_corpus([path], unit="document"), tok, cache_dir=tmp_path / "c",
                            max_len=16, workers=1)
    windows = [cache.sequence(i).tolist() for i in range(cache.n_sequences)]
    want = [ids[k:k + 16] for _, ids in seqs for k in range(0, len(ids), 16)]
    assert windows == want
    assert cache.n_tokens == sum(len(ids) for _, ids in seqs)


@pytest.mark.slow
def test_default_corpus(tmp_path, tok):
    from pydoc_data.topics import topics

    cache = tokenize_corpus(load_corpus(None, unit="document"), tok, cache_dir=tmp_path, max_len=10**6, workers=1)
    assert cache.source_names == ["pydoc-topics"]
    assert cache.n_tokens == sum(len(encode(tok, t)) for t in topics.values() if t.strip())
    sent = tokenize_corpus(load_corpus([]), tok, cache_dir=tmp_path, max_len=2048, workers=1)
    assert sent.n_sequences > 10 * cache.n_sequences


def test_transformers_tokenizer_shares_cache(tmp_path, tok, records):
    from transformers import PreTrainedTokenizerFast

    path = write_jsonl(tmp_path / "c.jsonl", records[:10])
    hf = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON))
    first = tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    again = tokenize_corpus(load_corpus([path]), hf, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert again.from_cache and again.fingerprint == first.fingerprint


def test_hub_local_stand_in(tmp_path, tok, records):
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", records[:20])
    seqs, per = expected(tok, records[:20])
    cache = tokenize_corpus(load_corpus([f"hub:{tmp_path / 'ds'}:train"], unit="document"), tok,
                            cache_dir=tmp_path / "c", max_len=10**6, workers=1)
    check_cache(cache, seqs, per)


@pytest.fixture(scope="module")
def packed_cache(tmp_path_factory, tok, records):
    tmp = tmp_path_factory.mktemp("pack")
    path = write_jsonl(tmp / "c.jsonl", records)
    return tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp / "c", max_len=48, workers=1)


def unpack(batch):
    """[(group, token list)] of a batch, checking segment ids, positions and padding."""
    out = []
    for toks, segs, pos in zip(batch.tokens_BxT, batch.segment_ids_BxT, batch.positions_BxT):
        n_real = int((segs > 0).sum())
        assert (segs[n_real:] == 0).all() and (toks[n_real:] == 0).all() and (pos[n_real:] == 0).all()
        real = segs[:n_real]
        assert (np.diff(real) >= 0).all() and (np.diff(real) <= 1).all() and (n_real == 0 or real[0] == 1)
        for s in range(1, int(real.max(initial=0)) + 1):
            where = np.flatnonzero(segs == s)
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            out.append((batch.group, toks[where].tolist()))
    return out


@pytest.mark.parametrize("plan_chunk", [None, 7])
def test_packing_round_trips(packed_cache, monkeypatch, plan_chunk):
    if plan_chunk:
        monkeypatch.setattr(packing, "_PLAN_CHUNK", plan_chunk)
    cache = packed_cache
    it = pack_batches(cache, rows=4, row_len=64, prefetch=2)
    batches = list(it)
    got = [seq for b in batches for seq in unpack(b)]
    want = [(int(cache.source_ids[i]), cache.sequence(i).tolist()) for i in range(cache.n_sequences)]
    assert sorted(got) == sorted(want)
    # each batch holds the next contiguous run of its source's sequences (in any row order),
    # and a batch closed only because its successor's first sequence fitted in none of its rows
    seen = {}
    for k, b in enumerate(batches):
        source_seqs = [t for s, t in want if s == b.group]
        start = seen.get(b.group, 0)
        in_batch = [t for _, t in unpack(b)]
        assert sorted(in_batch) == sorted(source_seqs[start:start + len(in_batch)])
        seen[b.group] = start + len(in_batch)
        if seen[b.group] < len(source_seqs):
            room = 64 - (b.segment_ids_BxT > 0).sum(axis=1)
            assert room.max() < len(source_seqs[seen[b.group]])
    assert seen == {s: sum(1 for g, _ in want if g == s) for s, _ in want}
    assert all(b.tokens_BxT.shape == (4, 64) and b.tokens_BxT.dtype == np.int32 for b in batches)
    assert sum(b.n_tokens for b in batches) == cache.n_tokens
    stats = plan_stats(cache, rows=4, row_len=64)
    assert stats.batches == len(batches) and it.stats.tokens == stats.tokens == cache.n_tokens
    assert it.stats.padding_fraction == pytest.approx(1 - cache.n_tokens / (len(batches) * 4 * 64))
    with pytest.raises(ValueError):
        pack_batches(cache, rows=4, row_len=32)  # shorter than max_len-sized windows


def test_resume_from_cursor(packed_cache):
    batches = list(pack_batches(packed_cache, rows=3, row_len=48, prefetch=0))
    assert len(batches) > 10
    for k in (0, 5, len(batches) - 2, len(batches) - 1):
        cursor = json.loads(json.dumps(batches[k].cursor))
        rest = list(pack_batches(packed_cache, rows=3, row_len=48, start_cursor=cursor))
        assert len(rest) == len(batches) - k - 1
        for x, y in zip(rest, batches[k + 1:]):
            assert x.group == y.group and x.cursor == y.cursor
            np.testing.assert_array_equal(x.tokens_BxT, y.tokens_BxT)
            np.testing.assert_array_equal(x.segment_ids_BxT, y.segment_ids_BxT)
    with pytest.raises(UserError, match="cursor"):
        pack_batches(packed_cache, rows=4, row_len=48, start_cursor=batches[3].cursor)


def test_abandoned_iterator_stops_its_thread(packed_cache):
    it = pack_batches(packed_cache, rows=2, row_len=48, prefetch=2)
    first = next(it)
    thread = it._thread
    it.close()
    assert not thread.is_alive() and first.cursor["next_batch"] == 1
    with pytest.raises(StopIteration):
        next(it)


def test_cache_reuse_and_invalidation(tmp_path, tok, records, monkeypatch):
    path = tmp_path / "c.jsonl"
    write_jsonl(path, records[:30])
    first = tokenize_corpus(load_corpus([str(path)]), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert not first.from_cache

    def boom(*a, **k):
        raise AssertionError("re-tokenized")

    monkeypatch.setattr(tokens_mod, "encode_chunk", boom)
    again = tokenize_corpus(load_corpus([str(path)]), tok, cache_dir=tmp_path / "c", max_len=32, workers=1)
    assert again.from_cache and again.fingerprint == first.fingerprint and again.n_tokens == first.n_tokens
    # a changed corpus, unit or sources filter is a new cache: tokenizing now crashes, and the
    # crash leaves no cache behind that a later run would trust
    write_jsonl(path, records[:31])
    for corpus in (load_corpus([str(path)]), load_corpus([str(path)], unit="document"),
                   load_corpus([str(path)], sources=["Books3"])):
        with pytest.raises(AssertionError, match="re-tokenized"):
            tokenize_corpus(corpus, tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [first.fingerprint]
    monkeypatch.undo()
    fresh = tokenize_corpus(load_corpus([str(path)]), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert not fresh.from_cache and fresh.fingerprint != first.fingerprint
    assert fresh.n_tokens == first.n_tokens + sum(len(encode(tok, s)) for s in split_sentences(records[30]["text"]))


def bad_case(tmp_path, name):
    """-> (paths, load_corpus kwargs, regex the UserError must match)."""
    p = tmp_path / "bad"
    p.mkdir(exist_ok=True)
    good = json.dumps({"text": "Fine."})
    if name == "missing":
        return [str(p / "nope.jsonl")], {}, r"nope\.jsonl: no such file"
    if name == "suffix":
        (p / "x.csv").write_text("a,b\n")
        return [str(p / "x.csv")], {}, r"x\.csv: unsupported file type"
    if name == "empty_folder":
        (p / "empty").mkdir()
        return [str(p / "empty")], {}, r"empty: folder holds no"
    if name == "empty_corpus":
        (p / "e.txt").write_text("\n  \n")
        return [str(p / "e.txt")], {}, r"e\.txt: corpus has no text"
    if name == "undecodable_txt":
        (p / "u.txt").write_bytes(b"line one\nline two \xff\xfe here\n")
        return [str(p / "u.txt")], {}, r"u\.txt:2: invalid UTF-8 byte 0xff at column 10"
    if name == "undecodable_jsonl":
        (p / "u.jsonl").write_bytes(good.encode() + b'\n{"text": "caf\xe9"}\n')
        return [str(p / "u.jsonl")], {"max_bad_records": 0}, r"u\.jsonl:2: invalid UTF-8"
    if name == "malformed_jsonl":
        (p / "m.jsonl").write_text(f"{good}\n{good}\n{{\"text\": \"cut\n")
        return [str(p / "m.jsonl")], {"max_bad_records": 0}, r"m\.jsonl:3: malformed JSON"
    if name == "no_text":
        (p / "t.jsonl").write_text(f'{good}\n{{"body": "x"}}\n')
        return [str(p / "t.jsonl")], {"max_bad_records": 0}, r"t\.jsonl:2: record has no 'text' field"
    if name == "truncated_gz":
        data = gzip.compress(("\n".join([good] * 2000) + "\n").encode())
        (p / "g.jsonl.gz").write_bytes(data[: len(data) // 2])
        return [str(p / "g.jsonl.gz")], {}, r"g\.jsonl\.gz:\d+: corrupt or truncated"
    if name == "parquet_no_text":
        write_parquet(p / "n.parquet", [{"body": "x"}])
        return [str(p / "n.parquet")], {}, r"n\.parquet:1: no 'text' column"
    if name == "sources_filter_empty":
        write_jsonl(p / "s.jsonl", [{"text": "A b.", "meta": {"pile_set_name": "Pile-CC"}}])
        return [str(p / "s.jsonl")], {"sources": ["ArXiv"]}, r"s\.jsonl: corpus has no text.*Pile-CC"
    raise KeyError(name)


@pytest.mark.parametrize("name", ["missing", "suffix", "empty_folder", "empty_corpus", "undecodable_txt",
                                  "undecodable_jsonl", "malformed_jsonl", "no_text", "truncated_gz",
                                  "parquet_no_text", "sources_filter_empty"])
def test_bad_input_is_a_user_error(tmp_path, tok, name):
    paths, kwargs, pattern = bad_case(tmp_path, name)
    with pytest.raises(UserError, match=pattern):
        tokenize_corpus(load_corpus(paths, **kwargs), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert not list((tmp_path / "c").glob(".tmp*"))  # a failed build leaves nothing behind


def test_a_few_bad_records_are_skipped_with_warnings(tmp_path, tok, capsys):
    lines = [json.dumps({"text": f"Record {i}."}) for i in range(6)]
    lines[1] = "{oops"
    lines[4] = json.dumps({"meta": {}})
    (tmp_path / "f.jsonl").write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning, with its source line: isojax's warning: lines
        cache = tokenize_corpus(load_corpus([str(tmp_path / "f.jsonl")]), tok, cache_dir=tmp_path / "c",
                                max_len=64, workers=1)
    lines = capsys.readouterr().err.splitlines()
    path = tmp_path / "f.jsonl"
    assert lines == [f"isojax: warning: {path}:2: malformed JSON (Expecting property name enclosed in double quotes "
                     "at column 2); record skipped",
                     f"isojax: warning: {path}:5: record has no 'text' field; record skipped",
                     f"isojax: warning: {path}: skipped 2 bad records in total"]
    assert cache.n_sequences == 4 and cache.meta["bad_records"] == 2
    assert cache.n_tokens == sum(len(encode(tok, f"Record {i}.")) for i in (0, 2, 3, 5))


def test_no_special_tokens_and_no_truncation(tmp_path, records):
    from tokenizers.processors import TemplateProcessing

    bos = Tokenizer.from_file(str(TOKENIZER_JSON))
    bos.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    bos.enable_truncation(8)
    assert bos.encode("Call me Ishmael, please.").ids[0] == 0  # the tokenizer alone would add and cut
    path = write_jsonl(tmp_path / "c.jsonl", records[:10])
    cache = tokenize_corpus(load_corpus([path], unit="document"), bos, cache_dir=tmp_path / "c", max_len=10**6,
                            workers=1)
    plain = Tokenizer.from_file(str(TOKENIZER_JSON))
    check_cache(cache, *expected(plain, records[:10]))


def test_damaged_cache_is_rebuilt(tmp_path, tok, records, capsys):  # more damage: tests/test_data_integrity.py
    path = write_jsonl(tmp_path / "c.jsonl", records[:5])
    cache = tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    ids = np.array(cache.tokens)
    with open(cache.path / "tokens.bin", "r+b") as f:
        f.truncate(8)
    capsys.readouterr()
    again = tokenize_corpus(load_corpus([path]), tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert re.fullmatch(rf"isojax: warning: token cache {re.escape(str(cache.path))} is damaged \(tokens.bin: 8 bytes, "
                        r"expected \d+\); rebuilding it\n", capsys.readouterr().err)
    assert not again.from_cache and np.array_equal(again.tokens, ids)


def test_a_found_cache_is_opened_without_copying_a_plain_tokenizer(tmp_path, records, monkeypatch):
    """The copy of the tokenizer (Tokenizer.from_str, ~0.13 s at Pythia's, each checkpoint of a sweep)
    is made only to build a cache or where the tokenizer truncates or pads; the key is the copy's, so a
    truncating tokenizer (copied, its truncation off) finds the plain one's cache."""
    import isojax.data.tokens as tokens
    path = write_jsonl(tmp_path / "c.jsonl", records[:5])
    plain = Tokenizer.from_file(str(TOKENIZER_JSON))
    built = tokenize_corpus(load_corpus([path]), plain, cache_dir=tmp_path / "c", max_len=64, workers=1)
    copies = []
    copy = tokens.backend_tokenizer
    monkeypatch.setattr(tokens, "backend_tokenizer", lambda t: copies.append(t) or copy(t))
    again = tokenize_corpus(load_corpus([path]), plain, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert again.from_cache and again.path == built.path and copies == []
    cut = Tokenizer.from_file(str(TOKENIZER_JSON))
    cut.enable_truncation(8)
    third = tokenize_corpus(load_corpus([path]), cut, cache_dir=tmp_path / "c", max_len=64, workers=1)
    assert third.from_cache and third.path == built.path and copies == [cut] and cut.truncation is not None
    assert np.array_equal(np.asarray(third.tokens), np.asarray(built.tokens))
