"""Run checkpoints: the accumulators as they lie on the devices, each process writing its own
Length: the checkpoint format, its checksums and the fall-back to an older step change together.

shards (nothing goes through one host), plus the data cursor and run settings.

Layout: DIR/<step>/process_<i>/ holds one raw .npy per addressable shard (named by leaf and
shard offsets) and meta.json. Every process writes into DIR/.tmp-<step>-process_<i>, fsyncs each
file, writes meta.json last and renames the folder into place, so a SIGKILL or a full disk
mid-write leaves the previous checkpoint intact and the partial one is never read; a step counts
once every process's folder is there. meta.json records each shard's dtype, shape and CRC-32
(and its own CRC-32), and `load` checks them all: a damaged file is named (`Damaged`) and
loop.resume falls back to the previous complete step. Dtypes that .npy cannot describe (bfloat16,
float8: numpy writes them as raw void, '|V2', which reads back as no number at all) are stored
as unsigned integers of their width and viewed back as the recorded dtype, bit for bit.

Where the devices have room, `save` copies the accumulators on the devices (milliseconds) and
hands the copy to a background thread, which writes each device's shards in a thread of its own:
each array goes to page-locked ("pinned_host") host memory SLICE_BYTES of rows at a time and is
written from there into its .npy file. Without room the copies to host memory end before `save`
returns. Pinning new pages is the slow part of a copy to host memory, far slower than copying
into pages XLA's pool already holds; so chunks keep that pool at a chunk per device, and `reserve`
grows it before the loop (measured: bench/RESULTS.md 7d). The layout
depends on the device count (device/runner.py), so a checkpoint resumes on as many devices and
processes as wrote it.

A checkpoint directory on Google Cloud Storage (gs://..., isojax.storage) has no rename: each
process writes its step into a local temporary folder as above and uploads it file by file,
meta.json last; a step's part counts once its meta.json is there.

In a run of several processes, `save` first waits until every process has written its previous
step, so a kill anywhere leaves a whole step behind once any process has written two.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from isojax import faults, storage
from isojax.device import mesh
from isojax.atomic import fsync_dir
from isojax.errors import UserError
from isojax.log import log

_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
SLICE_BYTES = 256 << 20


class Damaged(Exception):
    """A checkpoint file that is missing, truncated or fails its checksum."""


def _storage(dtype) -> np.dtype:
    """The dtype a shard is stored as: its own where .npy describes it, else an unsigned int of its
    width (bfloat16 -> uint16), viewed back on load."""
    dt = np.dtype(dtype)
    return dt if dt.kind in "biufc" else np.dtype(f"u{dt.itemsize}")


def _header(f, shape, dtype) -> None:
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(_storage(dtype)),
                                             "fortran_order": False, "shape": tuple(shape)})


def _crc(obj) -> int:
    return zlib.crc32(json.dumps(obj, sort_keys=True).encode())


def _leaves(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(k, simple=True, separator="__"), v)
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _shard_name(leaf: str, index: tuple) -> str:
    starts = "_".join(str(s.start or 0) for s in index) or "0"
    return f"{leaf}.{starts}.npy"


def _room_for_copy(acc) -> bool:
    """Whether every device holding acc has room for a second copy of its part (10% spare)."""
    need: dict = {}
    for leaf in jax.tree.leaves(acc):
        for shard in leaf.addressable_shards:
            need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    for device, nbytes in need.items():
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:  # the CPU: host memory
            return nbytes < 0.1 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if stats["bytes_limit"] - stats.get("bytes_in_use", 0) < 1.1 * nbytes:
            return False
    return True


@functools.partial(jax.jit, static_argnums=(2,))
def _rows(x, start, count: int):
    """Rows [start, start + count) of x seen as [rows, last axis] (one compile per chunk size)."""
    return jax.lax.dynamic_slice_in_dim(x.reshape(-1, x.shape[-1]), start, count)


def _pinned(device) -> jax.sharding.Sharding | None:
    """Page-locked host memory beside a device, where the device has it (GPUs)."""
    if device.platform == "cpu" or "pinned_host" not in [m.kind for m in device.addressable_memories()]:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _each_chunk(data, use) -> None:
    """use(view) for each SLICE_BYTES of data's rows in order (data: one device's array), view a
    flat uint8 array in host memory: page-locked where the device has such memory (reading it
    copies nothing). One chunk is alive at a time, so XLA's page-locked pool (grown by
    Checkpointer.reserve, kept after) needs one chunk per writing thread."""
    pinned = _pinned(next(iter(data.devices())))
    per_chunk = max(1, SLICE_BYTES // (data.shape[-1] * data.dtype.itemsize))
    rows = data.size // data.shape[-1]
    for start in range(0, rows, per_chunk):
        chunk = _rows(data, np.int32(start), min(per_chunk, rows - start))
        if pinned is not None:
            chunk = jax.device_put(chunk, pinned)
        use(np.asarray(chunk).reshape(-1).view(np.uint8))
        del chunk  # before the next one is taken from the pool


def _is_big(data) -> bool:
    return isinstance(data, jax.Array) and data.ndim > 0 and data.size > 0 and data.nbytes > SLICE_BYTES


def _to_host(data) -> np.ndarray:
    """A device array in host memory, by _each_chunk: np.asarray of a device array moved ~1.5 GB/s here."""
    if not _is_big(data):
        return np.asarray(data)
    out = np.empty(data.shape, data.dtype)
    flat, at = out.reshape(-1).view(np.uint8), 0

    def put(view):
        nonlocal at
        flat[at:at + view.size] = view
        at += view.size

    _each_chunk(data, put)
    return out


def _write_shards(tmp: Path, shards: list) -> dict:
    """Write one device's shards as .npy files, a chunk at a time (_each_chunk: through page-locked
    memory), each fsynced. Returns
    {file: {"dtype", "shape", "crc32"}} (zlib.crc32 releases the GIL, so the writer threads hash
    in parallel)."""
    record = {}
    for name, data in shards:
        crc = 0
        with open(tmp / name, "wb", buffering=0) as f:
            _header(f, data.shape, data.dtype)

            def write(view):  # f.write releases the GIL
                nonlocal crc
                for at in range(0, view.size, 1 << 30):
                    part = view[at:at + (1 << 30)]
                    f.write(part)
                    crc = zlib.crc32(part, crc)

            if _is_big(data):
                _each_chunk(data, write)
            else:
                write(np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8))
            os.fsync(f.fileno())
        record[name] = {"dtype": np.dtype(data.dtype).name, "shape": list(data.shape), "crc32": crc}
    return record


def _read_shard(f: Path, record: dict) -> np.ndarray:
    """A shard written by _write_shards, checked against its record {"dtype", "shape", "crc32"};
    Damaged if it is missing, truncated, too long or fails its checksum."""
    dtype, shape = np.dtype(record["dtype"]), tuple(record["shape"])
    storage = _storage(dtype)
    try:
        with open(f, "rb") as fh:
            if np.lib.format.read_magic(fh) != (1, 0):
                raise ValueError("not an .npy file of version 1.0")
            got_shape, fortran, got_dtype = np.lib.format.read_array_header_1_0(fh)
            if tuple(got_shape) != shape or got_dtype != storage or fortran:
                raise ValueError(f"holds {got_dtype} {tuple(got_shape)}, its record says {storage} {shape}")
            out = np.empty(shape, storage)
            flat = out.reshape(-1).view(np.uint8)
            if fh.readinto(memoryview(flat)) != flat.size or fh.read(1):
                raise ValueError("truncated or too long")
    except (OSError, ValueError) as e:
        raise Damaged(f"{f.name}: {e}") from None
    if zlib.crc32(flat) != record["crc32"]:
        raise Damaged(f"{f.name}: checksum mismatch (the file changed after it was written)")
    return out.view(dtype)


def _process_dir() -> str:
    return f"process_{jax.process_index()}"


class Checkpointer:
    """Writes the checkpoints of one run, one at a time."""

    def __init__(self, directory):
        self.directory = storage.path(directory)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _in_background(self, fn, *args) -> None:
        def guarded():
            try:
                fn(*args)
            except BaseException as e:  # reported by the next save or close
                self.error = e

        self.thread = threading.Thread(target=guarded, daemon=True, name="isojax-checkpoint")
        self.thread.start()

    def reserve(self, acc) -> None:
        """Grow XLA's page-locked pool now, in the background, by one chunk per device held at once:
        what the writer threads take from it. The first checkpoint then finds the pool grown, as
        later ones do (pinning new pages runs ~1.3 GB/s and slowed the loop: bench/RESULTS.md 7d)."""
        if not any(_is_big(leaf) for leaf in jax.tree.leaves(acc)):
            return
        devices = {s.device for leaf in jax.tree.leaves(acc) for s in leaf.addressable_shards}
        places = [(d, p) for d in devices if (p := _pinned(d)) is not None]

        def grow():  # only a head start: a failure here costs the first checkpoint time, not the run
            try:
                held = [jax.device_put(jnp.zeros(SLICE_BYTES, jnp.uint8, device=d), p) for d, p in places]
                jax.block_until_ready(held)
            except Exception as e:  # noqa: BLE001
                log(f"checkpoint: page-locked memory not reserved ahead ({type(e).__name__}: {e})")

        self.wait()
        if places:
            self._in_background(grow)

    def save(self, step: int, acc, meta: dict) -> None:
        self.wait()  # never two in flight (nor beside reserve's)
        # and no process begins a step before every process has written the one before: once any
        # process has written two steps, some step is whole on all (a process killed mid-write,
        # or ended by a peer's death, leaves at most its newest step unfinished)
        mesh.exchange(f"checkpoint-written-before-{step}", b"")
        room = _room_for_copy(acc)
        if room:
            acc = _copy(acc)
        by_device: dict = {}
        for name, leaf in _leaves(acc):
            if not leaf.size:  # nothing to keep; load makes it again (its shards may carry no offsets)
                continue
            for s in leaf.addressable_shards:
                by_device.setdefault(s.device, []).append((_shard_name(name, s.index), s.data))
        if not room:  # the arrays leave the devices before their buffers are reused
            log("checkpoint: no device memory for a copy; the loop waits for the transfer to host memory")
            by_device = {d: [(f, _to_host(x)) for f, x in shards] for d, shards in by_device.items()}
        self._in_background(self._write, step, list(by_device.values()), meta)

    def _write(self, step: int, per_device: list, meta: dict) -> None:
        remote = storage.is_remote(self.directory)
        if remote:
            tmp = Path(tempfile.mkdtemp(prefix=f"isojax-checkpoint-{step}-"))
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".tmp-{step}-{_process_dir()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        try:
            files: dict = {}
            with ThreadPoolExecutor(len(per_device) or 1, thread_name_prefix="isojax-checkpoint") as pool:
                for done in [pool.submit(_write_shards, tmp, shards) for shards in per_device]:
                    files.update(done.result())
            faults.reached("checkpoint_write")
            with open(tmp / "meta.json", "w") as f:
                f.write(json.dumps({"meta": meta, "files": files, "crc32": _crc([meta, files])}))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            final = self.directory / str(step) / _process_dir()
            if remote:  # meta.json goes first and comes last: the step's part is whole or not there
                try:
                    discard(self.directory, step)
                    storage.upload(tmp, final, last="meta.json")
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                final.parent.mkdir(exist_ok=True)
                if final.exists():  # this step written once already (a resume fell back past it)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(final.parent)
                fsync_dir(self.directory)
            faults.reached("checkpoint_written")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial write must not keep the disk full
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"disk full writing the checkpoint under {self.directory}; the previous checkpoint "
                                "is intact: free space and rerun with --resume") from None
            raise UserError(f"could not write the checkpoint under {self.directory} ({e.strerror or e}); "
                            "the previous checkpoint is intact") from None
        # keep the newest two steps that every process has written (the older for a newest found
        # damaged) and this process's later ones: until a slower process's upload ends, this step
        # and the one before it may both lack its part
        whole = complete_steps(self.directory)
        for old in [s for s in _steps(self.directory) if len(whole) > 1 and s < whole[1]]:
            discard(self.directory, old)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        self.wait()


def _ours(rel: str) -> bool:
    """An object of a checkpoint on GCS: STEP/process_I/FILE."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0].isdigit() and parts[1].startswith("process_")


def _parts(directory) -> dict[int, set[str]]:
    """{step: the process folders written for it} (on GCS: those with their meta.json)."""
    if storage.is_remote(directory):
        parts: dict = {}
        for rel in storage.listing(directory):
            if _ours(rel) and rel.endswith("/meta.json"):
                step, proc, _ = rel.split("/")
                parts.setdefault(int(step), set()).add(proc)
        return parts
    directory = Path(directory)
    return {int(p.name): {q.name for q in p.iterdir() if q.name.startswith("process_")}
            for p in directory.iterdir() if p.name.isdigit()} if directory.is_dir() else {}


def _steps(directory) -> list[int]:
    if storage.is_remote(directory):
        return sorted({int(rel.split("/")[0]) for rel in storage.listing(directory) if _ours(rel)})
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


def clear(directory) -> None:
    """Remove the checkpoints under directory, for a run that starts over. A directory that holds
    anything else is refused, never emptied."""
    if storage.is_remote(directory):
        objects = storage.listing(storage.path(directory))
        foreign = sorted({rel.split("/")[0] for rel in objects if not _ours(rel)})
        if foreign:
            raise UserError(f"checkpoint directory {directory} holds what isojax did not write "
                            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose an empty or "
                            "new directory")
        storage.delete(storage.path(directory), sorted(objects))
        return
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise UserError(f"checkpoint directory {directory} is a file")
    entries = list(directory.iterdir())

    def ours(p: Path) -> bool:
        if p.is_dir() and p.name.startswith(".tmp-"):
            return True
        return p.is_dir() and p.name.isdigit() and all(q.name.startswith("process_") for q in p.iterdir())

    foreign = sorted(p.name for p in entries if not ours(p))
    if foreign:
        raise UserError(f"checkpoint directory {directory} holds what isojax did not write ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new directory")
    for p in entries:
        shutil.rmtree(p)


def remove(directory) -> None:
    """Remove the checkpoints of a finished run: what clear removes, then the directory if empty;
    anything else in it stays (and so does the directory)."""
    if storage.is_remote(directory):
        directory = storage.path(directory)
        storage.delete(directory, sorted(rel for rel in storage.listing(directory) if _ours(rel)))
        return
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-") or (p.name.isdigit() and all(
                q.name.startswith("process_") for q in p.iterdir()))):
            shutil.rmtree(p, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.rmdir()


def discard(directory, step: int) -> None:
    """Remove this process's part of a checkpoint step (and the step's folder once empty); on GCS
    its meta.json first, so that no part is taken as whole meanwhile."""
    if storage.is_remote(directory):
        part = storage.path(directory) / str(step) / _process_dir()
        storage.delete(part, ["meta.json"])
        storage.delete(part, sorted(storage.listing(part)))
        return
    shutil.rmtree(Path(directory) / str(step) / _process_dir(), ignore_errors=True)
    with contextlib.suppress(OSError):
        (Path(directory) / str(step)).rmdir()


def complete_steps(directory) -> list[int]:
    """The checkpoint steps that every process has written, newest first."""
    out = []
    for step, folders in sorted(_parts(directory).items(), reverse=True):
        if len(folders) > jax.process_count():
            raise UserError(f"{directory}: checkpoint step {step} was written by {len(folders)} processes, "
                            f"this run has {jax.process_count()}")
        if len(folders) == jax.process_count() and _process_dir() in folders:
            out.append(step)
    return out


def read_meta(directory: Path, step: int) -> tuple[dict, dict]:
    """(meta, file records) of this process's part of a step; Damaged if meta.json is not whole."""
    f = storage.path(directory) / str(step) / _process_dir() / "meta.json"
    try:
        doc = json.loads(storage.read_bytes(f) if storage.is_remote(f) else f.read_text())
        meta, files = doc["meta"], doc["files"]
        ok = doc["crc32"] == _crc([meta, files])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Damaged(f"{f.name}: {type(e).__name__}: {e}") from None
    if not ok:
        raise Damaged(f"{f.name}: checksum mismatch")
    return meta, files


def latest(directory: Path) -> tuple[int, dict] | None:
    """(step, meta) of the newest checkpoint every process has written, or None."""
    for step in complete_steps(directory):
        return step, read_meta(directory, step)[0]
    return None


def load(directory: Path, step: int, abstract_acc, named=lambda leaf: leaf):
    """The accumulators of a checkpoint step. abstract_acc: their jax.ShapeDtypeStructs with
    shardings; each process reads back its own shards onto its devices, each checked against its
    record (Damaged: missing, truncated, changed; UserError: written for other settings).
    named(leaf): the name the step's files give a leaf (an older layout's: Runner.older_leaf)."""
    here = storage.path(directory) / str(step) / _process_dir()
    _, files = read_meta(directory, step)
    with storage.downloaded(here) if storage.is_remote(here) else contextlib.nullcontext(here) as local:
        return _load(local, files, directory, step, abstract_acc, named)


def _load(here: Path, files: dict, directory, step: int, abstract_acc, named):
    leaves = []
    for leaf, a in _leaves(abstract_acc):
        name = named(leaf)
        if not a.size:  # save writes no empty leaves
            leaves.append(jax.make_array_from_callback(a.shape, a.sharding, lambda i, a=a: np.zeros(a.shape, a.dtype)[i]))
            continue
        shards = []
        for device, index in a.sharding.addressable_devices_indices_map(a.shape).items():
            fname = _shard_name(name, index)
            want = tuple(len(range(*i.indices(n))) for i, n in zip(index, a.shape))
            record = files.get(fname)
            if record is None or tuple(record["shape"]) != want or np.dtype(record["dtype"]) != np.dtype(a.dtype):
                raise UserError(f"{directory}: checkpoint step {step} does not fit this run ({fname}); "
                                "it was written with other settings or devices")
            shards.append(jax.device_put(_read_shard(here / fname, record), device))
        leaves.append(jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_acc), leaves)
