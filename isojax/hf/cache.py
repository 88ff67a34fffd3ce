"""Deleting, from the Hugging Face cache, the files a sweep downloaded, once their checkpoint is
measured (`--delete-downloads`): 21 checkpoints of pythia-12b are ~500 GB.

The cache of a repository is HF_HUB_CACHE/models--ORG--NAME/ with `blobs/<etag>` (the bytes),
`snapshots/<commit>/<path>` (symlinks to the blobs, or copies where symlinks are not available) and
`refs/<branch>` (the commit of a branch), `trees/<commit>.json` (its file list). What was there when the sweep started is recorded
(`Downloads`), and after a step only what was not there then is deleted: the step's snapshot
entries and the blobs they point to, except a blob another snapshot entry still points to (two
revisions sharing a file: the next step's, fetched while this one was measured, keeps it). So a
file cached before the run, or one a killed earlier run left, is never deleted; refs (a few bytes)
stay. Another process downloading the same new blobs at the same time is not guarded against.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


def repo_folder(repo_id: str) -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def _entries(folder: Path) -> set[str]:
    """Every file, symlink and folder under folder, by the real path of the folder holding it
    (a symlink is itself, not its target)."""
    out = set()
    for root, dirs, files in os.walk(folder):
        real = os.path.realpath(root)
        out.update(os.path.join(real, n) for n in [*files, *dirs])
    return out


def _is_file(entry: str) -> bool:
    return os.path.islink(entry) or os.path.isfile(entry)


def snapshot_of(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of a revision (a branch through refs/, or a commit), if any."""
    folder = repo_folder(repo_id)
    rev = revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None:
        try:
            commit = (folder / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snap = folder / "snapshots" / commit
    return snap if snap.is_dir() else None


class Downloads:
    """What the cache held for some repositories when a sweep began; `release` deletes a measured
    revision's files that came later."""

    def __init__(self, repo_ids):
        self.before = {r: _entries(repo_folder(r)) for r in set(repo_ids)}

    def release(self, repo_id: str, revision: str | None, keep=()) -> int:
        """Delete the files of `revision` downloaded since the sweep began; `keep`: revisions still
        to be measured (a snapshot they share is left whole). Returns the bytes freed."""
        snap = snapshot_of(repo_id, revision)
        if snap is None or any(snapshot_of(repo_id, k) == snap for k in keep):
            return 0
        before = self.before.get(repo_id, set())
        real_snap = os.path.realpath(snap)
        mine = {e for e in _entries(snap) if e not in before and _is_file(e)}
        others = [e for e in _entries(repo_folder(repo_id) / "snapshots") if e not in mine and _is_file(e)]
        still_used = {os.path.realpath(e) for e in others}
        blobs = os.path.realpath(repo_folder(repo_id) / "blobs")
        freed = 0
        for entry in sorted(mine):
            target = os.path.realpath(entry) if os.path.islink(entry) else None
            with contextlib.suppress(FileNotFoundError):
                if target is None:
                    freed += os.path.getsize(entry)
                os.unlink(entry)
            if target and os.path.dirname(target) == blobs and target not in before and target not in still_used:
                with contextlib.suppress(FileNotFoundError):
                    freed += os.path.getsize(target)
                    os.unlink(target)
        listing = os.path.join(os.path.realpath(repo_folder(repo_id) / "trees"), f"{snap.name}.json")
        if listing not in before:  # huggingface_hub's cached file list of that commit
            with contextlib.suppress(FileNotFoundError):
                os.unlink(listing)
        for root, dirs, files in os.walk(real_snap, topdown=False):  # folders left empty and new
            if root not in before and not os.listdir(root):
                with contextlib.suppress(OSError):
                    os.rmdir(root)
        return freed
