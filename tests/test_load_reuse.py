"""A sweep's later checkpoints reuse what their first one built: the tokenizer read once per
content, the placing program once per shape. Never across different contents or shapes."""

import json

import jax
import numpy as np
from conftest import build_hf_checkpoint, hf_states

from isojax.hf import loading, tokenizer
from isojax.hf.family import tensors_to_params
from isojax.hf.checkpoint import read_hf_tensors


def test_revisions_share_the_tokenizer_and_the_placing_program_and_load_their_own_weights(tmp_path):
    models = {rev: build_hf_checkpoint(tmp_path / rev, seed=seed, vocab_size=50304, hidden_size=32) for rev, seed in (("step1", 1), ("step2", 2))}
    loading._placer.cache_clear()
    loaded = {rev: loading.load_model(str(tmp_path / rev)) for rev in models}
    assert loading._placer.cache_info().misses == 1 and loading._placer.cache_info().hits == 1
    assert loaded["step1"].tokenizer is loaded["step2"].tokenizer  # one file content, read once
    for rev, model in models.items():  # each revision its own weights, bit for bit
        cfg, tensors, _ = read_hf_tensors(tmp_path / rev)
        want = tensors_to_params(tensors, cfg, np)
        for a, b in zip(jax.tree.leaves(loaded[rev].params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))
        ids = np.arange(1, 9)
        np.testing.assert_allclose(loaded[rev].hidden_states(ids), hf_states(model, ids), rtol=2e-4, atol=2e-4)


def test_a_changed_tokenizer_file_is_read_again(tmp_path):
    build_hf_checkpoint(tmp_path / "a", seed=1, vocab_size=50304, hidden_size=32)
    build_hf_checkpoint(tmp_path / "b", seed=1, vocab_size=50304, hidden_size=32)
    raw = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    raw["added_tokens"] = raw.get("added_tokens", []) + [{"id": 3, "content": "<x>", "single_word": False, "lstrip": False,
                                                          "rstrip": False, "normalized": False, "special": True}]
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(raw))
    a, b = (loading.load_model(str(tmp_path / d)).tokenizer for d in "ab")
    assert a is not b and b.token_to_id("<x>") is not None and a.token_to_id("<x>") is None
    again = loading.load_model(str(tmp_path / "a")).tokenizer
    assert again is a
    assert tokenizer.tokenizer_bos(a, tmp_path / "a", "x") == tokenizer.tokenizer_bos(again, tmp_path / "a", "x")
