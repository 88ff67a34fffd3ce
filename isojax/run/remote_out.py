"""Result folders on Google Cloud Storage (--out gs://...): isojax.run.outdir's rules where there is
no rename and no flock. isojax.run.outdir hands gs:// URLs here.

Ownership, as in a local folder: OUT/.isojax-results.json (the record, the same format) names every
object isojax wrote under OUT with its size and sha256. isojax replaces or deletes only those;
any other object under OUT is the user's and stays, with or without --overwrite; a result name
taken by a user's object is an error.

Commit. The results are written into a local temporary folder, then:
  1. the journal OUT/.isojax-commit.json names every object about to be written
  2. every result object is uploaded (each upload replaces one object whole)
  3. the record is uploaded, last
  4. the earlier results the new record does not name are deleted, then the journal.
Readers accept a folder only with a record, no journal, and every recorded object there with
its size (and, for the objects they parse, its sha256). A run killed during 1-4 leaves the
journal: readers refuse the folder, and the next run into OUT takes the objects the journal names
as isojax's (replaced or deleted as recorded ones are) and commits anew. The earlier results
cannot be put back (their objects may be overwritten already): that run writes them again.
Lock. OUT/.isojax.lock is an object created only where none is (GCS checks the precondition
ifGenerationMatch=0 itself, so of two runs one creates it), holding its run's pid, host and start
time (and a random token, to know it for its own); deleted at the end, whatever the outcome, only
while it is still the one this run created. A second run is refused with the first's pid, host and
start time (outdir.Busy), or, with wait, polls until it is gone. A run that dies without unwinding
(SIGKILL, a VM lost) leaves it: on the same host a lock whose pid is gone is taken over, as a dead
run's flock is; from another host nothing can tell, so the refusal says how to delete it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

from isojax import storage
from isojax.errors import Busy, UserError
from isojax.log import log

RECORD = ".isojax-results.json"
JOURNAL = ".isojax-commit.json"
LOCK = ".isojax.lock"
POLL_S = 5.0  # how often a waiting run looks at a lock held elsewhere


def _top(rel: str) -> str:
    return rel.split("/", 1)[0]


def _read_json(url: storage.GsPath):
    try:
        return json.loads(storage.read_bytes(url))
    except FileNotFoundError:
        return None
    except ValueError:
        raise UserError(f"{url}: unreadable; delete it (isojax then treats every object there as yours)") from None


def read_record(out: storage.GsPath) -> dict | None:
    doc = _read_json(out / RECORD)
    if doc is not None and not (isinstance(doc, dict) and isinstance(doc.get("files"), dict)):
        raise UserError(f"{out / RECORD}: unreadable record of isojax's results; delete it (isojax then treats "
                        "every object there as yours)")
    return doc


def _journal(out: storage.GsPath) -> list[str]:
    doc = _read_json(out / JOURNAL)
    return [] if doc is None else list(doc.get("new", []))


def _ours(out: storage.GsPath) -> set[str]:
    """The objects isojax wrote under OUT: its record's, and those of a commit cut short."""
    return set((read_record(out) or {"files": {}})["files"]) | set(_journal(out))


def owned(out: storage.GsPath) -> list[str]:
    return sorted({_top(rel) for rel in (read_record(out) or {"files": {}})["files"]})


def check_path(out: storage.GsPath, inputs=()) -> None:
    """The bucket is there and the credentials reach it; OUT is no input of the command and lies in none."""
    storage.check(out)
    for given in filter(None, inputs):
        if storage.is_remote(given):
            src = str(storage.path(given))
            if src == out.url or src.startswith(out.url + "/") or out.url.startswith(src + "/"):
                raise UserError(f"--out {out} is, holds or lies in an input of this command ({given}); "
                                "choose another --out")


def _check_names(out: storage.GsPath, names, present: dict, ours: set) -> None:
    mine = {_top(rel) for rel in ours}
    for name in sorted(names):
        if name not in mine and any(rel == name or rel.startswith(name + "/") for rel in present):
            raise UserError(f"{out / name} exists and isojax did not write it (it is not in {out / RECORD}); "
                            "move it away or choose another --out")


def check_names(out: storage.GsPath, names=()) -> None:
    """outdir.claim's check of a gs:// OUT, under its lock: `names` are not the user's objects."""
    _check_names(out, names, storage.listing(out), _ours(out))


@contextlib.contextmanager
def lock(out: storage.GsPath, wait: bool = False):
    """Hold OUT/.isojax.lock for the block (the module's docstring): Busy where another run holds
    it, or with `wait`, once that one lets go."""
    url = out / LOCK
    mine = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "token": secrets.token_hex(8)}
    clear = (f"; if that run is gone (killed, its machine lost), delete the lock it left: gcloud storage rm {url}")
    waiting = False
    while not storage.create_bytes(url, json.dumps(mine)):
        found = storage.read_generation(url)
        if found is None:  # let go meanwhile
            continue
        holder, generation = _holder(found[0]), found[1]
        if holder.get("token") == mine["token"]:  # this run's upload went through; its answer was lost
            break
        if _dead_here(holder):
            log(f"{url}: left by a run that is gone (pid {holder['pid']} on this host); taken over")
            storage.delete_generation(url, generation)
            continue
        if not wait:
            raise Busy(out, holder, clear)
        if not waiting:
            log(f"{out}: waiting for another isojax run (pid {holder.get('pid', '?')} on {holder.get('host', '?')})"
                f"{clear}")
            waiting = True
        time.sleep(POLL_S)
    try:
        yield
    finally:
        try:
            found = storage.read_generation(url)
            if found is not None and _holder(found[0]).get("token") == mine["token"]:
                storage.delete_generation(url, found[1])
        except UserError as e:
            log(f"{url}: could not delete this run's lock ({e}); delete it: gcloud storage rm {url}")


def _holder(data: bytes) -> dict:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _dead_here(holder: dict) -> bool:
    """Whether the lock's holder ran on this host and its process is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # there, another user's
        return False
    return False


def check_results(folder: storage.GsPath, reads=()) -> None:
    """For readers: a record, no journal, every recorded object with its size (sha256 for `reads`)."""
    if (folder / JOURNAL).exists():
        raise UserError(f"{folder}: its results are incomplete (a run was stopped while writing them); run the "
                        "command that writes there again")
    record = read_record(folder)
    if record is None:
        raise UserError(f"{folder}: no results of isojax there (no {RECORD})")
    present = storage.listing(folder)
    for rel, (size, sha) in record["files"].items():
        ok = present.get(rel) == size and (
            rel not in reads or hashlib.sha256(storage.read_bytes(folder / rel)).hexdigest() == sha)
        if not ok:
            raise UserError(f"{folder / rel} is missing or differs from what isojax wrote ({folder / RECORD}); "
                            "write the results again")


@contextlib.contextmanager
def staged(out: storage.GsPath, *, replace_all: bool = True):
    """Yields an empty local folder for a result set; when the block ends its files become OUT's
    results (the commit in the module's docstring)."""
    stage = Path(tempfile.mkdtemp(prefix="isojax-results-"))
    try:
        yield stage
        _commit(out, stage, replace_all)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _commit(out: storage.GsPath, stage: Path, replace_all: bool) -> None:
    names = sorted(p.name for p in stage.iterdir())
    files = {p.relative_to(stage).as_posix(): [p.stat().st_size, _sha256(p)]
             for p in sorted(stage.rglob("*")) if p.is_file()}
    earlier, cut_short = (read_record(out) or {"files": {}})["files"], _journal(out)
    ours, present = set(earlier) | set(cut_short), storage.listing(out)
    _check_names(out, names, present, ours)
    for rel in files:
        if rel in present and rel not in ours:
            raise UserError(f"{out / rel} exists and isojax did not write it (it is not in {out / RECORD}); "
                            "move it away or choose another --out")
    keep = {} if replace_all else {rel: v for rel, v in earlier.items() if _top(rel) not in names}
    storage.write_bytes(out / JOURNAL, json.dumps({"new": sorted(set(files) | set(cut_short))}))
    storage.upload(stage, out)
    files.update(keep)
    storage.write_bytes(out / RECORD, json.dumps({"version": 2, "names": sorted({_top(rel) for rel in files}),
                                                  "files": files}, indent=1))
    storage.delete(out, sorted(rel for rel in ours - set(files) if rel in present))
    storage.delete(out, [JOURNAL])
