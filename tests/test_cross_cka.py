"""sweep_cka.json's CKA on the device (isojax.stats.cross_cka.CkaAgainst) against the float64 numpy
computation it replaced (cka_matrix below, moved here as the reference), on random states and on a
real sweep's samples; isojax.load stays free of JAX; samples.zarr is written in chunks of one state
and older folders (one chunk across every state) still read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from isojax.run import results, sweep_files
from isojax.stats.cross_cka import CkaAgainst

REPO = Path(__file__).resolve().parents[1]


def cka_matrix(xs_SxKxD, ys_SxKxD) -> list[list[float | None]]:
    """[[linear CKA(xs[i], ys[j]) for j] for i] in numpy float64, each state centered and its norm
    computed once: with K < D through the K x K Grams (||Y^T X||_F^2 = <X X^T, Y Y^T>_F), else
    through the D x D ones. None where a state is constant. (isojax.run.sweep_files before issue 47.)"""
    grams = xs_SxKxD.shape[1] < xs_SxKxD.shape[2]

    def prepared(states):
        out = []
        for x in states:
            x = np.asarray(x, np.float64)
            x = x - x.mean(axis=0)
            gram = x @ x.T if grams else x.T @ x
            out.append((gram if grams else x, np.linalg.norm(gram)))
        return out
    rows = []
    for x, nx in prepared(xs_SxKxD):
        row = []
        for y, ny in prepared(ys_SxKxD):
            cross = np.vdot(x, y) if grams else np.linalg.norm(y.T @ x) ** 2
            row.append(float(cross / (nx * ny)) if nx > 0 and ny > 0 else None)
        rows.append(row)
    return rows


def assert_equal_to_1e9(got, want):
    assert len(got) == len(want) and all(len(a) == len(b) for a, b in zip(got, want))
    for a, b in zip(got, want):
        for u, v in zip(a, b):
            assert (u is None) == (v is None) and (u is None or abs(u - v) <= 1e-9), (u, v)


@pytest.mark.parametrize("k,d", [(48, 16), (16, 16), (10, 24)])  # the D x D path (K >= D) and the Grams' (K < D)
def test_cka_against_equals_numpy_float64(k, d):
    rng = np.random.default_rng(k * d)
    final = (rng.normal(size=(5, k, d)) @ rng.normal(size=(d, d)) + 40.0).astype(np.float32)
    against = CkaAgainst(final)
    assert against.nbytes >= 5 * k * min(k, d) * 8  # the reference's Grams or centered states in float64
    for seed in range(2):
        states = (rng.normal(size=(5, k, d)) * rng.uniform(0.01, 30, size=d) + 5.0).astype(np.float32)
        states[1] = states[0] * 4  # CKA is invariant to scale (exact in float32)
        states[3] = 2.5  # a constant state: null
        got = against.matrix(states)
        assert_equal_to_1e9(got, cka_matrix(states, final))
        assert got[3] == [None] * 5 and got[0] == pytest.approx(got[1], abs=1e-12)
    assert_equal_to_1e9(against.matrix(final), cka_matrix(final, final))
    assert [against.matrix(final)[i][i] for i in range(5)] == pytest.approx([1.0] * 5, abs=1e-12)
    with pytest.raises(ValueError, match="shape"):
        against.matrix(final[:, :k - 1])


def test_a_bfloat16_sample_gives_the_floats_of_its_float32_file():
    """The pipelined sweep may pass the sample as it lies on the device (the forward's dtype); the
    file holds it as float32: every bf16 value exactly, so the same float64 CKA to the last bit."""
    rng = np.random.default_rng(3)
    final, states = (rng.normal(size=(2, 4, 32, 8)) + 1.0).astype(ml_dtypes.bfloat16)
    via_file = CkaAgainst(final.astype(np.float32)).matrix(states.astype(np.float32))
    assert CkaAgainst(final).matrix(states) == via_file


def test_samples_zarr_is_one_chunk_per_state_and_older_folders_read(tmp_path):
    """Written one state at a time into chunks spanning every state, each chunk was compressed again
    at every state (17.5 s for 410m's [26, 4096, 1024] on 2 cores; 0.9 s one chunk per state)."""
    import tensorstore as ts
    rng = np.random.default_rng(4)
    sample = rng.normal(size=(3, 40, 16)).astype(np.float32)
    for name in ("new", "old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text("{}")
    results._write_data(tmp_path / "new", {"layers": [{"name": "embed"}]}, {"sample": lambda s: sample[s]},
                        ["embed", "block_1", "final_ln"], None)
    results.write_zarr(tmp_path / "old" / "samples.zarr" / "states", sample)  # one array, default chunks
    spec = lambda name: {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / name / "samples.zarr" / "states")}}
    assert ts.open(spec("new")).result().chunk_layout.read_chunk.shape == (1, 40, 16)
    assert ts.open(spec("old")).result().chunk_layout.read_chunk.shape[0] == 3
    for name in ("new", "old"):
        assert np.array_equal(sweep_files.read_sample(tmp_path / name), sample)


def test_isojax_load_imports_no_jax():
    code = "import sys, isojax; isojax.load; import isojax.run.sweep_files; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.slow
def test_a_real_sweeps_cka_equals_numpy_float64(tmp_path):
    """With --measure cka_debiased,procrustes_distance,svcca at every step, also their to_final values
    (each state against itself at the final checkpoint; tests/test_sweep_to_final.py) against their
    float64 references on the samples, recorded in each step's manifest."""
    import csv
    import os

    from test_sweep_to_final import REFERENCES, close

    from conftest import build_hf_checkpoint
    from test_extract import write_pile_jsonl
    env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache")}
    revisions = ("step1000", "step2000", "step3000")
    for seed, rev in enumerate(revisions):
        build_hf_checkpoint(tmp_path / "m" / rev, seed=seed, vocab_size=50304, hidden_size=32, num_layers=2,
                            num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 30, seed=5)
    run = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(tmp_path / "m"), "--revisions",
                          ",".join(revisions), "--data", str(tmp_path / "pile.jsonl"), "--seq-len", "64",
                          "--batch-tokens", "512", "--no-plots", "--sample-states", "96", "--measure",
                          ",".join(REFERENCES), "--out", str(tmp_path / "out")], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "sweep_cka.json").read_text())["m"]
    final = sweep_files.read_sample(tmp_path / "out" / "m" / "step3000")
    assert doc["final"] == "step3000" and doc["tokens"] == 96 and final.shape == (4, 96, 32)
    with open(tmp_path / "out" / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for rev in revisions:
        states = sweep_files.read_sample(tmp_path / "out" / "m" / rev)
        assert_equal_to_1e9(doc["checkpoints"][rev], cka_matrix(states, final))
        manifest = json.loads((tmp_path / "out" / "m" / rev / "manifest.json").read_text())
        assert manifest["measures"] == list(REFERENCES)
        for name, reference in REFERENCES.items():
            want = [reference(states[s].astype(np.float64), final[s].astype(np.float64)) for s in range(4)]
            assert close(doc["to_final"][name][rev], want) and all(w is not None for w in want), (name, rev)
            column = [r[f"{name}_to_final"] for r in rows if r["revision"] == rev]
            assert column == [repr(v) for v in doc["to_final"][name][rev]]


def _step(folder: Path, states_SxKxD, keys_Kx2=None, settings=None, fingerprint="fp", identity=None) -> None:
    """A finished step folder as sweep_cka reads it: metrics, manifest, samples.zarr (states, keys, and
    identity: {name: array} of the sampled tokens' sequence ids, positions, token ids)."""
    folder.mkdir(parents=True)
    names = [f"s{i}" for i in range(states_SxKxD.shape[0])]
    (folder / "metrics.json").write_text(json.dumps({"tokens": 500, "layers": [{"name": n} for n in names]}))
    manifest = {"corpus_fingerprint": fingerprint, **({"settings": settings} if settings is not None else {})}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    results.write_zarr(folder / "samples.zarr" / "states", np.asarray(states_SxKxD, np.float32))
    if keys_Kx2 is not None:
        results.write_zarr(folder / "samples.zarr" / "keys", np.asarray(keys_Kx2, np.uint32))
    for name, values in (identity or {}).items():
        results.write_zarr(folder / "samples.zarr" / name, values)


def test_sweep_cka_compares_only_checkpoints_that_sampled_the_same_tokens_alike(tmp_path):
    """Issue 45: a checkpoint whose sampled tokens (samples.zarr/keys), row length, skipped positions
    or dtype differ from the final one's is null, with the reason; a folder written before the keys
    and settings were recorded is still compared (on what it records)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 40, 8))
    keys = np.sort(rng.integers(0, 2**32, size=(40, 2), dtype=np.uint64).astype(np.uint32), axis=0)
    settings = {"row_len": 64, "skip_positions": 0, "dtype": "float32"}
    root = tmp_path / "m"
    _step(root / "step9", x, keys, settings)  # the final checkpoint
    _step(root / "step1", x + rng.normal(size=x.shape), keys, settings)
    _step(root / "step2", x, keys[::-1], settings)
    _step(root / "step3", x, keys, {**settings, "skip_positions": 1})
    _step(root / "step4", x, keys, {**settings, "row_len": 128})
    _step(root / "step5", x, keys, {**settings, "dtype": "bfloat16"})
    _step(root / "step6", x)  # written before keys and settings were recorded
    steps = [(r, root / r) for r in ("step1", "step2", "step3", "step4", "step5", "step6", "step9")]
    doc = sweep_files.sweep_cka({"m": steps})["m"]["checkpoints"]
    assert doc["step1"] is not None and np.allclose(doc["step9"], cka_matrix(x, x), atol=1e-9)
    assert doc["step6"] is not None and np.allclose(doc["step6"], cka_matrix(x, x), atol=1e-9)
    assert [doc[r] for r in ("step2", "step3", "step4", "step5")] == [None] * 4


def test_sweep_cka_compares_the_sampled_tokens_identity(tmp_path):
    """Issue 45: a checkpoint whose sampled tokens (sequence ids, positions, token ids in samples.zarr)
    or BOS differ from the final one's is null though its keys agree; one without them (written
    before) is compared on its keys."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 30, 8))
    keys = np.sort(rng.integers(0, 2**32, size=(30, 2), dtype=np.uint64).astype(np.uint32), axis=0)
    ident = {"sequence_ids": np.arange(30, dtype=np.int64), "positions": np.full(30, 3, np.int32),
             "token_ids": rng.integers(0, 100, 30).astype(np.int32)}
    other = {**ident, "token_ids": ident["token_ids"][::-1].copy()}
    settings = {"row_len": 64, "skip_positions": 0, "dtype": "float32", "bos": "off"}
    root = tmp_path / "m"
    _step(root / "step9", x, keys, settings, identity=ident)
    _step(root / "step1", x, keys, settings, identity=ident)
    _step(root / "step2", x, keys, settings, identity=other)
    _step(root / "step3", x, keys, settings)
    _step(root / "step4", x, keys, {**settings, "bos": "on"}, identity=ident)
    doc = sweep_files.sweep_cka({"m": [(r, root / r) for r in ("step1", "step2", "step3", "step4", "step9")]})
    doc = doc["m"]["checkpoints"]
    assert doc["step1"] is not None and doc["step3"] is not None and np.allclose(doc["step1"], cka_matrix(x, x))
    assert doc["step2"] is None and doc["step4"] is None
    assert {k: v.tolist() for k, v in sweep_files.read_sample_tokens(root / "step2").items()} == \
        {k: v.tolist() for k, v in other.items()} and sweep_files.read_sample_tokens(root / "step3") is None


def test_sample_identity_recovered_from_keys():
    """stats.sample.identify: the sampled tokens' sequence ids, positions and token ids from their keys
    alone, over chunks of the cache (sequences of 1 to 9 tokens, chunks of 16)."""
    import jax.numpy as jnp

    from isojax.stats.sample import identify, token_keys
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 10, 40)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 1000, offsets[-1]).astype(np.int32)
    flat = rng.choice(offsets[-1], 25, replace=False)
    seq = np.searchsorted(offsets, flat, "right") - 1
    pos = flat - offsets[seq]
    keys = np.asarray(token_keys(jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.ones(25, bool)))
    got = identify(keys, offsets, tokens, chunk=16)
    assert got["sequence_ids"].tolist() == seq.tolist() and got["positions"].tolist() == pos.tolist()
    assert got["token_ids"].tolist() == tokens[flat].tolist()
