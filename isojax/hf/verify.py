"""Every file of a hub snapshot is checked against the hash the hub lists for it before it is used:
huggingface_hub checks only the size of a plain download, so a weight file of the right length with
damaged bytes would be measured without a word.

The hub lists, per file of a commit, the sha256 of an LFS file (`lfs.sha256`) and the git blob id of
every file (sha1 of "blob {size}\\0" + content); snapshot_download keeps that listing in the cache as
`trees/<commit>.json`. Where there is none (a cache written by an older huggingface_hub), the blob's
name, the hub's ETag, is the same sha256 or git blob id. A file that does not match is removed from
the cache (its blob and its snapshot entry, so the next run downloads it again) and is an error.

Hashing costs a pass over the bytes (sha256 at several hundred MB/s on one core), so a verified file
is not hashed again: a marker under ISOJAX_CACHE/verified/<hash> holds the blob's size, mtime and
inode when it matched, and a later run with the same stat trusts it. A blob changed in place (new
mtime) or downloaded again (new inode) is hashed again; damage that keeps size, mtime and inode
(a disk's silent bit rot) is not seen.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from isojax.errors import UserError

CHUNK = 8 << 20


def file_hash(path: Path, kind: str) -> str:
    """sha256 of a file, or its git blob id (kind "git"), read 8 MB at a time."""
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listing(snapshot: Path) -> dict:
    """The hub's file list of the snapshot's commit, as huggingface_hub cached it ({} if none)."""
    try:
        return json.loads((snapshot.parent.parent / "trees" / f"{snapshot.name}.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _expected(entry: dict | None, blob: Path) -> tuple[str, str] | None:
    """(kind, hex digest) the hub lists for a file, else what its blob's name (the ETag) says."""
    if entry and entry.get("lfs_sha256"):
        return "sha256", entry["lfs_sha256"]
    if entry and entry.get("blob_id"):
        return "git", entry["blob_id"]
    if re.fullmatch(r"[0-9a-f]{64}", blob.name):
        return "sha256", blob.name
    if re.fullmatch(r"[0-9a-f]{40}", blob.name):
        return "git", blob.name
    return None


def _marker(digest: str) -> Path:
    return Path(os.environ.get("ISOJAX_CACHE", Path.home() / ".cache" / "isojax")) / "verified" / digest


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def verify_snapshot(snapshot: Path, names, label: str) -> None:
    """Check the files `names` (paths in the repo) of a cached hub snapshot against the hub's hashes;
    a damaged one is removed from the cache and raised as a UserError naming it (`label`: repo@rev)."""
    listing = _listing(snapshot)
    for name in names:
        entry = snapshot / name
        blob = Path(os.path.realpath(entry))
        expected = _expected(listing.get(name), blob) if blob.is_file() else None
        if expected is None:
            continue
        kind, digest = expected
        marker = _marker(digest)
        with contextlib.suppress(OSError):
            if marker.read_text() == _stamp(blob):
                continue
        got = file_hash(blob, kind)
        if got != digest:
            for p in {blob, entry}:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            what = "sha256" if kind == "sha256" else "git blob id"
            raise UserError(f"{name} of {label} is damaged: its {what} is {got[:12]}..., the hub lists "
                            f"{digest[:12]}...; removed from the Hugging Face cache, run again to download it anew")
        with contextlib.suppress(OSError):  # only a cost saved if it cannot be written
            marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
            tmp.write_text(_stamp(blob))
            os.replace(tmp, marker)
