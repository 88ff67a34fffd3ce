"""The GPU lane: what a GPU user runs, on real GPUs, with every default (bfloat16, the default
sample, the packed attention, the fused MLP and LayerNorm kernels where they apply).

Run by bench/gpu_lane.sh on a GPU host (`pytest -m gpu`), which records the outcome in
bench/GPU_LANE.md; skipped without a GPU. Each run is a real `python -m isojax.extract` process:
killed (SIGKILL at a chosen batch, ISOJAX_FAULT) and resumed on 1 GPU and on 2, two processes of
one GPU each twice in a row, 1 against 2 GPUs, a sweep of two revisions killed and resumed. The
kills come once a chosen checkpoint is complete, while the loop has gone on past it.

Tolerances: on one GPU a resumed run repeats the same kernels but the per-token scatter-add's
float atomics may add in another order (~1e-7 per sum); across device counts the rows meet the
statistics in another order too. README ("Devices, hosts, TPUs") states <= 1e-5 for bf16 runs.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import build_hf_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
KEYS = ("inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "anisotropy_uncentered",
        "anisotropy_batch_mean", "centered_inter_sim")
TOLERANCE = 1e-5


def _gpus() -> int:
    import jax
    return jax.device_count() if jax.default_backend() == "gpu" else 0


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    """A corpus of ~1.3M tokens (two sources, sentences; ~5 default batches of pythia-70m's shapes on
    one GPU) and a folder for the runs. Measured whole: every run but the sweep's reads it all; the
    sweep's --max-tokens is a budget of equal shares per source (its token cache holds no more)."""
    tmp = tmp_path_factory.mktemp("lane")
    rng = np.random.default_rng(0)
    words = np.array("the of and to in is was that for it with as his on be at by had not are but from or have "
                     "an they which one you were her all she there would their we him been has when who will more "
                     "no if out so said what up its about into than them can only other new some could time".split())
    with gzip.open(tmp / "corpus.jsonl.gz", "wt") as f:
        for i in range(17_000):
            sentences = [" ".join(rng.choice(words, int(rng.integers(4, 30)))).capitalize() + "." for _ in range(4)]
            f.write(json.dumps({"text": " ".join(sentences),
                                "meta": {"pile_set_name": ["Enron Emails", "HackerNews"][i % 2]}}) + "\n")
    return tmp


def extract(lane: Path, out: str, *args, gpus: str = "0", cache: str = "cache", fault: str | None = None,
            compile_cache: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "ISOJAX_CACHE": str(lane / cache)}
    env.pop("ISOJAX_DEFAULTS", None)  # the real defaults of the GPU
    if fault:
        env["ISOJAX_FAULT"] = fault
    if not compile_cache:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-m", "isojax.extract", "--out", str(lane / out), *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def common(lane: Path) -> list:
    return ["--model", "random:pythia-70m", "--data", lane / "corpus.jsonl.gz", "--no-plots", "--centered",
            "--save-token-sums"]


def metrics(lane: Path, out: str) -> dict:
    return json.loads((lane / out / "metrics.json").read_text())


def assert_close(a: dict, b: dict, what: str, tol: float = TOLERANCE) -> None:
    assert a["tokens"] == b["tokens"] and a["sequences"] == b["sequences"], what
    for x, y in zip(a["layers"], b["layers"]):
        assert x["count"] == y["count"] and x["intra_tokens"] == y["intra_tokens"], (what, x["name"])
        for key in KEYS:
            if x.get(key) is None and y.get(key) is None:
                continue
            assert abs(x[key] - y[key]) <= tol, (what, x["name"], key, x[key], y[key])
        assert abs(x["mean_norm"] - y["mean_norm"]) <= tol * x["mean_norm"], (what, x["name"])
    for name in a.get("sources", {}):
        for x, y in zip(a["sources"][name]["layers"], b["sources"][name]["layers"]):
            assert abs(x["inter_sim"] - y["inter_sim"]) <= tol, (what, name, x["name"])


def killed_and_resumed(lane: Path, out: str, gpus: str, kill_after_checkpoint: int) -> None:
    args = [*common(lane), "--checkpoint-every-tokens", 400_000]
    cut = extract(lane, out, *args, gpus=gpus, fault=f"checkpoint_written:{kill_after_checkpoint}")
    assert cut.returncode == -9, cut.stderr[-3000:]
    assert not (lane / out / "metrics.json").exists()
    again = extract(lane, out, *args, "--resume", gpus=gpus)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after" in again.stderr, again.stderr[-3000:]


def test_defaults_on_one_gpu_killed_and_resumed(lane):
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    whole = extract(lane, "one", *common(lane))
    assert whole.returncode == 0, whole.stderr[-3000:]
    manifest = json.loads((lane / "one" / "manifest.json").read_text())
    assert metrics(lane, "one")["dtype"] == "bfloat16"
    assert manifest["kernels"]["attention"] == "packed", manifest["kernels"]  # the GPU's own kernels ran
    if "H100" in manifest["device"]["kind"] or "H200" in manifest["device"]["kind"]:
        assert manifest["kernels"] == {"attention": "packed", "mlp": "mosaic", "norm": "pallas"}, manifest["kernels"]
    assert metrics(lane, "one")["layers"][0]["sample_tokens"] >= 16_384  # the default sample
    killed_and_resumed(lane, "one-resumed", "0", kill_after_checkpoint=2)
    assert_close(metrics(lane, "one"), metrics(lane, "one-resumed"), "1 GPU, killed and resumed")


def test_defaults_on_two_gpus_killed_and_resumed_and_equal_one(lane):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    if not (lane / "one" / "metrics.json").exists():  # run alone: the one-GPU run to compare with
        assert extract(lane, "one", *common(lane)).returncode == 0
    whole = extract(lane, "two", *common(lane), gpus="0,1")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_close(metrics(lane, "one"), metrics(lane, "two"), "1 against 2 GPUs")
    killed_and_resumed(lane, "two-resumed", "0,1", kill_after_checkpoint=2)
    assert_close(metrics(lane, "two"), metrics(lane, "two-resumed"), "2 GPUs, killed and resumed")


def test_two_processes_twice_in_a_row_equal_one(lane):
    """One GPU per process, joined by jax.distributed, with no persistent compilation cache (as a
    user runs it), twice: the second run once hung in XLA's compile."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    import socket
    for attempt in ("first", "second"):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        out = f"procs-{attempt}"
        env = {**os.environ, "ISOJAX_CACHE": str(lane / "cache")}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        procs = [subprocess.Popen([sys.executable, "-m", "isojax.extract", *map(str, common(lane)), "--out", str(lane / out),
                                   "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                                  cwd=REPO, env={**env, "CUDA_VISIBLE_DEVICES": str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, (attempt, err[-3000:])
        reference = "two" if (lane / "two" / "metrics.json").exists() else "one"
        assert_close(metrics(lane, reference), metrics(lane, out), f"two processes, {attempt} run")


def test_sweep_of_two_revisions_killed_and_resumed(lane):
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    for seed, rev in enumerate(("step1000", "step2000")):
        build_hf_checkpoint(lane / "repo" / rev, seed=seed, vocab_size=50304, hidden_size=256, num_layers=2,
                            num_heads=4)
    args = ["--model", lane / "repo", "--revisions", "step1000,step2000", "--data", lane / "corpus.jsonl.gz",
            "--max-tokens", 1_000_000, "--no-plots", "--checkpoint-every-tokens", 300_000]
    whole = extract(lane, "sweep", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    # 4 batches a step, a checkpoint after the 2nd and 4th: the 3rd is the second step's first
    cut = extract(lane, "sweep-resumed", *args, fault="checkpoint_written:3")
    assert cut.returncode == -9, cut.stderr[-3000:]
    # the first step's files are written beside the second's loop: committed by the kill, or not yet
    committed = (lane / "sweep-resumed" / "repo" / "step1000" / "metrics.json").exists()
    again = extract(lane, "sweep-resumed", *args, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("done earlier" in again.stderr) == committed and "resuming after" in again.stderr, again.stderr[-3000:]
    for rev in ("step1000", "step2000"):
        assert_close(metrics(lane, f"sweep/repo/{rev}"), metrics(lane, f"sweep-resumed/repo/{rev}"), f"sweep {rev}")


def test_too_little_device_memory_is_one_clear_error(lane):
    """A GPU shared down to 3% of its memory: refused with one `error:` line naming the flags that
    lower memory (by the plan before allocating, or by XLA's out-of-memory at compile or in the
    loop), never a traceback."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "ISOJAX_CACHE": str(lane / "cache"),
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.03"}
    proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", "random:pythia-1b", "--data",
                           str(lane / "corpus.jsonl.gz"), "--no-plots", "--out", str(lane / "oom")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("error:") and ("--batch-tokens" in last or "--mesh" in last), last
    assert not (lane / "oom" / "metrics.json").exists()
