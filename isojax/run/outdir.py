"""Result folders (--out): what isojax owns there, how a run's results appear at once, the checks
made before any work. The one place for these rules; extract, sweeps, weights, report and
correlate all use it.
Length: ownership, the commit, its recovery and the locks are one set of rules, read together.

Ownership. OUT/.isojax-results.json (the record) names every file isojax wrote in OUT (its path
in OUT: plots/similarity.png) with its size and sha256, and, for earlier versions of isojax,
their top-level names. isojax replaces or removes only the files the record names; any other file
is the user's and stays, with or without --overwrite, also inside a folder isojax wrote
(OUT/plots/mine.png): that folder stays (a log line says so); emptied folders go. A result path
taken by a user's file is an error. Records of earlier versions (version 1) named folders in
"names" but every file under them in "files", as now: read by "files" alone, the same way.

Commit. A run writes its results into OUT/.partial-PID-RANDOM/new/ (the record too, computed
there), fsyncs them, then:
  1. writes the journal OUT/.isojax-commit.json (stage, old files, new files, folders it creates)
  2. moves the earlier results (the earlier record's files, and it) to the stage's old/, and
     removes the folders that leaves empty
  3. moves the new results in, file by file, the record last
  4. removes the journal.
Each step is a rename (or an rmdir of an empty folder). Readers refuse a folder while its journal
is there. A run that fails in steps 1-4 puts the earlier results back at once; one killed there
leaves the journal, and the next isojax command that writes to OUT first puts the earlier results
back (recover; every step of it can be repeated, so a kill during recovery is recovered the same
way). So at any instant OUT holds the earlier results, whole, or the new ones, whole, or a journal
that readers refuse and the next run undoes.

Lock. OUT/.isojax.lock is held with flock while a command works on OUT (the kernel frees it when
the process dies, so a killed run's lock never blocks); a second run is refused with the first's
PID and host (Busy), or, with wait, waits for it. A sweep locks each step folder while it measures
it, and OUT itself only briefly (its checks, then the sweep's files), so several jobs of one sweep
work in one OUT at once (isojax.run.sweep).

On Google Cloud Storage (--out gs://...) there is no rename and no flock: isojax.run.remote_out
keeps these rules there (a journal, every result object, then the record uploaded last; the lock
an object created only where none is, which a killed run leaves behind).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import secrets
import shutil
import socket
from pathlib import Path

from isojax import storage
from isojax.atomic import fsync_dir, write_atomic
from isojax.errors import Busy, UserError  # Busy: outdir.Busy to the sweep
from isojax.log import log
from isojax.run import remote_out

RECORD = ".isojax-results.json"
JOURNAL = ".isojax-commit.json"
LOCK = ".isojax.lock"
STAGE = ".partial-"

_held: dict[str, int] = {}  # resolved OUT (or gs:// URL) -> depth: a process may claim OUT again (extract, then save)


# ---- reading ----------------------------------------------------------------------------------

def read_record(out: Path) -> dict | None:
    """The record of OUT, or None when isojax wrote nothing there (or before records existed)."""
    if storage.is_remote(out):
        return remote_out.read_record(storage.path(out))
    path = Path(out) / RECORD
    try:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("files"), dict):
            return doc
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        pass
    raise UserError(f"{path}: unreadable record of isojax's results; delete it (isojax then treats every "
                    "file there as yours) or the whole folder")


def owned(out: Path) -> list[str]:
    """Top-level names of isojax's results in OUT: those of the files its record names."""
    if storage.is_remote(out):
        return remote_out.owned(storage.path(out))
    record = read_record(out)
    return [] if record is None else sorted({_top(rel) for rel in record["files"]})


def _top(rel: str) -> str:
    return rel.split("/", 1)[0]


def check_results(folder: Path, reads=()) -> None:
    """For readers: refuse a folder whose results are not whole. A folder without a record (written
    by hand, or by isojax before records) is taken as it is; with one, every recorded file must be
    there with its size, and the files in `reads` (those the reader parses) with their sha256."""
    if storage.is_remote(folder):
        return remote_out.check_results(storage.path(folder), reads)
    folder = Path(folder)
    if (folder / JOURNAL).exists():
        raise UserError(f"{folder}: its results are incomplete (a run was stopped while moving them in); "
                        f"run the command that writes there again: it first puts the earlier results back")
    record = read_record(folder)
    for rel, (size, sha) in (record or {"files": {}})["files"].items():
        path = folder / rel
        try:
            ok = path.stat().st_size == size and (rel not in reads or _sha256(path) == sha)
        except OSError:
            ok = False
        if not ok:
            raise UserError(f"{path} is missing or differs from what isojax wrote ({folder / RECORD}); write "
                            f"the results again, or delete {RECORD} to take the folder as it is")


# ---- checks before any work --------------------------------------------------------------------

def check_path(out: Path, inputs=(), *, folder: bool = True) -> None:
    """--out can be written (not a file where a folder is wanted, its nearest existing folder
    writable), is no input of the same command (paths that exist), holds none, and lies inside no
    input folder (correlate's RUNS/step1/metrics.json, report's RUNS/report); beside a file is fine."""
    if storage.is_remote(out):
        return remote_out.check_path(storage.path(out), inputs)
    out = Path(out).expanduser()
    if folder and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    if not folder and out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name, e.g. {_file_outside(out, inputs)}")
    base = next(p for p in [*([out] if folder else []), *out.absolute().parents] if p.exists())
    if not base.is_dir():
        raise UserError(f"--out {out}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: {base} is not writable")
    target = out.resolve()
    for given in filter(None, inputs):
        p = Path(given).expanduser()
        if not p.exists():
            continue
        source = p.resolve()
        if source == target or target in source.parents:
            raise UserError(f"--out {out} is or holds an input of this command ({given}); choose another --out")
        if source.is_dir() and source in target.parents:
            raise UserError(f"--out {out} is inside {given}, an input folder of this command; choose an --out "
                            "outside it")


def check_names(out, names) -> None:
    """Refuse, before any work and without the lock, what claim(out, names=names) would refuse in a
    folder: a result name taken by the user's file or folder, a recorded path no longer as isojax
    wrote it (kind and size). A sweep checks its step folders so before the first is measured; one
    another job holds (its lock file is there) or a commit left half done is checked at its claim."""
    if storage.is_remote(out):
        return remote_out.check_names(storage.path(out), names)
    out = Path(out)
    if not os.path.lexists(out / LOCK) and not os.path.lexists(out / JOURNAL):
        _check_names(out, names)
        _check_ours(out, (read_record(out) or {"files": {}})["files"], hashes=False)


def _file_outside(folder: Path, inputs, name: str = "correlation.json") -> Path:
    """folder/name, or, where that lies in input folders, name beside the outermost of them: a file
    name that check_path accepts (as far as the inputs go), to suggest."""
    path = folder.absolute() / name
    holders = [p.resolve() for p in (Path(g).expanduser() for g in filter(None, inputs)) if p.is_dir()]
    while outer := min((h for h in holders if h in path.resolve().parents or h == path.resolve()),
                       key=lambda h: len(h.parts), default=None):
        if outer.parent == outer:  # an input is the root: nothing is outside it
            break
        path = next(a for a in path.parents if a.resolve() == outer).parent / name
    with contextlib.suppress(ValueError):
        return path.relative_to(Path.cwd()) if not folder.is_absolute() else path
    return path


def _check_names(out: Path, names) -> None:
    mine = set(owned(out))
    for name in sorted(names):
        if name not in mine and os.path.lexists(out / name):
            raise UserError(f"{out / name} exists and isojax did not write it (it is not in {out / RECORD}); "
                            "move it away or choose another --out")


@contextlib.contextmanager
def claim(out, *, overwrite: bool, names=(), inputs=(), flag: str = "--overwrite", wait: bool = False):
    """Hold OUT for one command, checked before any work: a writable folder that is no input; locked
    (held by another process: Busy, or with `wait`, once that one lets go); what a killed run left
    is undone (recover) or removed (stale staging folders); `names` (the results the command will
    write) are not the user's files; earlier results are refused unless `overwrite`. OUT is created
    here and removed again at the end if nothing was written."""
    if storage.is_remote(out):
        url = storage.path(out)
        remote_out.check_path(url, inputs)
        with _lock(url, wait):
            remote_out.check_names(url, names)
            refuse_earlier(url, remote_out.owned(url), overwrite=overwrite, flag=flag)
            yield url
        return
    out = Path(out)
    check_path(out, inputs)
    nested = str(out.resolve()) in _held  # checked already by this process's outer claim of OUT
    with _lock(out, wait):
        _recover(out)
        _clean(out)
        _check_names(out, names)
        refuse_earlier(out, owned(out), overwrite=overwrite, flag=flag)
        _check_ours(out, (read_record(out) or {"files": {}})["files"], hashes=not nested)
        yield out


def _check_ours(out: Path, ours: dict, *, hashes: bool) -> None:
    """What isojax would replace must be what it wrote: each file of its record that is there a
    regular file of the recorded size (and, with `hashes`, sha256) in real folders; a folder, link
    or changed file there now is the user's, and refused before it is moved or removed."""
    for rel, (size, sha) in ours.items():
        for d in _parents(rel):
            if os.path.lexists(out / d) and (not (out / d).is_dir() or (out / d).is_symlink()):
                raise UserError(f"{out / d} is not the folder isojax wrote there ({out / RECORD}); move it away "
                                "or choose another --out")
        path = out / rel
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_file() or path.stat().st_size != size or \
                (hashes and _sha256(path) != sha):
            raise UserError(f"{path} is not the file isojax wrote there (changed since, or replaced; {out / RECORD} "
                            "records its size and sha256); move it away or choose another --out")


def refuse_earlier(path, held, *, overwrite: bool, flag: str = "--overwrite") -> None:
    """The one refusal of earlier results, for every command: `held` names the results already at
    `path` (a folder), or is True where `path` itself is one (correlate's file); refused unless
    `overwrite`."""
    if not held or overwrite:
        return
    if held is True:
        raise UserError(f"{path} exists; pass {flag} to replace it")
    held = sorted(held)
    raise UserError(f"{path} already holds results ({', '.join(held[:3])}{', …' if len(held) > 3 else ''}); "
                    f"pass {flag} to replace them")


@contextlib.contextmanager
def _lock(out, wait: bool = False):
    remote = storage.is_remote(out)
    key = str(out) if remote else str(out.resolve())
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    with remote_out.lock(out, wait) if remote else _flock(out, wait):
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]


@contextlib.contextmanager
def _flock(out: Path, wait: bool = False):
    made = list(itertools.takewhile(lambda p: not p.exists(), [out.absolute(), *out.absolute().parents]))
    try:
        try:
            fd = _take(out / LOCK, out, wait)  # makes OUT
        except OSError as e:
            raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(out / LOCK)
            os.close(fd)
    finally:  # a run that wrote nothing leaves no empty folder behind, OUT's parents it made included
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break


def _take(path: Path, out: Path, wait: bool = False) -> int:
    while True:
        try:  # the holder before us removes the folder where it made it and left it empty
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 4096) or b"{}")
            except ValueError:
                holder = {}
            if not wait:
                os.close(fd)
                raise Busy(out, holder) from None
            log(f"{out}: waiting for another isojax run (pid {holder.get('pid', '?')} on {holder.get('host', '?')})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before us may have removed the file as we opened it: lock the current one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    return fd


def _clean(out: Path) -> None:
    """Staging folders and journal temporaries of runs that are gone (under the lock, any is one)."""
    for p in out.iterdir():
        if p.name.startswith((STAGE, f".{JOURNAL}.tmp-")):
            _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


# ---- writing ------------------------------------------------------------------------------------

def disk_full(e: BaseException) -> bool:
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


@contextlib.contextmanager
def staged(out, *, replace_all: bool = True):
    """Yields an empty folder for a result set; when the block ends it becomes OUT's results in one
    commit (see the module's docstring). replace_all: the earlier results all go (a command's full
    set); else only those of the same names (a sweep's sweep.csv beside its step folders).
    Disk full anywhere -> UserError, earlier results unchanged, nothing left behind."""
    if storage.is_remote(out):
        with remote_out.staged(storage.path(out), replace_all=replace_all) as stage:
            yield stage
        return
    out = Path(out)
    stage = out / f"{STAGE}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        (stage / "new").mkdir(parents=True)
        yield stage / "new"
        _commit(out, stage, replace_all)
    except BaseException as e:
        if not (out / JOURNAL).exists():  # with a journal, stage/old holds the earlier results: recover's
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, Exception) and disk_full(e):
            name = getattr(e, "filename", None)
            where = out / Path(name).relative_to(stage / "new") if name and str(name).startswith(str(stage / "new")) \
                else out
            raise UserError(f"disk full writing {where}; free some space and run again (earlier results "
                            "are unchanged)") from None
        raise


def _checksums(root: Path, names) -> dict:
    files = {}
    for name in names:
        top = root / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.is_file():
                files[path.relative_to(root).as_posix()] = [path.stat().st_size, _sha256(path, sync=True)]
            if path.is_dir():
                fsync_dir(path)
        if top.is_dir():
            fsync_dir(top)
    return files


def _sha256(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if sync:  # files are durable before any rename makes them results
            os.fsync(f.fileno())
    return h.hexdigest()


def _commit(out: Path, stage: Path, replace_all: bool) -> None:
    new = stage / "new"
    names = sorted(p.name for p in new.iterdir())
    ours = (read_record(out) or {"files": {}})["files"]
    _check_names(out, names)
    _check_ours(out, ours, hashes=False)  # claim hashed them; a folder put there since is caught here
    files = _checksums(new, names)
    keep = {} if replace_all else {rel: v for rel, v in ours.items() if _top(rel) not in names}
    _check_files(out, files, ours)
    files.update(keep)
    (new / RECORD).write_text(json.dumps({"version": 2, "names": sorted({_top(rel) for rel in files}),
                                          "files": files}, indent=1))
    _checksums(new, [RECORD])
    moving = sorted(set(files) - set(keep))
    old = [rel for rel in [*sorted(ours), RECORD] if rel not in keep and os.path.lexists(out / rel)]
    old_dirs, new_dirs = _folders(old), _folders(moving)
    created = [d for d in new_dirs if not os.path.lexists(out / d)]
    fsync_dir(new)
    fsync_dir(stage)
    write_atomic(out / JOURNAL, json.dumps({"stage": stage.name, "old": old, "new": moving + [RECORD],
                                            "created": created}))
    try:
        for rel in old:
            _move(out / rel, stage / "old" / rel)
        for d in old_dirs:  # deepest first: folders the earlier results leave empty go; a user's file keeps its
            if d not in new_dirs:
                _remove_empty(out / d)
        for rel in moving + [RECORD]:
            _move(new / rel, out / rel)
        _fsync_dirs(out, [*new_dirs, *old_dirs])
        os.unlink(out / JOURNAL)
        fsync_dir(out)
    except Exception:
        _recover(out)  # failed here, in this process: the earlier results go back now
        raise
    left = [d for d in old_dirs if d not in new_dirs and (out / d).is_dir()]
    for d in [d for d in left if not set(_parents(d)) & set(left)]:  # the outermost ones
        log(f"{out / d}: left in place, it holds {sum(not p.is_dir() for p in (out / d).rglob('*'))} file(s) "
            "isojax did not write")
    shutil.rmtree(stage, ignore_errors=True)


def _check_files(out: Path, files: dict, ours: dict) -> None:
    """A new result file may replace only a file of isojax's record, and its folders must be folders."""
    for rel in files:
        for d in _parents(rel):
            if os.path.lexists(out / d) and (not (out / d).is_dir() or (out / d).is_symlink()):
                raise UserError(f"{out / d} exists and is not a folder isojax wrote; move it away or choose "
                                "another --out")
        if rel not in ours and os.path.lexists(out / rel):
            raise UserError(f"{out / rel} exists and isojax did not write it (it is not in {out / RECORD}); "
                            "move it away or choose another --out")


def _parents(rel: str) -> list[str]:
    """The folders of a path in OUT, outermost first ('a/b/c' -> ['a', 'a/b'])."""
    return [rel.rsplit("/", k)[0] for k in range(rel.count("/"), 0, -1)]


def _folders(rels) -> list[str]:
    """Every folder holding one of `rels`, deepest first."""
    return sorted({d for rel in rels for d in _parents(rel)}, key=lambda d: (-d.count("/"), d))


def _fsync_dirs(out: Path, folders) -> None:
    for d in [*folders, ""]:  # the renames in them are durable before the journal goes
        if (out / d).is_dir():
            fsync_dir(out / d)


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


def _remove_empty(folder: Path) -> None:
    try:
        os.rmdir(folder)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            raise


def _recover(out: Path) -> None:
    """Undo a commit left half done (its journal is there): the new files moved in go to the stage's
    trash/, the earlier ones come back from its old/, the folders the commit made go if empty.
    Decided per file from where it is, so running it again after a kill during it is safe.
    (Journals of earlier versions name top-level files and folders: undone the same way.)"""
    try:
        journal = json.loads((out / JOURNAL).read_text())
    except FileNotFoundError:
        return
    except ValueError:  # written by one rename, so never half; a foreign file: leave it to the user
        raise UserError(f"{out / JOURNAL}: unreadable; delete it by hand") from None
    stage = out / journal["stage"]
    old, trash, earlier = stage / "old", stage / "trash", set(journal["old"])
    for rel in journal["new"]:
        moved_in = not os.path.lexists(stage / "new" / rel)
        pending = os.path.lexists(old / rel) if rel in earlier else moved_in
        if pending and os.path.lexists(out / rel):
            _move(out / rel, trash / rel)
    for rel in journal["old"]:
        if os.path.lexists(old / rel):
            _move(old / rel, out / rel)
    for d in journal.get("created", []):  # deepest first
        _remove_empty(out / d)
    _fsync_dirs(out, _folders(journal["old"]))
    os.unlink(out / JOURNAL)
    fsync_dir(out)
    shutil.rmtree(stage, ignore_errors=True)
