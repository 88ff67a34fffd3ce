"""A sweep's next checkpoint read while the current one is measured (issue 47).

Once a step's loop has begun (its first batch done), a thread reads the checkpoint of the next
unfinished step (its download waited for first, where it has one): its tokenizer (a local folder's
own tokenizer.json; any other the step reads itself, its log lines in their place), then its weights,
with the calls and arguments that step's own load makes (run/inputs.py tokenizer_without_weights,
hf/loading.py load_model), so its parameters are the same bit for bit. The weights are placed on
the devices where the current step's memory plan leaves room beside it (device/memory.py
room_beside) for the next checkpoint's files, copied to one device as stored, and its parameters;
else they are read into host memory only (hf/loading.py read_to_host), where half the memory
available holds them; else nothing is read ahead. Only Hugging Face checkpoint folders are read
ahead (a local revision folder or a hub snapshot; not random weights nor an Orbax conversion).

The next step takes what was read, waiting for what is still being read, in place of reading it,
with a log line. What no step takes (the next step skipped, or not of that dtype and mesh) is
dropped once its thread has ended, before the step loads its own: at most one checkpoint is held
ahead. An error ahead (a damaged or missing checkpoint, the devices' memory) is dropped there: the
step then loads as it would have without reading ahead, and its error, if any, is raised there,
its own. Single-process sweeps only (run/sweep.py run_sweep)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from pathlib import Path

from isojax import faults
from isojax.log import log


@dataclasses.dataclass(eq=False)
class _Ahead:
    """One checkpoint being read ahead: the load's arguments, and Futures of what is read."""
    model: str
    revision: str | None
    dtype: str
    mesh: object
    tokenizer: concurrent.futures.Future  # (peek_config's config, tokenizer_without_weights' result)
    weights: concurrent.futures.Future  # a LoadedModel on the devices, a HostCheckpoint, or None
    stop: threading.Event  # the sweep has ended: read nothing more
    note: str = ""  # the log line of the step that takes it


class LoadAhead:
    """A sweep's reading ahead: told by the sweep which checkpoint follows the one measured now
    (expect), started by that one's loop (start), taken by the next step's load (tokenizer, take)."""

    def __init__(self):
        self._next = None  # (model, revision, the thread downloading it or None): the step after this one
        self._ahead: _Ahead | None = None
        self._thread: threading.Thread | None = None

    def expect(self, model: str | None, revision: str | None = None, fetching=None) -> None:
        """The step measured next reads (model, revision) (None: no step follows); fetching: the
        thread downloading it."""
        self._next = None if model is None else (model, revision, fetching)

    def start(self, dtype: str, mesh, room: int) -> None:
        """The step measured now has begun its loop: read the next one ahead, for this dtype and
        mesh; room: the bytes of one device this step's plan leaves free."""
        if self._next is None:
            return
        self._drop()
        (model, revision, fetching), self._next = self._next, None
        ahead = _Ahead(model, revision, dtype, mesh, concurrent.futures.Future(), concurrent.futures.Future(),
                       threading.Event())
        self._ahead, self._thread = ahead, threading.Thread(target=_read, args=(ahead, fetching, room), daemon=True,
                                                           name="isojax-load-ahead")
        self._thread.start()

    def tokenizer(self, model: str, early):
        """tokenizer_without_weights(model, early) as read ahead, or None (nothing read for it)."""
        ahead = self._ahead
        if ahead is None or ahead.model != model:
            return None
        try:
            peeked, found = ahead.tokenizer.result()
        except Exception:  # noqa: BLE001 -- the step reads it itself, its error its own
            return None
        return found if peeked == early else None

    def take(self, model: str, revision: str | None, dtype: str, mesh):
        """The weights of (model, revision) read ahead for this dtype and mesh: a LoadedModel on the
        devices, a HostCheckpoint (hf/loading.py), or None (the step reads them itself)."""
        ahead = self._ahead
        if ahead is None:
            return None
        if (ahead.model, ahead.revision, ahead.dtype) != (model, revision, dtype) or ahead.mesh != mesh:
            self._drop()
            return None
        self._ahead = self._thread = None
        try:
            got = ahead.weights.result()
        except Exception:  # noqa: BLE001 -- the step reads them itself, its error its own
            return None
        if ahead.note:
            log(ahead.note)
        return got

    def close(self) -> None:
        """The sweep has ended: what is being read is dropped, its thread ended at its next stage
        (none is left working on the devices when the interpreter exits: errors.exit_with)."""
        self._drop()
        self._next = None

    def _drop(self) -> None:
        """Wait for the thread reading ahead to end, and drop what it read."""
        if self._thread is not None:
            self._ahead.stop.set()
            self._thread.join()
        self._ahead = self._thread = None


def _read(ahead: _Ahead, fetching, room: int) -> None:
    """The thread reading ahead: each Future gets its result or its error."""
    for future, read in ((ahead.tokenizer, _tokenizer), (ahead.weights, _weights)):
        try:
            while fetching is not None and fetching.is_alive() and not ahead.stop.is_set():
                fetching.join(1.0)  # its download first; a sweep that ends meanwhile does not wait for it
            future.set_result(None if ahead.stop.is_set() else read(ahead, room))
        except BaseException as e:  # noqa: BLE001 -- handed to the step that takes it
            future.set_exception(e)


def _tokenizer(ahead: _Ahead, room: int):
    """A local folder's own tokenizer.json (one read otherwise, or one the step warns it has not,
    is read by the step itself, its log lines in their place)."""
    from isojax.run.inputs import peek_config, tokenizer_without_weights
    early = peek_config(ahead.model)
    if not (Path(ahead.model).expanduser() / "tokenizer.json").is_file():
        return early, None
    return early, tokenizer_without_weights(ahead.model, early)


def _weights(ahead: _Ahead, room: int):
    from isojax.device.memory import host_available_bytes, weight_bytes
    from isojax.hf.family import read_hf_config
    from isojax.hf.files import CheckpointReader
    from isojax.hf.loading import load_model, read_to_host
    faults.reached("weights_ahead")
    folder = checkpoint_folder(ahead.model, ahead.revision)
    if folder is None:
        return None
    stored = sum(f.stat().st_size for f in CheckpointReader(folder).files())
    placed = weight_bytes(read_hf_config(folder), ahead.dtype, ahead.mesh.shape["model"])
    label = f"{ahead.model}{f' @ {ahead.revision}' if ahead.revision else ''}"
    if stored + placed <= room:
        ahead.note = f"{label}: weights read and placed on the devices ahead, while the checkpoint before was measured"
        return load_model(ahead.model, ahead.revision, ahead.dtype, ahead.mesh)
    if stored <= host_available_bytes() // 2:
        ahead.note = (f"{label}: weights read into host memory ahead, while the checkpoint before was measured (on "
                      f"the devices they take {(stored + placed) / 1e9:.2f} GB, its plan left {max(room, 0) / 1e9:.2f} "
                      "GB beside it)")
        return read_to_host(folder)
    ahead.note = f"{label}: not read ahead ({stored / 1e9:.2f} GB: more than the devices' room or half the host's)"
    return None


def checkpoint_folder(model: str, revision: str | None) -> Path | None:
    """The Hugging Face checkpoint folder load_model reads for (model, revision), downloaded where
    it is a hub checkpoint; None for random weights, an Orbax conversion or a name load_model
    refuses (it says why)."""
    from isojax.hf.family.presets import base_preset, hub_id, shape_only
    from isojax.hf.files import resolve_model
    from isojax.hf.orbax_io import is_converted
    from isojax.steps import local_revision
    if model.startswith("random:"):
        return None
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        folder = local_revision(path, revision) if path.is_dir() else None
    else:
        repo = hub_id(model) if base_preset(model) else model
        folder = None if shape_only(model) or "/" not in repo else resolve_model(repo, revision)
    if folder is None or is_converted(folder) or not (folder / "config.json").is_file():
        return None
    return folder
