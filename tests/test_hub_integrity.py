"""Hub downloads that go wrong quietly (issue 36): an LFS file's CDN that sends nothing, and a file
whose bytes arrive damaged at the right length. The loopback hub (tests/hub_server.py) redirects
LFS files to a second server, as the Hub does to its CDN, and the real huggingface_hub client
downloads in a subprocess, as a user's run does."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

import pytest

from conftest import build_hf_checkpoint
from hub_server import LoopbackHub
from isojax.errors import UserError
from isojax.hf import network, verify
from test_hub import hub_env, last_line, py, resolve

REPO_ID = "tiny-org/neox-i"


def hf_file_tries() -> int:
    """How many times huggingface_hub's http_get tries a file that sends nothing: once, then
    `_nb_retries` resumes."""
    from huggingface_hub.file_download import http_get
    return inspect.signature(http_get).parameters["_nb_retries"].default + 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "main"
    build_hf_checkpoint(d, seed=3, vocab_size=512, hidden_size=32, num_layers=1, num_heads=2)
    return d


@pytest.fixture
def hub(folder):
    h = LoopbackHub().start().start_cdn()
    h.add_model(REPO_ID, {"main": folder})
    yield h
    h.stop()


def cache_of(env) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{REPO_ID.replace('/', '--')}"


def errors(p) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


def test_a_cdn_that_sends_nothing_is_tried_as_huggingface_hub_says_once(hub, tmp_path):
    """The weight file's CDN takes the connection and sends nothing: huggingface_hub's tries of it
    (not those times isojax's 3), then one error naming the file and the CDN's host."""
    stall = hub.fail(r"^/lfs/", delay=60, times=-1, methods=("GET",))
    p = resolve(REPO_ID, None, hub_env(hub.url, tmp_path, HF_HUB_DOWNLOAD_TIMEOUT=1))
    assert p.returncode == 2, p.stderr[-3000:]
    assert errors(p) == [last_line(p)] and "Traceback" not in p.stderr
    assert "model.safetensors" in last_line(p) and hub.cdn_url in last_line(p), last_line(p)
    assert "sent nothing" in last_line(p) and "HF_HUB_DOWNLOAD_TIMEOUT" in last_line(p)
    assert stall.hits == hf_file_tries() == 6


def test_a_cdn_that_fails_is_tried_by_isojax_and_named(hub, tmp_path):
    """A 5xx from the CDN: huggingface_hub tries a file's GET once on a 5xx, isojax 3 times in all;
    the error names the file, the host and the status."""
    from isojax.hf.files import API_ATTEMPTS
    hub.fail(r"^/lfs/", status=503, times=-1, methods=("GET",))
    p = resolve(REPO_ID, None, hub_env(hub.url, tmp_path))
    assert p.returncode == 2, p.stderr[-3000:]
    assert errors(p) == [last_line(p)] and "Traceback" not in p.stderr
    assert "model.safetensors" in last_line(p) and hub.cdn_url in last_line(p) and "503" in last_line(p), last_line(p)
    assert len(hub.seen(r"^/lfs/", "GET")) == API_ATTEMPTS == 3


def test_damaged_bytes_are_an_error_and_leave_the_cache(hub, folder, tmp_path):
    """A weight file whose bytes arrive flipped (length kept) is refused before use and removed
    from the cache; the next run downloads it again. A cached blob damaged later is found too."""
    env = hub_env(hub.url, tmp_path)
    sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    blob = cache_of(env) / "blobs" / sha
    hub.fail(r"^/lfs/", corrupt=True, methods=("GET",))
    p = resolve(REPO_ID, None, env)
    assert p.returncode == 2, p.stderr[-3000:]
    assert errors(p) == [last_line(p)] and "model.safetensors" in last_line(p) and "damaged" in last_line(p)
    assert not blob.exists() and not list(cache_of(env).rglob("model.safetensors"))

    p = resolve(REPO_ID, None, env)  # the fault was spent: a clean download
    assert p.returncode == 0, p.stderr[-3000:]
    local = Path(p.stdout.split()[1])
    assert (local / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert len(hub.seen(r"^/lfs/", "GET")) == 2

    data = bytearray(blob.read_bytes())  # damaged in the cache afterwards, in place
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    p = resolve(REPO_ID, None, dict(env, HF_HUB_OFFLINE="1"))
    assert p.returncode == 2 and "model.safetensors" in last_line(p) and "damaged" in last_line(p), p.stderr[-3000:]
    assert not blob.exists()


def test_a_damaged_tokenizer_from_the_hub_is_an_error_and_leaves_the_cache(hub, folder, tmp_path):
    """The tokenizer taken from the hub for a checkpoint without one (load_tokenizer's hub_repo, which
    asks _from_hub) is checked as the weights are: a copy damaged in the cache is one error naming it, and is removed."""
    env = hub_env(hub.url, tmp_path)
    code = f"""
from pathlib import Path
from isojax.errors import UserError
from isojax.hf.tokenizer import _from_hub
try:
    print("ok", _from_hub({REPO_ID!r}))
except UserError as e:
    print("error:", e)
"""
    first = py(code, env)
    assert first.returncode == 0 and first.stdout.startswith("ok "), first.stdout + first.stderr[-2000:]
    data = (folder / "tokenizer.json").read_bytes()
    blob = cache_of(env) / "blobs" / hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 1
    blob.write_bytes(bytes(damaged))
    again = py(code, dict(env, HF_HUB_OFFLINE="1"))
    assert again.stdout.startswith("error: tokenizer.json of tiny-org/neox-i@main is damaged"), again.stdout
    assert not blob.exists()


def fake_snapshot(root: Path, files: dict, listing: bool) -> Path:
    """A Hugging Face cache folder of one commit: blobs named by the hub's hashes, snapshot links."""
    commit = "c" * 40
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    entries = {}
    for name, data in files.items():
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        sha = hashlib.sha256(data).hexdigest()
        lfs = name.endswith(".safetensors")
        (root / "blobs" / (sha if lfs else git)).write_bytes(data)
        (snap / name).symlink_to(root / "blobs" / (sha if lfs else git))
        entries[name] = dict(size=len(data), blob_id=git, **(dict(lfs_sha256=sha, lfs_size=len(data)) if lfs else {}))
    if listing:
        (root / "trees").mkdir()
        (root / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": entries}))
    return snap


@pytest.mark.parametrize("listing", [True, False])
def test_verified_files_are_hashed_once_and_a_changed_one_again(tmp_path, monkeypatch, listing):
    """A file that matched the hub's hash is not hashed on the next use (its marker holds its
    stat); one changed in place is, and damage there is an error that removes it. Without the hub's
    listing the blob's name (its ETag) is the hash checked."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "isojax"))
    files = {"config.json": b'{"a": 1}', "model.safetensors": bytes(range(256)) * 9}
    snap = fake_snapshot(tmp_path / "models--o--n", files, listing)
    hashed = []
    real = verify.file_hash
    monkeypatch.setattr(verify, "file_hash", lambda path, kind: hashed.append(path.name) or real(path, kind))
    names = ["config.json", "model.safetensors"]
    verify.verify_snapshot(snap, names, "o/n@main")
    assert len(hashed) == 2
    verify.verify_snapshot(snap, names, "o/n@main")
    assert len(hashed) == 2  # the markers spared both

    weights = Path(os.path.realpath(snap / "model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x10
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later write, whatever the clock's grain
    with pytest.raises(UserError, match=r"model\.safetensors of o/n@main is damaged: its sha256"):
        verify.verify_snapshot(snap, names, "o/n@main")
    assert len(hashed) == 3 and not weights.exists() and not (snap / "model.safetensors").is_symlink()


def test_a_file_download_that_timed_out_is_not_tried_again_by_isojax():
    """huggingface_hub tried a file 6 times already, wherever the hub sent its download; its API
    requests get isojax's tries."""
    import httpx2
    cdn = httpx2.ReadTimeout("timed out", request=httpx2.Request("GET", "http://127.0.0.9:1/lfs/" + "a" * 64))
    api = httpx2.ReadTimeout("timed out", request=httpx2.Request("GET", "http://127.0.0.9:2/api/models/o/n"))
    assert not network.transient_api_error(cdn)
    assert network.transient_api_error(api)
