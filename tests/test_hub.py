"""isojax against a Hugging Face hub on 127.0.0.1 (tests/hub_server.py): the real `huggingface_hub`
and `datasets` clients, HF_ENDPOINT pointing at the loopback hub, HF_HOME a temporary folder, no
other network. Every command runs in a subprocess, as a user runs it (huggingface_hub reads its
environment when imported)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import build_hf_checkpoint
from hub_server import LoopbackHub

REPO = Path(__file__).resolve().parents[1]
A, B, DATA = "tiny-org/neox-a", "tiny-org/neox-b", "tiny-org/pile-tiny"
SOURCES = ["Enron Emails", "HackerNews", "Github"]
WORDS = ("the model reads a sentence and every layer keeps its state while tokens pass through heads of "
         "attention that weigh words by their meaning in context").split()
SMALL = dict(vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)


def write_zst_jsonl(path: Path, n_docs: int, seed: int) -> None:
    import zstandard
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 30))))
        lines.append(json.dumps({"text": text, "meta": {"pile_set_name": SOURCES[i % len(SOURCES)]}}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))


def save_bin(model, directory: Path) -> None:
    """pytorch_model.bin beside what save_pretrained wrote (it writes safetensors only)."""
    import torch
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "pytorch_model.bin")


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Folders of the repositories' branches, built once for the module:
    A: step0, step1000 (sharded safetensors), main (model.safetensors AND pytorch_model.bin);
    B: step0, step1000, main, .bin only; DATA: Pile-shaped .jsonl.zst shards."""
    root = tmp_path_factory.mktemp("repos")
    a = {r: root / "a" / r for r in ("step0", "step1000", "main")}
    build_hf_checkpoint(a["step0"], seed=0, **SMALL)
    build_hf_checkpoint(a["step1000"], seed=1, max_shard_size="4MB", **SMALL)
    save_bin(build_hf_checkpoint(a["main"], seed=2, **SMALL), a["main"])
    b = {r: root / "b" / r for r in ("step0", "step1000", "main")}
    for seed, r in enumerate(b):
        save_bin(build_hf_checkpoint(b[r], seed=10 + seed, **dict(SMALL, hidden_size=48)), b[r])
        (b[r] / "model.safetensors").unlink()
    data = root / "data"
    write_zst_jsonl(data / "test.jsonl.zst", 120, seed=1)
    write_zst_jsonl(data / "train" / "00.jsonl.zst", 60, seed=2)
    write_zst_jsonl(data / "train" / "01.jsonl.zst", 60, seed=3)
    (data / "README.md").write_text("---\nlicense: other\n---\n# a Pile-shaped test corpus\n")
    return {"a": a, "b": b, "data": {"main": data}}


@pytest.fixture
def hub(repos):
    h = LoopbackHub().start()
    h.add_model(A, repos["a"])
    h.add_model(B, repos["b"])
    h.add_dataset(DATA, repos["data"])
    yield h
    h.stop()


def hub_env(hub_url: str, home: Path, **extra) -> dict:
    """The environment of a user whose HF_ENDPOINT is the loopback hub, with an empty cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in ("TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0",
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5",
               HF_HUB_DOWNLOAD_TIMEOUT="5", ISOJAX_CACHE=str(home / "isojax-cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def env(hub, tmp_path):
    return hub_env(hub.url, tmp_path)


def run(*args, env, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def py(code: str, env):
    return run("-c", code, env=env)


def last_line(proc) -> str:
    lines = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# --- the server speaks what the real clients need ----------------------------------------------

def test_real_client_downloads_refs_tree_and_errors(hub, env, repos):
    code = f"""
import huggingface_hub as h, json
api = h.HfApi()
refs = api.list_repo_refs({A!r})
info = api.model_info({A!r}, revision="step1000")
files = api.list_repo_files({A!r}, revision="step1000")
d = h.snapshot_download({A!r}, revision="step1000")
f = h.hf_hub_download({B!r}, "pytorch_model.bin", revision="step0")
errs = {{}}
for what, call in [("rev", lambda: h.hf_hub_download({A!r}, "config.json", revision="step9")),
                   ("entry", lambda: h.hf_hub_download({A!r}, "nope.json")),
                   ("repo", lambda: h.hf_hub_download("tiny-org/none", "config.json"))]:
    try:
        call()
    except Exception as e:
        errs[what] = type(e).__name__
print(json.dumps(dict(refs=sorted(b.name for b in refs.branches), sha=info.sha, files=sorted(files), d=d, f=f,
                      errs=errs)))
"""
    p = py(code, env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["refs"] == ["main", "step0", "step1000"]
    assert out["sha"] == hub.repos[("model", A)].branches["step1000"].commit
    assert "model.safetensors.index.json" in out["files"]
    local = Path(out["d"])
    for name in out["files"]:
        assert (local / name).read_bytes() == (repos["a"]["step1000"] / name).read_bytes()
    assert Path(out["f"]).read_bytes() == (repos["b"]["step0"] / "pytorch_model.bin").read_bytes()
    assert out["errs"] == {"rev": "RevisionNotFoundError", "entry": "RemoteEntryNotFoundError",
                           "repo": "RepositoryNotFoundError"}
