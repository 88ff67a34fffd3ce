"""--max-tokens is a budget spread over the sources: each source's first share of tokens, read and
tokenized no further than that. References: the full corpus's token cache, cut by hand."""

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from isojax.data import load_corpus, readers, tokenize_corpus, units
from isojax.data import tokens as tokens_mod
from isojax.errors import UserError

DATA = Path(__file__).resolve().parent / "data"
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "isojax" / "data" / "gpt-neox-20b-tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def write_sources(folder: Path) -> list[str]:
    """Two text files one after the other, then a JSON lines file of two sources interleaved."""
    folder.mkdir(parents=True, exist_ok=True)
    moby, shakespeare = ((DATA / f"{n}.txt").read_text()[:30_000] for n in ("moby-dick", "tinyshakespeare"))
    (folder / "a.txt").write_text(moby[:15_000])
    (folder / "b.txt").write_text(shakespeare[:15_000])
    paras = [p for p in moby[15_000:].split("\n\n") + shakespeare[15_000:].split("\n\n") if p.strip()]
    with open(folder / "pile.jsonl", "w") as f:
        for i, p in enumerate(paras):
            f.write(json.dumps({"text": p, "meta": {"pile_set_name": "Books3" if i % 3 else "PG-19"}}) + "\n")
    return [str(folder / "a.txt"), str(folder / "b.txt"), str(folder / "pile.jsonl")]


def per_source(cache):
    """{source: (its sequences' lengths, its tokens)} in corpus order."""
    lengths = np.diff(np.asarray(cache.offsets))
    out = {}
    for i, name in enumerate(cache.source_names):
        mine = np.flatnonzero(np.asarray(cache.source_ids) == i)
        toks = [np.asarray(cache.tokens[cache.offsets[j]:cache.offsets[j + 1]]) for j in mine]
        out[name] = (lengths[mine], np.concatenate(toks) if toks else np.zeros(0, np.int32))
    return out


def cut(lengths, toks, share):
    """The reference: a source's first `share` tokens, the sequence that fills it cut."""
    ends = np.cumsum(lengths)
    kept = np.clip(share - (ends - lengths), 0, lengths)
    return kept[kept > 0], toks[:share]


@pytest.mark.parametrize("budget, share", [
    (dict(max_tokens=4000), 1000),  # 4 sources: 1000 each
    (dict(max_tokens_per_source=700), 700),
    (dict(max_tokens=4000, max_tokens_per_source=700), 700),  # both: the smaller
    (dict(max_tokens=2000, max_tokens_per_source=700), 500),
])
def test_each_source_gets_its_share_of_the_full_corpus(tmp_path, tok, budget, share):
    paths = write_sources(tmp_path / "data")
    full = tokenize_corpus(load_corpus(paths), tok, cache_dir=tmp_path / "c", max_len=10_000, workers=1)
    got = tokenize_corpus(load_corpus(paths, **budget), tok, cache_dir=tmp_path / "c", max_len=10_000, workers=1)
    assert got.source_names == full.source_names == ["a", "b", "PG-19", "Books3"]
    want, have = per_source(full), per_source(got)
    for name in full.source_names:
        assert len(want[name][1]) > share  # every source is longer than its share
        ref_lengths, ref_tokens = cut(*want[name], share)
        np.testing.assert_array_equal(have[name][0], ref_lengths)
        np.testing.assert_array_equal(have[name][1], ref_tokens)
    assert got.n_tokens == 4 * share and got.fingerprint != full.fingerprint


def test_worker_processes_cut_the_same_budget(tmp_path, tok):
    paths = write_sources(tmp_path / "data")
    one = tokenize_corpus(load_corpus(paths, max_tokens=4000), tok, cache_dir=tmp_path / "a", max_len=64, workers=1)
    two = tokenize_corpus(load_corpus(paths, max_tokens=4000), tok, cache_dir=tmp_path / "b", max_len=64, workers=2)
    for name in ("tokens", "offsets", "source_ids"):
        np.testing.assert_array_equal(getattr(one, name), getattr(two, name))


def test_a_cache_serves_only_its_own_budget(tmp_path, tok):
    paths = write_sources(tmp_path / "data")
    build = lambda **kw: tokenize_corpus(load_corpus(paths, **kw), tok, cache_dir=tmp_path / "c", max_len=64,
                                         workers=1)
    small = build(max_tokens=400)
    assert small.n_tokens == 400 and not small.from_cache
    assert build(max_tokens=400).from_cache
    for other in (dict(max_tokens=800), dict(max_tokens_per_source=150), dict(max_tokens=400, max_tokens_per_source=50),
                  {}):
        again = build(**other)
        assert not again.from_cache and again.n_tokens != 400
    assert len(list((tmp_path / "c").iterdir())) == 5


def count_characters(monkeypatch):
    """(characters given to the tokenizer, characters given to the sentence splitter): lists that
    the build fills, one entry a call."""
    encoded, split = [], []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def encode_batch_fast(self, texts, **kw):
            encoded.extend(map(len, texts))
            return self.inner.encode_batch_fast(texts, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    backend = tokens_mod.backend_tokenizer
    monkeypatch.setattr(tokens_mod, "backend_tokenizer", lambda t: Spy(backend(t)))
    words = units._WORDS.tokenize
    monkeypatch.setattr(units._WORDS, "tokenize", lambda text: (split.append(len(text)), words(text))[1])
    return encoded, split


def test_a_budget_reads_and_tokenizes_only_its_share(tmp_path, tok, monkeypatch):
    """A long one-line text: tokenizing stops at the budget; its text is split and encoded only
    a little past it (counted: characters given to the tokenizer and to the sentence splitter)."""
    line = " ".join(" ".join((DATA / "moby-dick.txt").read_text().split()) for _ in range(80))  # 4 MB, one line
    (tmp_path / "big.txt").write_text(line)
    (tmp_path / "small.txt").write_text("A second source. It is short.")
    encoded, split = count_characters(monkeypatch)
    corpus = load_corpus([str(tmp_path / "big.txt"), str(tmp_path / "small.txt")], max_tokens=8192)
    cache = tokenize_corpus(corpus, tok, cache_dir=tmp_path / "c", max_len=512)
    counts = cache.source_counts()
    assert counts["big"]["tokens"] == 4096 and counts["small"]["tokens"] == len(tok.encode("A second source. It is "
                                                                                            "short.").ids)
    assert len(line) > 3_000_000 and sum(encoded) < 100_000 and sum(split) < 200_000, (sum(encoded), sum(split))
    first = [i for s in units.split_sentences(line[:60_000]) for i in tok.encode(s).ids][:4096]
    assert np.asarray(cache.tokens[:4096]).tolist() == first


def test_a_budget_reads_a_text_without_sentence_ends_only_as_far_as_its_share(tmp_path, tok, monkeypatch):
    """A one-line text with no sentence end (code, minified data): split and encoded only a little
    past the budget too, not whole before its first unit comes out (issue 48.6)."""
    words = "".join(c for c in (DATA / "moby-dick.txt").read_text() if c not in ".!?;:\"\'").split()
    line = " ".join(words * 50)  # 2.3 MB, one line, no sentence end
    (tmp_path / "code.txt").write_text(line)
    encoded, split = count_characters(monkeypatch)
    cache = tokenize_corpus(load_corpus([str(tmp_path / "code.txt")], max_tokens=4096), tok,
                            cache_dir=tmp_path / "c", max_len=512)
    assert cache.n_tokens == 4096
    assert len(line) > 2_000_000 and sum(split) <= 3 * units._WINDOW and sum(encoded) < 100_000, \
        (sum(split), sum(encoded))  # before: split whole (2.3M characters), then 64K tokenized
    assert np.asarray(cache.tokens).tolist() == tok.encode(line[:40_000]).ids[:4096]


def test_a_source_with_no_tokens_is_named(tmp_path, tok, capsys):
    (tmp_path / "a.txt").write_text("Some text. More of it.")
    (tmp_path / "b.txt").write_text(" \n\n \n")
    paths = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    for _ in range(2):  # built, then from its cache
        cache = tokenize_corpus(load_corpus(paths, max_tokens=100), tok, cache_dir=tmp_path / "c", max_len=64)
        err = capsys.readouterr().err
        assert err.count("warning: ") == 1 and "warning: source b has no tokens" in err
    assert cache.from_cache and cache.source_counts()["a"]["tokens"] > 0
    (tmp_path / "a.txt").write_text("\n")
    with pytest.raises(UserError, match="corpus has no text"):  # none has any: the error, as before
        tokenize_corpus(load_corpus(paths, max_tokens=100), tok, cache_dir=tmp_path / "c", max_len=64)


def test_bad_budgets_are_user_errors(tmp_path, monkeypatch):
    paths = write_sources(tmp_path / "data")
    monkeypatch.setattr(readers, "check_hub_dataset", lambda inp: None)  # it is there (offline: tests/test_messages.py)
    for kwargs, message in ((dict(max_tokens=0), "--max-tokens must be a positive integer"),
                            (dict(max_tokens_per_source=-5), "--max-tokens-per-source must be a positive"),
                            (dict(max_tokens_per_source=2.5), "--max-tokens-per-source must be a positive")):
        with pytest.raises(UserError, match=message):
            load_corpus(paths, **kwargs)
    with pytest.raises(UserError, match="less than one token for each of the 4 sources"):
        load_corpus(paths, max_tokens=3).budget()
    with pytest.raises(UserError, match="less than one token for each of the 2 sources"):
        load_corpus(paths[:2], max_tokens=1)  # text files name their sources: at once
    assert load_corpus(paths, max_tokens=4003, max_tokens_per_source=2000).budget() == (1000, 4)
    assert load_corpus(paths[:2], max_tokens_per_source=10).budget() == (10, 2)
    assert load_corpus(paths, max_tokens_per_source=10).budget() == (10, None)  # known only by reading
    assert load_corpus(paths, sources=["a", "PG-19"], max_tokens=10).budget() == (5, 2)
    with pytest.raises(UserError, match="name them with --source"):
        load_corpus(["hub:some/dataset:train"], max_tokens=10)


@pytest.mark.slow
def test_a_run_measures_every_sources_share(tmp_path, monkeypatch, capsys):
    """Sources one after another: --max-tokens measured the first one only ("a": 0 tokens, no
    word); each now gets its share, read from the files' starts only."""
    from conftest import build_hf_checkpoint
    from isojax.extract import main
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    paths = write_sources(tmp_path / "data")
    args = ["--model", str(tmp_path / "ckpt"), "--data", paths[0], "--data", paths[1], "--seq-len", "64", "--batch-tokens", "256",
            "--no-plots", "--max-tokens", "1000", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert {name: s["tokens"] for name, s in metrics["sources"].items()} == {"a": 500, "b": 500}
    assert all(layer["inter_sim"] is not None for s in metrics["sources"].values() for layer in s["layers"])
    assert metrics["tokens"] == 1000
    assert "warning" not in capsys.readouterr().err


def test_the_flags(tmp_path, capsys, monkeypatch):
    from isojax.extract import build_parser, main
    paths = write_sources(tmp_path / "data")
    monkeypatch.setattr(readers, "check_hub_dataset", lambda inp: None)  # it is there
    for args, message in ((["--max-tokens-per-source", "0"], "positive integer"),
                          (["--data", paths[0], "--data", paths[1], "--max-tokens", "1"], "less than one token"),
                          (["--data", "hub:some/dataset", "--max-tokens", "10"], "name them with --source")):
        with pytest.raises(SystemExit) if args[0] == "--max-tokens-per-source" else nullcontext():
            assert main([*args, "--no-plots", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "metrics.json").exists()
    helped = " ".join(build_parser().format_help().split())
    assert "--max-tokens-per-source N" in helped and "split equally over the sources" in helped
    assert "share is the smaller of N and its equal share" in helped
