"""End to end: `python -m isojax.extract` against float64 metrics from Hugging Face hidden states."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import ACCELERATOR_ENV, ACCELERATOR_FLAGS, TOKENIZER_JSON, build_hf_checkpoint, hf_states, need
from isojax.run.plan import CPU_DEFAULT_MAX_TOKENS
from isojax.extract import main

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was that for it with as his on be at by had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so "
         "said what up its about into than them can only other new some could time these two may then do "
         "first any my now such like our over man me even most made after also did many before must through "
         "back years where much your way well down should because each just those people how too little").split()


def write_pile_jsonl(path: Path, n_docs: int, seed: int) -> list[tuple[str, str]]:
    """Short documents from two Pile-style sources; returns (source, text) in file order."""
    rng = np.random.default_rng(seed)
    docs = []
    with open(path, "w") as f:
        for i in range(n_docs):
            src = ["Enron Emails", "HackerNews"][i % 2]
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
            docs.append((src, text))
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": src}}) + "\n")
    return docs


def reference_metrics(states: list[np.ndarray], ids: list[np.ndarray]) -> list[dict]:
    """float64 metrics of each state from per-sequence HF states, by the papers' definitions."""
    X_all = np.concatenate(states, axis=1)  # [S, n, D]
    ids_all = np.concatenate(ids)
    out = []
    for X in X_all:
        n = len(X)
        U = X / np.linalg.norm(X, axis=1, keepdims=True)
        cos = U @ U.T
        inter = (cos.sum() - np.trace(cos)) / (n * n - n)  # the O(n^2) definition, eq. 5
        intra, weights = [], []
        for t in np.unique(ids_all):
            sel = ids_all == t
            k = int(sel.sum())
            if k >= 2:
                c = cos[np.ix_(sel, sel)]
                intra.append((c.sum() - k) / (k * k - k))
                weights.append(k)
        sv = np.linalg.svd(X - X.mean(0), compute_uv=False)
        sv_u = np.linalg.svd(X, compute_uv=False)
        C = X - X.mean(0)
        Cu = C / np.linalg.norm(C, axis=1, keepdims=True)
        centered = ((Cu @ Cu.T).sum() - n) / (n * n - n)
        sv_unit = np.linalg.svd(U - U.mean(0), compute_uv=False)
        p = sv[sv > 0] / sv.sum()
        out.append({"unit_anisotropy": sv_unit[0] ** 2 / (sv_unit ** 2).sum(),
                    "effective_rank": np.exp(-(p * np.log(p)).sum())})
        out[-1].update({"inter_sim": inter, "centered_inter_sim": centered, "intra_sim": np.mean(intra), "intra_sim_weighted": np.average(intra, weights=weights),
                    "intra_tokens": len(intra), "anisotropy": sv[0] ** 2 / (sv ** 2).sum(),
                    "anisotropy_uncentered": sv_u[0] ** 2 / (sv_u ** 2).sum(),
                    "mean_norm": np.linalg.norm(X, axis=1).mean(), "count": n})
    return out


@pytest.mark.slow
def test_metrics_match_float64_reference_from_hugging_face(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    model = build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=64, num_layers=2, num_heads=4)
    docs = write_pile_jsonl(tmp_path / "pile.jsonl", 60, seed=3)
    out = tmp_path / "out"
    assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--unit", "document",
                 "--seq-len", "128", "--batch-tokens", "512", "--out", str(out), "--no-plots", "--centered",
                 "--save-token-sums"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    by_source = {}
    for src, text in docs:
        ids = np.array(tok.encode(text, add_special_tokens=False).ids)
        by_source.setdefault(src, []).append((hf_states(model, ids), ids))
    every = [x for v in by_source.values() for x in v]
    ref = reference_metrics([s for s, _ in every], [i for _, i in every])
    assert metrics["tokens"] == sum(len(i) for _, i in every) and metrics["sequences"] == len(docs)
    assert metrics["weights"] == "trained" and metrics["unit"] == "document"
    assert [layer["name"] for layer in metrics["layers"]] == ["embed", "block_1", "block_2", "final_ln"]
    for got, want in zip(metrics["layers"], ref):
        assert got["count"] == want["count"] and got["intra_tokens"] == want["intra_tokens"]
        for key in ("inter_sim", "centered_inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy",
                    "anisotropy_uncentered"):
            assert abs(got[key] - want[key]) < 2e-5, (got["name"], key, got[key], want[key])
        assert abs(got["mean_norm"] - want["mean_norm"]) < 2e-5 * want["mean_norm"]
    # per-token arrays: counts, IntraSim and unit sums of the most frequent token, every state
    import tensorstore as ts
    read = lambda name: ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(out / "tokens.zarr" / name)}}).result().read().result()
    ids_all = np.concatenate([i for _, i in every])
    top = int(np.bincount(ids_all).argmax())
    assert read("count")[top] == np.sum(ids_all == top)
    X_all = np.concatenate([s for s, _ in every], axis=1)
    unit_top = X_all[:, ids_all == top] / np.linalg.norm(X_all[:, ids_all == top], axis=2, keepdims=True)
    np.testing.assert_allclose(read("unit_sum")[:, top], unit_top.sum(1), rtol=1e-5, atol=1e-5)
    k = unit_top.shape[1]
    want_intra = ((unit_top.sum(1) ** 2).sum(-1) - k) / (k * k - k)
    np.testing.assert_allclose(read("intra_sim")[:, top], want_intra, atol=2e-5)
    for src, items in by_source.items():
        ref_src = reference_metrics([s for s, _ in items], [i for _, i in items])
        got_src = metrics["sources"][src]
        assert got_src["tokens"] == sum(len(i) for _, i in items)
        for got, want in zip(got_src["layers"], ref_src):
            for key in ("inter_sim", "anisotropy", "anisotropy_uncentered", "unit_anisotropy"):
                assert abs(got[key] - want[key]) < 2e-5, (src, got["name"], key)
            # final_ln's states lie in a hyperplane (LayerNorm): its zero eigenvalue, ~1e-7 of the
            # largest after float32 accumulation, is under the spectral floor (README "Measures")
            assert got["effective_rank"] == pytest.approx(want["effective_rank"], rel=1e-6), (src, got["name"])
    assert (out / "layers.csv").read_text().splitlines()[0].startswith("name,")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weight_checksum"].startswith("sha256:") and manifest["tokens"] == metrics["tokens"]
    assert not (out / "checkpoint").exists()


def run_cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "isojax.extract", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **(env or {})}, **kw)


def _read_zarr(path: Path) -> np.ndarray:
    import tensorstore as ts
    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()


@pytest.mark.slow
def test_interrupted_runs_resume_to_the_uninterrupted_metrics(tmp_path):
    """The accelerator configuration (ACCELERATOR: bfloat16, the default sample, --centered,
    --save-token-sums; XLA's paths for the GPU kernels), interrupted three ways on a first run
    (tokens streaming), then resumed on the cache: SIGKILL once the first checkpoint is written (the
    loop on past it); SIGKILL while the second checkpoint is half written (the resume takes the first);
    SIGTERM, as a cluster preempts, once the loop has handed the first checkpoint to its writer (exit
    143). Each equals an uninterrupted run: metrics, per-token sums and sample. The faults come at
    points of the run (faults.py), not after a wait: a fast machine cannot finish first."""
    env = {"ISOJAX_CACHE": str(tmp_path / "cache"), **ACCELERATOR_ENV}
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 400, seed=4)
    common = ["--model", tmp_path / "ckpt", "--data", tmp_path / "pile.jsonl", "--unit", "document", "--seq-len", "64",
              "--batch-tokens", "128", "--no-plots", *ACCELERATOR_FLAGS]
    ways = {"sigkill": ({"ISOJAX_FAULT": "checkpoint_written:1"}, signal.SIGKILL),
            "half-written": ({"ISOJAX_FAULT": "checkpoint_write:2"}, signal.SIGKILL),
            "sigterm": ({"ISOJAX_FAULT": "checkpoint_saved:sigterm"}, signal.SIGTERM)}
    for i, (way, (extra_env, sig)) in enumerate(ways.items()):
        out = tmp_path / way
        # each way's first run is a first run: its own token cache, tokenized while it measures
        run_env = {**os.environ, **env, "ISOJAX_CACHE": str(tmp_path / f"cache{i}"), **extra_env}
        proc = subprocess.Popen([sys.executable, "-m", "isojax.extract", *map(str, common), "--out", out,
                                 "--checkpoint-every-tokens", "300"], cwd=REPO, env=run_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=300)
        assert not (out / "metrics.json").exists(), f"{way}: the run ended before its fault"
        if sig == signal.SIGTERM:
            assert proc.returncode == 143 and "--resume" in err.splitlines()[-1], err[-2000:]
        else:
            assert proc.returncode == -signal.SIGKILL, err[-2000:]
        if way == "half-written":
            assert any(p.name.startswith(".tmp-") for p in (out / "checkpoint").iterdir())
        again = run_cli(*common, "--out", out, "--resume", env={**env, "ISOJAX_CACHE": str(tmp_path / f"cache{i}")})
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resuming after" in again.stderr, again.stderr[-2000:]
        if way == "half-written":
            assert "checkpoint step 1 " in again.stderr or "(checkpoint step" in again.stderr
    assert run_cli(*common, "--out", tmp_path / "full", env=env).returncode == 0
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert full["dtype"] == "bfloat16" and full["layers"][0]["sample_tokens"] > 4096  # the accelerator defaults
    for way in ways:
        cut = json.loads((tmp_path / way / "metrics.json").read_text())
        assert cut["tokens"] == full["tokens"] and cut["sequences"] == full["sequences"], way
        for a, b in zip(cut["layers"], full["layers"]):
            assert a["count"] == b["count"] and a["intra_tokens"] == b["intra_tokens"], way
            for key in ("inter_sim", "intra_sim", "anisotropy", "mean_norm", "centered_inter_sim",
                        "anisotropy_batch_mean"):
                assert abs(a[key] - b[key]) <= 1e-12 * max(1.0, abs(b[key])), (way, key)
        for name in ("tokens.zarr/unit_sum", "tokens.zarr/count", "samples.zarr/states"):
            if name == "samples.zarr/states" and not (tmp_path / "full" / name).exists():
                continue
            np.testing.assert_array_equal(_read_zarr(tmp_path / way / name), _read_zarr(tmp_path / "full" / name))
        assert not (tmp_path / way / "checkpoint").exists(), way


@pytest.mark.slow
def test_default_run_offline(tmp_path):
    """No arguments but --out: pythia-70m's shapes with random weights (offline), default corpus."""
    proc = run_cli("--out", tmp_path / "out", env={"ISOJAX_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
                                                   "HF_HOME": str(tmp_path / "hf")}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM WEIGHTS" in proc.stderr
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["weights"] == "random" and metrics["model"] == "random:pythia-70m"
    assert len(metrics["layers"]) == 8 and metrics["tokens"] >= CPU_DEFAULT_MAX_TOKENS
    assert all(-1 <= layer["inter_sim"] <= 1 for layer in metrics["layers"])
    assert {"similarity.png", "anisotropy.png", "norms.png"} <= {p.name for p in (tmp_path / "out" / "plots").iterdir()}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"] == "gpt-neox-20b (bundled)"  # real GPT-NeoX tokens, not bytes
    assert metrics["layers"][0]["intra_tokens"] > 1000
    # every second accounted for: the phases add up to the wall time
    timings = manifest["timings"]
    assert set(timings) == {"load", "convert", "tokenize", "compile", "loop", "merge", "finalize", "write", "plots"}
    assert abs(sum(timings.values()) - manifest["seconds_wall"]) < 0.05 * manifest["seconds_wall"] + 0.5
    assert "wall" in proc.stderr.splitlines()[-1] and "device loop" in proc.stderr.splitlines()[-1]


@pytest.fixture(scope="module")
def small_vocab_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "ckpt"
    build_hf_checkpoint(path, vocab_size=512)  # the real tokenizer has 50k tokens: too many for this model
    return path


@pytest.mark.slow
def test_bad_inputs_exit_cleanly(tmp_path, small_vocab_checkpoint):
    env = {"ISOJAX_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    truncated = tmp_path / "truncated"
    build_hf_checkpoint(truncated, vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "metrics.json").write_text("{}")
    cases = [
        (["--model", "pythia-7b"], "pythia-1.4b"),                           # unknown model: lists presets
        (["--model", "random:pythia-70m", "--data", tmp_path / "nope.txt"], "nope.txt"),
        (["--model", "random:pythia-70m", "--data", empty], "empty"),
        (["--model", truncated], "model.safetensors"),
        (["--model", small_vocab_checkpoint], "larger than the model"),
        (["--model", "random:gpt-neox-20b"], "do not fit"),                  # refused before allocating
        (["--model", "random:gpt-neox-20b", "--data", tmp_path / "nope.txt"], "nope.txt"),  # inputs first
        (["--model", "random:pythia-70m", "--attention", "cudnn", "--dtype", "float32"], "cudnn"),
        (["--model", "random:pythia-70m", "--attention", "packed", "--dtype", "bfloat16"], "GPU kernel"),
        (["--model", "random:pythia-70m", "--mlp-kernel", "mosaic", "--dtype", "bfloat16"], "mlp kernel mosaic"),
        (["--model", "random:pythia-70m", "--norm-kernel", "pallas", "--dtype", "bfloat16"], "norm kernel pallas"),
        (["--model", "random:pythia-70m", "--mesh", "data=3"], "does not divide"),
        (["--max-tokens", "0"], "positive integer"),
    ]
    for args, needle in cases:
        proc = run_cli(*args, "--out", tmp_path / "o", env=env)
        assert proc.returncode == 2, (args, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr and needle in proc.stderr, (args, proc.stderr[-1500:])
    proc = run_cli("--model", "random:pythia-70m", "--out", tmp_path / "done", env=env)
    assert proc.returncode == 2 and "isojax did not write" in proc.stderr  # a metrics.json of the user's
    assert (tmp_path / "done" / "metrics.json").read_text() == "{}"  # untouched


@pytest.mark.slow
def test_bfloat16_run_within_documented_tolerance_of_float32(tmp_path, monkeypatch):
    """README 'bfloat16': metrics of a bf16 run within 2e-3 absolute (cosines, anisotropy) of the
    float32 run of the same checkpoint and tokens; measured ~1e-4 on random pythia-70m."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=64, num_layers=2, num_heads=4)
    write_pile_jsonl(tmp_path / "pile.jsonl", 60, seed=5)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--dtype", dtype,
                     "--seq-len", "128", "--batch-tokens", "512", "--out", str(out), "--no-plots"]) == 0
        runs[dtype] = json.loads((out / "metrics.json").read_text())
    assert runs["bfloat16"]["dtype"] == "bfloat16"
    worst = 0.0
    for a, b in zip(runs["float32"]["layers"], runs["bfloat16"]["layers"]):
        for key in ("inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "anisotropy_uncentered"):
            worst = max(worst, abs(a[key] - b[key]))
        assert abs(a["mean_norm"] - b["mean_norm"]) < 1e-2 * a["mean_norm"]
    assert 1e-7 < worst < 2e-3, worst  # it really ran in bf16, and stayed close


@pytest.mark.slow
def test_overwrite_replaces_all_results(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 20, seed=6)
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--seq-len", "64",
            "--batch-tokens", "256", "--out", str(tmp_path / "out"), "--no-plots"]
    assert main(args) == 0 and (tmp_path / "out" / "tokens.zarr").is_dir()
    assert main(args + ["--no-token-stats"]) == 2  # refused without --overwrite, results untouched
    assert (tmp_path / "out" / "tokens.zarr").is_dir()
    assert main(args + ["--no-token-stats", "--overwrite"]) == 0
    assert not (tmp_path / "out" / "tokens.zarr").exists()  # nothing stale from the first run
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["layers"][0]["intra_sim"] is None and metrics["layers"][0]["inter_sim"] is not None
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".partial")]


@pytest.mark.slow
def test_sample_states_intrinsic_dimension_and_batch_anisotropy(tmp_path, monkeypatch):
    """--sample-states: metrics.json's intrinsic dimension equals scikit-dimension on the sample
    written to samples.zarr, and the batch anisotropy numpy's SVD of its batches of 4096."""
    skdim = need("skdim")
    import tensorstore as ts

    from isojax.stats import intrinsic

    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=64, num_layers=1, num_heads=4)
    write_pile_jsonl(tmp_path / "pile.jsonl", 500, seed=8)
    out = tmp_path / "out"
    common = ["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--seq-len", "128",
              "--batch-tokens", "2048", "--no-plots"]
    assert main(common + ["--out", str(out), "--sample-states", "8200"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(out / "samples.zarr" / "states")}})
    sample_SxKxD = np.asarray(store.result().read().result(), np.float64)
    assert sample_SxKxD.shape == (3, 8200, 64)
    for layer, x in zip(metrics["layers"], sample_SxKxD):
        assert layer["sample_tokens"] == 8200 and layer["anisotropy_batches"] == 2
        ratios = []
        for b in range(2):
            xb = x[b * 4096:(b + 1) * 4096]
            sv = np.linalg.svd(xb - xb.mean(0), compute_uv=False)
            ratios.append(sv[0] ** 2 / (sv ** 2).sum())
        assert abs(layer["anisotropy_batch_mean"] - np.mean(ratios)) < 1e-9
        assert abs(layer["anisotropy_batch_std"] - np.std(ratios, ddof=1)) < 1e-9
        if layer["name"] == "embed":  # one row per token type, repeated: undefined
            assert layer["intrinsic_dimension"]["twonn"] is None
            continue
        # the estimators are checked against scikit-dimension in test_intrinsic.py; here, that
        # they ran on this sample (repeated contexts give duplicate rows, which skdim mishandles
        # above 25 dimensions: test_intrinsic.py)
        want = intrinsic.intrinsic_dimensions(x, k=20)
        for key in ("twonn", "mle", "mom"):
            assert abs(layer["intrinsic_dimension"][key] - want[key]) < 1e-6 * want[key], key
        unique = np.unique(x, axis=0)
        assert abs(intrinsic.mle(unique) - skdim.id.MLE().fit(unique, n_neighbors=20).dimension_) < 1e-3 * want["mle"]
    assert "intrinsic_dimension_twonn" in (out / "layers.csv").read_text().splitlines()[0]
    tokens = metrics["tokens"]
    for args, needle in ((["--sample-states", str(tokens + 1)], "more than"), (["--sample-states", "15"], "too small")):
        assert main(common + ["--out", str(tmp_path / "bad")] + args) == 2
        assert not (tmp_path / "bad" / "metrics.json").exists()


def test_cuda_graphs_for_loops_respects_the_users_xla_flags(monkeypatch):
    from isojax.extract import use_cuda_graphs_for_loops
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    use_cuda_graphs_for_loops()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_gpu_enable_command_buffer=+WHILE",
                                               "--xla_gpu_enable_command_buffer=+CONDITIONAL"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    use_cuda_graphs_for_loops()
    assert os.environ["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=4 --xla_gpu_enable_command_buffer=+WHILE")
    mine = "--xla_gpu_enable_command_buffer=FUSION"
    monkeypatch.setenv("XLA_FLAGS", mine)
    use_cuda_graphs_for_loops()
    assert os.environ["XLA_FLAGS"] == mine
