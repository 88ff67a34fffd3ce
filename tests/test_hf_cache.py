"""--delete-downloads' rule on a Hugging Face cache laid out by hand (isojax.hf.cache): only what
came after the sweep began goes, never a blob another snapshot still points to, never a file
that was there before (the loopback hub's end-to-end test: test_hub.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isojax.hf import cache

REPO = "org/tiny"


def commit(c: str) -> str:
    return c * 40


def add(repo: Path, revision: str, files: dict, *, links: bool = True) -> Path:
    """A snapshot of `revision` (a branch) holding files {path: blob name}, as huggingface_hub
    writes it: blobs/NAME, snapshots/COMMIT/PATH -> ../../blobs/NAME, refs/REVISION."""
    snap = repo / "snapshots" / commit(revision[-1])
    for path, blob in files.items():
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        if not (repo / "blobs" / blob).exists():
            (repo / "blobs" / blob).write_bytes(blob.encode() * 100)
        entry = snap / path
        entry.parent.mkdir(parents=True, exist_ok=True)
        if links:
            entry.symlink_to(os.path.relpath(repo / "blobs" / blob, entry.parent))
        else:
            entry.write_bytes(blob.encode())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit(revision[-1]))
    return snap


@pytest.fixture
def repo(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return cache.repo_folder(REPO)


def test_only_what_the_sweep_downloaded_goes(repo):
    before = add(repo, "step0", {"config.json": "cfg", "model.safetensors": "w0"})  # cached before the run
    downloads = cache.Downloads([REPO])
    one = add(repo, "step1", {"config.json": "cfg", "tokenizer.json": "tok", "model.safetensors": "w1"})
    two = add(repo, "step2", {"config.json": "cfg", "tokenizer.json": "tok", "model.safetensors": "w2"})
    (repo / "trees").mkdir()
    (repo / "trees" / f"{one.name}.json").write_text("[]")

    assert cache.Downloads([REPO]).release(REPO, "step0") == 0  # all of it there before: nothing goes
    freed = downloads.release(REPO, "step1", keep=["step2"])
    assert freed == 200  # its own weights' blob; tok is step2's too, cfg was there before
    assert not one.exists() and not (repo / "blobs" / "w1").exists() and not (repo / "trees" / f"{one.name}.json").exists()
    assert all((two / f).read_bytes() for f in ("config.json", "tokenizer.json", "model.safetensors"))  # step2 whole
    assert (before / "config.json").read_bytes() and (before / "model.safetensors").read_bytes()
    downloads.release(REPO, "step2")
    assert sorted(p.name for p in (repo / "blobs").iterdir()) == ["cfg", "w0"]
    assert sorted(p.name for p in (repo / "snapshots").iterdir()) == [before.name]
    assert (repo / "refs" / "step2").exists()


def test_a_snapshot_still_to_be_measured_stays_and_copies_go(repo):
    downloads = cache.Downloads([REPO])
    snap = add(repo, "main", {"model.safetensors": "w"}, links=False)  # no symlinks: files in the snapshot
    (repo / "refs" / "step9").write_text(commit("n"))  # step9 and main: one commit
    assert downloads.release(REPO, "main", keep=["step9"]) == 0 and (snap / "model.safetensors").exists()
    assert downloads.release(REPO, "main") == 1 and not snap.exists()
    assert downloads.release(REPO, "step1") == 0  # never cached: nothing to do
