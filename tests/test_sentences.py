"""The sentence probe (isojax/stats/sentences.py): Diff-eRank's per-sentence eRank (Wei et al. 2024) and
Sun et al. 2024's massive activations, against float64 references written here from the papers'
formulas, on Hugging Face states of random checkpoints of three families, float32 and bf16, on 1 and 2
devices; the massive-activation criterion on planted activations; the subset rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import build_hf_checkpoint, hf_states, max_rel_error, need
from test_families import SHAPES, build
from test_families import hf_states as family_states

from isojax.stats import sentences

REPO = Path(__file__).resolve().parents[1]
ROW_LEN = 64
DOT = types.SimpleNamespace(decode=lambda ids: "." if ids == [13] else "a")  # a tokenizer whose delimiter is 13


def ref_erank(x):
    """Wei et al.: z_i = (x_i - mean) / ||x_i - mean||, Sigma = sum z_i z_i^T / n over D x D, trace-
    normalized; exp of the entropy of its singular values (= eigenvalues)."""
    c = x - x.mean(axis=0)
    z = c / np.linalg.norm(c, axis=1)[:, None]
    sigma = z.T @ z / len(z)
    lam = np.linalg.svd(sigma / np.trace(sigma), compute_uv=False)
    lam = lam[lam > 0]
    return float(np.exp(-(lam * np.log(lam)).sum()))


def ref_massive(x, ids, delimiters):
    """Sun et al.: per sequence, |x| over all its activations; massive: > 100 and >= 1000 x the median."""
    a = np.abs(x).ravel()
    s = np.sort(a)
    median = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
    hits = [(i // x.shape[1], i % x.shape[1]) for i in range(a.size) if a[i] > 100 and a[i] >= 1000 * median]
    return median, list(s[::-1][:3]), hits


def reference(per_sentence, token_ids, delimiters=frozenset()):
    """Per state, the measures of sentences.measures from [S, n_i, D] float64 states of each sentence."""
    out = []
    for s in range(per_sentence[0].shape[0]):
        parts = [ref_massive(x[s], ids, delimiters) for x, ids in zip(per_sentence, token_ids)]
        hits = [(p, d, ids[p]) for (_, _, h), ids in zip(parts, token_ids) for p, d in h]
        dims = {}
        for _, d, _ in hits:
            dims[d] = dims.get(d, 0) + 1
        out.append({"erank": np.mean([ref_erank(x[s]) for x in per_sentence]), "massive_count": len(hits),
                    "massive_sequences": sum(1 for _, _, h in parts if h),
                    "massive_dims": sorted(dims.items(), key=lambda dc: (-dc[1], dc[0])),
                    "massive_first_share": sum(p == 0 for p, _, _ in hits) / len(hits) if hits else None,
                    "massive_delimiter_share": sum(t in delimiters for _, _, t in hits) / len(hits) if hits else None,
                    **{f"massive_top{k + 1}": np.mean([t[k] for _, t, _ in parts]) for k in range(3)},
                    "massive_median": np.mean([m for m, _, _ in parts])})
    return out


def check(got, want, rel):
    for g, w in zip(got, want, strict=True):
        assert g["erank"] == pytest.approx(w["erank"], rel=rel)
        for k in ("massive_count", "massive_sequences", "massive_first_share", "massive_delimiter_share"):
            assert g[k] == w[k], k
        assert [(d["dim"], d["count"]) for d in g["massive_dims"]] == w["massive_dims"]
        for k in ("massive_top1", "massive_top2", "massive_top3", "massive_median"):
            assert g[k] == pytest.approx(w[k], rel=rel), k


def fake_cache(seqs):
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return types.SimpleNamespace(offsets=offsets, sequence=lambda i: np.asarray(seqs[i], np.int32))


def sequences(vocab, n=12, seed=45):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)) for k in rng.integers(1, ROW_LEN + 1, n)]  # lengths 1 .. ROW_LEN


def probe_measures(folder, dtype, seqs, mesh=None):
    """(measures, [S, n_i, D] states of each chosen sentence, the chosen indices) of isojax's probe."""
    import jax

    from isojax.device.mesh import make_mesh, param_shardings
    from isojax.hf.loading import build_module, load_model
    from isojax.run.plan import step_module
    model, mesh = load_model(folder, dtype=dtype), mesh or make_mesh()
    params = jax.device_put(model.params, param_shardings(model.params, mesh))  # as the run's Runner places them
    # the module as the run's step has it (its rows split over the devices), which the probe undoes
    probe = sentences.Probe(step_module(build_module(model.config, dtype), mesh), params, mesh, ROW_LEN)
    cache = fake_cache(seqs)
    probe.compile(cache)
    states = probe.states(cache)
    layers, info = sentences.probe(cache, probe, DOT)
    own = [states[:, r, b:b + n].astype(np.float64) for r, b, n in probe.packed[3]]
    return layers, own, info["indices"]


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2", "llama"])
def test_probe_measures_equal_float64_references_on_hugging_face_states(tmp_path, family):
    """float32 and bf16: the probe's states are Hugging Face's (to the dtype's rounding), its read-out
    is the papers' formulas on its own states (to 1e-10), and erank and the magnitudes from Hugging
    Face's float64 states agree to the dtype's precision. GPT-NeoX's embedding of token 13 (a
    delimiter here) holds a planted 500 in dimension 5: its massive activations are those tokens'."""
    torch = need("torch")
    seqs = sequences(300)
    if family == "gpt_neox":
        model = build_hf_checkpoint(tmp_path, hidden_size=64, tokenizer=False)
        with torch.no_grad():
            model.gpt_neox.embed_in.weight[13, 5] = 500.0
        model.save_pretrained(tmp_path)
        seqs[3][0] = 13
        for s in seqs[:6]:
            s[len(s) // 2] = 13
        states_of = lambda ids: hf_states(model, ids)
    else:
        model = build(tmp_path, family, **SHAPES[family][0])
        states_of = lambda ids: family_states(model, ids)
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        layers, own, chosen = probe_measures(tmp_path, dtype, seqs)
        assert len(chosen) == sum(len(s) >= 2 for s in seqs)  # all fit: 12 of at most 64 tokens in 128 rows
        ids = [seqs[i] for i in chosen]
        check(layers, reference(own, ids, {13}), rel=1e-10)
        hf = [states_of(i) for i in ids]
        assert max(max_rel_error(o, h) for o, h in zip(own, hf)) < tol, dtype
        want = reference(hf, ids, {13})
        for g, w in zip(layers, want):
            assert g["erank"] == pytest.approx(w["erank"], rel=tol / 10), (dtype, g["erank"], w["erank"])
            assert g["massive_top1"] == pytest.approx(w["massive_top1"], rel=tol)
            for k in ("massive_count", "massive_dims", "massive_first_share", "massive_delimiter_share"):
                assert g[k] == w[k] if k != "massive_dims" else [(d["dim"], d["count"]) for d in g[k]] == w[k], k
        if family == "gpt_neox":  # the planted ones: every 13 in the embedding, in dimension 5, none after final_ln
            dots = sum(int((i == 13).sum()) for i in ids)
            assert dots >= 6 and layers[0]["massive_dims"] == [{"dim": 5, "count": dots}]
            assert layers[0]["massive_delimiter_share"] == 1.0 and 0 < layers[0]["massive_first_share"] < 1
            assert layers[-1]["massive_count"] == 0


def test_probe_on_two_devices_equals_one_device_and_the_reference(tmp_path):
    """The probe on a mesh of 2 (CPU) devices: the same sentences and, in bf16, the same measures as
    on one device, both the references' of Hugging Face's states."""
    model = build_hf_checkpoint(tmp_path, hidden_size=64, tokenizer=False)
    seqs = sequences(300)
    script = f"""
import json, sys
sys.path.insert(0, {str(REPO / 'tests')!r})
import numpy as np
import jax
from test_sentences import probe_measures, sequences
assert jax.device_count() == 2
layers, _, chosen = probe_measures({str(tmp_path)!r}, "bfloat16", sequences(300))
print(json.dumps({{"layers": layers, "chosen": chosen}}))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    one, _, chosen = probe_measures(tmp_path, "bfloat16", seqs)
    assert two["chosen"] == chosen
    ids = [seqs[i] for i in chosen]
    want = reference([hf_states(model, i) for i in ids], ids)
    for a, b, w in zip(two["layers"], one, want, strict=True):
        assert a["erank"] == pytest.approx(b["erank"], rel=1e-9)
        assert a["erank"] == pytest.approx(w["erank"], rel=3e-3)


def test_massive_activations_on_planted_entries():
    """Planted: 800 (above 100 and 1000 x a median of 0.5) is massive, 400 (above 100, under 1000 x
    the median) and 90 where the median is tiny (under 100) are not; positions, dims, delimiters and
    the top-3 and median as planted."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2, 2, 16, 8))  # [S, rows, T, D], median |x| about 0.5
    x[1, 1] *= 1e-3  # sentence 2 of state 1: median ~5e-4, so 90 is 1000x the median but not above 100
    spans = [(0, 0, 10), (1, 0, 16)]  # sentence 1: row 0, tokens 0..9; sentence 2: row 1
    ids = [np.arange(10), np.arange(16) + 20]
    plants = {(0, 0, 0, 3): 800.0, (0, 0, 4, 3): -800.0, (0, 1, 7, 5): 800.0, (0, 0, 2, 1): 400.0,
              (1, 1, 0, 2): 90.0, (1, 1, 3, 2): 150.0}
    for (s, r, t, d), v in plants.items():
        x[s, r, t, d] = v
    layers = sentences.measures(x, spans, ids, delimiters={4, 27})
    per_sentence = [x[:, r, b:b + n] for r, b, n in spans]
    check(layers, reference(per_sentence, ids, {4, 27}), rel=1e-12)
    first, second = layers
    assert (first["massive_count"], first["massive_sequences"]) == (3, 2)
    assert first["massive_dims"] == [{"dim": 3, "count": 2}, {"dim": 5, "count": 1}]
    assert first["massive_first_share"] == pytest.approx(1 / 3)
    assert first["massive_delimiter_share"] == pytest.approx(2 / 3)
    assert first["massive_top1"] == 800.0 and first["massive_top2"] < 800.0  # sentence 2's second is ~1
    assert (second["massive_count"], second["massive_dims"]) == (1, [{"dim": 2, "count": 1}])  # 150, not 90
    assert second["massive_first_share"] == 0.0


def test_the_subset_rule():
    """The subset: sequences of 2+ tokens by increasing hash of their index, first fit into
    max(1, 8192 // row_len) rows, at most 64; the same for the same offsets, whatever else."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 5000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    chosen = sentences.choose(offsets, 512)
    assert chosen == sentences.choose(offsets.copy(), 512)
    keys = sentences.sentence_keys(np.arange(len(lengths)))
    assert len(set(keys.tolist())) == len(keys)
    room, want = [512] * 16, []
    for i in np.argsort(keys, kind="stable"):
        row = next((r for r in range(16) if lengths[i] >= 2 and room[r] >= lengths[i]), None)
        if row is not None:
            want.append((int(i), row, 512 - room[row]))
            room[row] -= int(lengths[i])
        if len(want) == 64:
            break
    assert chosen == want and len(chosen) == 64
    assert [i for i, _, _ in chosen] != sorted(i for i, _, _ in chosen)  # not the corpus's first ones
    assert sentences.probe_rows(2048) == 4 and sentences.probe_rows(16384) == 1


def test_extract_writes_the_probe_measures_of_the_papers(tmp_path, monkeypatch):
    """An extract run (documents in windows of 64): metrics.json records the subset and each state's
    erank and massive activations, equal to the references on Hugging Face's states of those windows
    (the token cache's sequences); layers.csv has the columns."""
    import csv

    from test_extract import write_pile_jsonl
    from tokenizers import Tokenizer

    from isojax.extract import main
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    model = build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=2, num_heads=2)
    docs = write_pile_jsonl(tmp_path / "pile.jsonl", 24, seed=5)
    out = tmp_path / "out"
    assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--unit", "document",
                 "--seq-len", "64", "--out", str(out), "--no-plots", "--no-token-stats", "--sentence-probe"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "ckpt" / "tokenizer.json"))
    windows = [ids[i:i + 64] for _, text in docs for ids in [np.array(tok.encode(text, add_special_tokens=False).ids)]
               for i in range(0, len(ids), 64)]
    info = metrics["sentences"]
    assert info["row_len"] == 64 and info["sentences"] == sum(len(w) >= 2 for w in windows) > 20
    assert [i for i, _, _ in sentences.choose(np.cumsum([0] + [len(w) for w in windows]), 64)] == info["indices"]
    ids = [windows[i] for i in info["indices"]]
    text = {t: tok.decode([t]) for t in set(np.concatenate(ids).tolist())}
    assert info["delimiter_ids"] == sorted(t for t, x in text.items() if x.strip(" ") in list(".,;:!?")
                                           or x.isspace() and "\n" in x)
    want = reference([hf_states(model, i) for i in ids], ids, set(info["delimiter_ids"]))
    for got, w in zip(metrics["layers"], want, strict=True):
        assert got["erank"] == pytest.approx(w["erank"], rel=1e-5) and got["erank_sentences"] == len(ids)
        assert got["massive_median"] == pytest.approx(w["massive_median"], rel=1e-5)
        assert got["massive_count"] == w["massive_count"] == 0
    header = next(csv.reader(open(out / "layers.csv")))
    assert {"erank", "erank_init", "massive_count", "massive_dims", "massive_top1", "massive_first_share"} <= set(header)
    # erank_init: the same sentences through the config's random initialization, seed 0 (Diff-eRank's
    # baseline without a step0); its states from isojax's model (itself checked against Hugging Face)
    import dataclasses

    from isojax.hf.loading import from_config_params, load_model
    loaded = load_model(str(tmp_path / "ckpt"))
    init = dataclasses.replace(loaded, params=from_config_params(loaded.config, loaded.dtype, seed=0))
    for path, w in jax.tree_util.tree_flatten_with_path(init.params)[0]:  # Hugging Face's _init_weights
        name = jax.tree_util.keystr(path)
        if "kernel" in name or "embed" in name:
            assert abs(np.std(np.asarray(w)) - 0.02) < 0.002 and abs(np.mean(np.asarray(w))) < 0.002, name
        elif "bias" in name:
            assert not np.asarray(w).any(), name
    assert metrics["sentences"]["init_seed"] == 0
    for s, got in enumerate(metrics["layers"]):
        want = np.mean([ref_erank(init.hidden_states(i)[s].astype(np.float64)) for i in ids])
        assert got["erank_init"] == pytest.approx(want, rel=1e-5) and abs(got["erank_init"] - got["erank"]) > 1e-3
