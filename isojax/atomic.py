"""Write one file (write_atomic) or one folder (staged_dir, a cache entry) completely or not at
all. Result folders of commands (--out) have their own rules: isojax.run.outdir."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path


def fsync_dir(path) -> None:
    """Make the renames and new names in a folder durable (a rename lives in the folder's entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, but alive
        return True
    return True


def _clean_dead(path: Path) -> None:
    """Temporary files of `path` left by runs on this host whose process is gone (killed mid-write):
    named .NAME.tmp-HOST-PID-RANDOM, so a live writer's, or another host's, is never touched."""
    prefix = f".{path.name}.tmp-"
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            if p.name.startswith(prefix):
                h, _, pid = p.name[len(prefix):].rpartition("-")[0].rpartition("-")
                if h == host and pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        p.unlink()


def write_atomic(path, data: str | bytes) -> None:
    """Replace `path` by `data` in one rename; on any failure the earlier file is unchanged and the
    temporary file is gone."""
    path = Path(path)
    _clean_dead(path)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_dir(dst):
    """Yields a fresh folder beside `dst`; when the block ends without an exception it becomes
    `dst` (a folder already there is moved aside first and removed only once the new one is in
    place, so a failure at any point leaves the old one whole); on an exception it is removed."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            dst.rename(old / dst.name)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
