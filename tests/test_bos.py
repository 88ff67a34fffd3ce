"""--bos auto|on|off: the token ids against Hugging Face's tokenizer(text, add_special_tokens=True/False),
the token cache's key, and the metrics of a tiny random Llama measured with a BOS against float64 ones
from Hugging Face's states of the same ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TOKENIZER_JSON, max_rel_error, need

TEXTS = ["Call me Ishmael.", "Some years ago, never mind how long precisely, I went to sea.",
         "It is a way I have of driving off the spleen."]


def _tokenizer_folder(directory, kind: str):
    """A folder of tokenizer files as transformers saves them: `template` (tokenizer.json's post-processor
    puts <|endoftext|> first, bos_token named: Llama's layout), `config` (the bundled tokenizer.json with
    tokenizer_config.json saying add_bos_token, which transformers does not read then), `bpe` (GPT-2-style
    vocab.json + merges.txt, tokenizer_config.json saying add_bos_token: OPT's layout) or `none` (the
    bundled tokenizer, no BOS: GPT-NeoX's)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    directory.mkdir()
    if kind == "bpe":
        tok.model.save(str(directory))
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "add_bos_token": True}))
        return directory
    if kind == "template":
        tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    named = {} if kind == "none" else {"bos_token": "<|endoftext|>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(directory)
    if kind == "config":
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": True}))
    return directory


@pytest.mark.parametrize("kind", ["template", "config", "bpe", "none"])
def test_token_ids_match_hugging_face(tmp_path, kind):
    """auto gives the ids of Hugging Face's tokenizer(text) (add_special_tokens=True), off those of
    add_special_tokens=False, on the BOS first always; the BOS is in the cache's key both ways."""
    need("torch")
    from transformers import AutoTokenizer

    from isojax.data import load_corpus, tokenize_corpus
    from isojax.errors import UserError
    from isojax.hf.family.presets import preset
    from isojax.hf.tokenizer import load_tokenizer, tokenizer_bos
    folder = _tokenizer_folder(tmp_path / "tok", kind)
    ref = AutoTokenizer.from_pretrained(folder)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    corpus = lambda: load_corpus([str(tmp_path / "c.jsonl")], unit="document")
    tok, desc = load_tokenizer(folder, preset("pythia-70m"))
    bos = tokenizer_bos(tok, folder, desc)
    caches = {}
    for choice in ("auto", "off", "on"):
        if choice == "on" and kind == "none":
            with pytest.raises(UserError, match=r"^--bos on: the tokenizer \(.*\) has no BOS token$"):
                bos.resolve(choice, desc)
            continue
        bos_id = bos.resolve(choice, desc)
        cache = caches[choice] = tokenize_corpus(corpus(), tok, cache_dir=tmp_path / "cache", max_len=512, workers=1,
                                                 bos=bos_id)
        special = choice == "auto" or (choice == "on" and kind != "none")
        want = [ref(t, add_special_tokens=special)["input_ids"] for t in TEXTS]
        if choice == "on":
            want = [[ref.bos_token_id] + ref(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
        assert [cache.sequence(i).tolist() for i in range(cache.n_sequences)] == want, choice
        assert cache.meta["bos"] == bos_id
    with_bos = [c for c in caches.values() if c.meta["bos"] is not None]
    without = [c for c in caches.values() if c.meta["bos"] is None]
    assert bool(with_bos) == (kind != "none") and without
    assert {c.fingerprint for c in with_bos}.isdisjoint(c.fingerprint for c in without)
    assert (kind in ("none", "config")) == (ref("a")["input_ids"] == ref("a", add_special_tokens=False)["input_ids"])
    # the reverse order: a cache built with the BOS first is not read as the one without
    fresh = tmp_path / "fresh"
    first = tokenize_corpus(corpus(), tok, cache_dir=fresh, max_len=512, workers=1, bos=0)
    second = tokenize_corpus(corpus(), tok, cache_dir=fresh, max_len=512, workers=1, bos=None)
    assert not second.from_cache and second.path != first.path and second.n_tokens == first.n_tokens - len(TEXTS)
    assert tokenize_corpus(corpus(), tok, cache_dir=fresh, max_len=512, workers=1, bos=0).from_cache


def test_extract_with_bos_matches_float64_reference(tmp_path, monkeypatch, capsys):
    """extract --bos on with --skip-positions 1 on a tiny random Llama whose tokenizer adds a BOS: the
    metrics equal float64 ones of Hugging Face's states of the ids with the BOS, its position (0) left
    out; the manifest, metrics.json and the log say BOS on. samples.zarr names each sampled token
    (sequence id, position, token id): its states are Hugging Face's at that place."""
    from test_extract import reference_metrics, write_pile_jsonl
    from test_families import LLAMA, build, hf_states
    from transformers import AutoTokenizer

    from isojax.extract import main
    from isojax.run.sweep_files import read_sample, read_sample_keys, read_sample_tokens
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    model = build(tmp_path / "ckpt", "llama", **dict(LLAMA, num_key_value_heads=2, vocab_size=50304))
    ref = AutoTokenizer.from_pretrained(_tokenizer_folder(tmp_path / "ckpt" / "tok", "template"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ckpt" / "tok" / name).rename(tmp_path / "ckpt" / name)
    docs = write_pile_jsonl(tmp_path / "pile.jsonl", 6, seed=4)
    out = tmp_path / "out"
    assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--unit", "document",
                 "--seq-len", "64", "--batch-tokens", "256", "--out", str(out), "--no-plots", "--bos", "on",
                 "--skip-positions", "1", "--sample-states", "32"]) == 0
    assert "; BOS 0 before each document; rows" in capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    assert metrics["bos"] == settings["bos"] == "on" and settings["bos_id"] == 0
    ids = [np.array(ref(text, add_special_tokens=True)["input_ids"]) for _, text in docs]
    assert all(i[0] == 0 and len(i) <= 64 for i in ids)
    states = [hf_states(model, i) for i in ids]
    want = reference_metrics([x[:, 1:] for x in states], [i[1:] for i in ids])
    sampled = read_sample_tokens(out)
    sample = read_sample(out)
    assert sample.shape[1] == 32 and all(len(v) == 32 for v in sampled.values())
    for k, (seq, pos, tid) in enumerate(zip(*(sampled[n] for n in ("sequence_ids", "positions", "token_ids")))):
        assert pos >= 1 and tid == ids[seq][pos]  # the cache's sequences are the documents, in order
        assert max_rel_error(sample[:, k], states[seq][:, pos]) < 1e-4
    keys = read_sample_keys(out)
    assert len(set(zip(sampled["sequence_ids"].tolist(), sampled["positions"].tolist()))) == 32 == len(keys)
    assert metrics["tokens"] == sum(map(len, ids))
    for got, ref_layer in zip(metrics["layers"], want, strict=True):
        assert got["count"] == ref_layer["count"] == metrics["tokens"] - len(ids)
        for key in ("inter_sim", "intra_sim", "anisotropy"):
            assert abs(got[key] - ref_layer[key]) < 2e-5, (got["name"], key, got[key], ref_layer[key])
        assert abs(got["mean_norm"] - ref_layer["mean_norm"]) < 2e-5 * ref_layer["mean_norm"]


def test_runs_with_another_bos_are_not_mixed(tmp_path, capsys):
    """report refuses runs whose BOS differs, naming --bos; a resumed sweep refuses a step of the same
    model measured with another BOS (one measured before --bos counts as off)."""
    from isojax.errors import UserError
    from isojax.report import build
    from isojax.run.sweep import Step, check_same_corpus

    def run(folder, revision, fingerprint, bos):
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"model": "m", "revision": revision, "tokens": 1,
                                                         "layers": [{"name": "embed", "inter_sim": 0.5}]}))
        settings = {"max_tokens": None, **({} if bos is None else {"bos": bos})}
        manifest = {"model": "m", "revision": revision, "corpus": "a.txt", "corpus_fingerprint": fingerprint,
                    "settings": settings}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return manifest

    run(tmp_path / "r" / "s1", "step1", "f1", "off")
    run(tmp_path / "r" / "s2", "step2", "f2", "on")
    assert build.main([str(tmp_path / "r"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "they differ in --bos" in err and "corpus f1 (--bos off)" in err and "corpus f2 (--bos on)" in err, err
    old = run(tmp_path / "s" / "step1", "step1", "f1", None)
    steps = [Step("m", "step1", tmp_path / "s" / "step1"), Step("m", "step2", tmp_path / "s" / "step2")]
    with pytest.raises(UserError, match=r"measured with BOS off, this run with BOS on: resume with --bos off"):
        check_same_corpus({**old, "settings": {"max_tokens": None, "bos": "on"}}, steps, steps[1])
    check_same_corpus({**old, "settings": {"max_tokens": None, "bos": "off"}}, steps, steps[1])
    check_same_corpus({**old, "settings": {"max_tokens": None, "bos": "on"}}, steps[:1], Step("n", "step2", tmp_path))
