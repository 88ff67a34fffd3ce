"""First runs: tokenizing while the devices measure. The batches packed from a token cache that is
still being written (data.TokenStream) are those of the finished cache, and a streamed run's
metrics those of a cached run. CPU, offline."""

import collections
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import build_hf_checkpoint
from isojax.data import TokenStream, load_corpus, pack_batches, plan_stats, stream_tokens, tokenize_corpus
from isojax.data import tokens as tokens_mod
from isojax.errors import UserError
from isojax.extract import main

DATA = Path(__file__).resolve().parent / "data"  # excerpts: characters 20,000-70,000 of each book
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "isojax" / "data" / "gpt-neox-20b-tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def write_sources(folder: Path, seed: int = 0) -> list[str]:
    """Three inputs: a JSON lines file of two Pile sources interleaved unevenly (one record with no
    text, skipped), and two text files (labelled by their names), from the two books."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paras = {name: [p for p in (DATA / f"{name}.txt").read_text()[10_000:50_000].split("\n\n") if p.strip()]
             for name in ("moby-dick", "tinyshakespeare")}
    with open(folder / "pile.jsonl", "w") as f:
        for i in range(80):
            source = "Books3" if rng.random() < 0.7 else "PG-19"
            f.write(json.dumps({"text": paras["moby-dick"][i], "meta": {"pile_set_name": source}}) + "\n")
            if i == 3:
                f.write(json.dumps({"body": "no text", "meta": {"pile_set_name": "Skipped"}}) + "\n")
    (folder / "shakespeare.txt").write_text("\n\n".join(paras["tinyshakespeare"][:60]))
    (folder / "moby.txt").write_text("\n\n".join(paras["moby-dick"][80:140]))
    return [str(folder / "pile.jsonl"), str(folder / "shakespeare.txt"), str(folder / "moby.txt")]


class Views(list):
    hold = 1  # chunks built before the builder waits for the packer to take a partial cache
    lockstep = True  # and then one more chunk for each partial cache the packer takes

    def __init__(self):
        super().__init__()
        self.changed = threading.Condition()
        self.chunks = collections.Counter()  # builder thread -> chunks it built
        self.partial = collections.Counter()  # builder thread -> partial caches the packer took of it
        self.cancelled = set()

    @property
    def built(self) -> int:
        return sum(self.chunks.values())


@pytest.fixture
def slow_small_chunks(monkeypatch):
    """Chunks of a few paragraphs, built in step with the packer (an order, at any speed): after
    views.hold chunks the builder waits until the packer has taken a partial cache, and with
    views.lockstep builds one more chunk for each partial cache the packer takes, so the packer
    follows a growing cache chunk by chunk and the build never ends before the packer started
    (nor before a cancel, when the packer stops asking). Records which views the packer got
    (partial: False, finished: True)."""
    monkeypatch.setattr(tokens_mod, "_CHUNK_CHARS_IN_PROCESS", 2000)
    encode = tokens_mod.encode_chunk

    def in_step(*args, **kwargs):
        me = threading.current_thread()
        if me.name != "isojax-tokenize":  # tokenize_corpus: no packer follows it
            return encode(*args, **kwargs)
        if views.hold and views.chunks[me] >= views.hold:
            need = views.chunks[me] - views.hold + 1 if views.lockstep else 1
            with views.changed:  # the timeout only keeps a broken test from hanging: the asserts then fail
                views.changed.wait_for(lambda: me in views.cancelled or views.partial[me] >= need, timeout=120)
        views.chunks[me] += 1
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokens_mod, "encode_chunk", in_step)
    views = Views()
    wait, cancel = TokenStream.wait, TokenStream.cancel

    def recorded(self, n, timeout=None):
        got = wait(self, n, timeout)
        if got is not None:
            with views.changed:
                views.append(got[1])
                views.partial[self._thread] += not got[1]
                views.changed.notify_all()
        return got

    def cancelled(self):
        with views.changed:
            views.cancelled.add(self._thread)
            views.changed.notify_all()
        cancel(self)

    monkeypatch.setattr(TokenStream, "wait", recorded)
    monkeypatch.setattr(TokenStream, "cancel", cancelled)
    return views


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.group == b.group and a.cursor == b.cursor
        assert (a.n_tokens, a.n_sequences) == (b.n_tokens, b.n_sequences)
        for name in ("tokens_BxT", "segment_ids_BxT", "positions_BxT", "sequences_BxT"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.slow
def test_packing_follows_a_growing_cache(tmp_path, tok, slow_small_chunks):
    paths = write_sources(tmp_path / "data")
    reference = tokenize_corpus(load_corpus(paths), tok, cache_dir=tmp_path / "ref", max_len=48, workers=1)
    stream = stream_tokens(load_corpus(paths), tok, cache_dir=tmp_path / "c", max_len=48, workers=1)
    assert isinstance(stream, TokenStream)
    got = list(pack_batches(stream, rows=3, row_len=48))
    assert slow_small_chunks.count(False) > 5 and slow_small_chunks[-1]  # it followed partial caches, chunk by chunk
    assert slow_small_chunks.count(False) >= slow_small_chunks.built - 1
    want = list(pack_batches(reference, rows=3, row_len=48, prefetch=0))
    assert len({b.group for b in want}) == 4 and len(want) > 40
    assert_same_batches(got, want)
    cache = stream.result()
    assert cache.source_names == reference.source_names == ["Books3", "PG-19", "shakespeare", "moby"]
    np.testing.assert_array_equal(cache.offsets, reference.offsets)
    assert plan_stats(cache, rows=3, row_len=48) == plan_stats(reference, rows=3, row_len=48)
    assert [p.name for p in (tmp_path / "c").iterdir()] == [reference.fingerprint]  # renamed, no .tmp left
    again = stream_tokens(load_corpus(paths), tok, cache_dir=tmp_path / "c", max_len=48)
    assert again.from_cache and again.n_tokens == reference.n_tokens
    # a cursor of a streamed batch resumes on the finished cache, and on another stream
    cursor = got[17].cursor
    assert_same_batches(list(pack_batches(again, rows=3, row_len=48, start_cursor=cursor)), want[18:])
    fresh = stream_tokens(load_corpus(paths), tok, cache_dir=tmp_path / "c2", max_len=48, workers=1)
    assert_same_batches(list(pack_batches(fresh, rows=3, row_len=48, start_cursor=cursor)), want[18:])


def test_labels_before_tokenizing_are_the_caches_sources(tmp_path, tok, capsys):
    paths = write_sources(tmp_path / "data")
    for kwargs in ({}, {"sources": ["PG-19", "moby", "Books3"]}, {"sources": ["moby"]}):
        corpus = load_corpus(paths, **kwargs)
        cache = tokenize_corpus(corpus, tok, cache_dir=tmp_path / "c", max_len=64, workers=1)
        assert corpus.labels() == cache.source_names
    default = load_corpus(None)
    assert default.labels() == ["pydoc-topics"]
    capsys.readouterr()
    tokenize_corpus(load_corpus(paths[:1]), tok, cache_dir=tmp_path / "w", max_len=64, workers=1)
    err = capsys.readouterr().err  # the scan itself stays quiet
    assert err.count("record has no 'text'") == 1 and "warning: " in err


def test_builder_errors_surface_and_leave_nothing(tmp_path, tok, slow_small_chunks):
    paths = write_sources(tmp_path / "data")
    bad = tmp_path / "data" / "zz-bad.txt"
    bad.write_bytes(b"fine\n\nthen \xff\n")
    stream = stream_tokens(load_corpus(paths + [str(bad)]), tok, cache_dir=tmp_path / "c", max_len=48, workers=1)
    batches = pack_batches(stream, rows=3, row_len=48)
    first = next(batches)  # the devices could start: the bad file comes last (the builder waits for them)
    assert first.n_tokens > 0 and slow_small_chunks.count(False) > 0
    with pytest.raises(UserError, match=r"zz-bad\.txt:3: invalid UTF-8"):
        list(batches)
    with pytest.raises(UserError, match="invalid UTF-8"):
        stream.result()
    assert not list((tmp_path / "c").iterdir())
    # a stream abandoned midway stops: its folder is removed, nothing is cached (the builder, in
    # step with the packer, is midway when the packer stops asking)
    stream = stream_tokens(load_corpus(paths), tok, cache_dir=tmp_path / "d", max_len=48, workers=1)
    next(pack_batches(stream, rows=3, row_len=48)).group
    assert not stream.done()
    stream.cancel()
    assert not list((tmp_path / "d").iterdir())


@pytest.mark.slow
def test_streamed_run_equals_cached_run(tmp_path, monkeypatch, slow_small_chunks):
    """measure() on a first run (tokens streaming) and again on its cache: the same metrics and
    manifest, timings and from_cache aside."""
    import isojax
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    paths = write_sources(tmp_path / "data")
    options = dict(seq_len=64, batch_tokens=256, progress=False)
    first = isojax.measure(str(tmp_path / "ckpt"), paths, **options)
    assert slow_small_chunks.count(False) >= slow_small_chunks.built - 1 > 5  # the run followed every chunk
    second = isojax.measure(str(tmp_path / "ckpt"), paths, **options)
    assert not first.manifest["from_cache"] and second.manifest["from_cache"]
    assert set(first.metrics["sources"]) == {"Books3", "PG-19", "shakespeare", "moby"}
    assert json.dumps(first.metrics) == json.dumps(second.metrics)  # bit-identical
    skip = {"timings", "step_plan_s", "seconds_wall", "seconds_device_loop", "tokens_per_second", "finished",
            "from_cache"}
    assert {k: v for k, v in first.manifest.items() if k not in skip} == \
        {k: v for k, v in second.manifest.items() if k not in skip}


@pytest.mark.slow
def test_bad_file_late_in_a_first_run_exits_cleanly(tmp_path, monkeypatch, capsys, slow_small_chunks):
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    folder = tmp_path / "texts"  # text files: no label scan reads them before the builder does
    folder.mkdir()
    paras = [p for p in (DATA / "moby-dick.txt").read_text()[10_000:50_000].split("\n\n") if p.strip()]
    for i in range(30):
        (folder / f"p{i:02}.txt").write_text(paras[i])
    (folder / "zz-bad.txt").write_bytes(b"fine\n\nthen \xff\n")
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(folder), "--seq-len", "64", "--batch-tokens", "256",
            "--no-plots", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "zz-bad.txt:3: invalid UTF-8" in err and "Traceback" not in err
    # the loop had started: the builder, in step with it, could not reach the bad file before
    assert slow_small_chunks.count(False) > 0
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert not list((tmp_path / "cache" / "tokens").iterdir())
