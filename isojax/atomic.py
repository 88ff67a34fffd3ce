"""Write a folder completely or not at all: staged beside its destination, swapped in when done."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def staged_dir(dst):
    """Yields a fresh folder beside `dst`; when the block ends without an exception it becomes
    `dst` (a folder already there is moved aside first and removed only once the new one is in
    place, so a failure at any point leaves the old results whole); on an exception it is removed."""
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
