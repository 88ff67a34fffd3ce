"""Find and read Hugging Face checkpoint files one tensor at a time.

`resolve_checkpoint` turns a local directory, a preset name (`pythia-70m`, `pythia-70m-deduped`)
or a hub id (`EleutherAI/pythia-70m`) into a local directory, downloading through the
Hugging Face cache when needed. `CheckpointReader` reads single tensors from
`model.safetensors`, sharded safetensors (`*.index.json`), or `pytorch_model.bin`.

A hub download is checked against the hashes the hub lists (sha256 of LFS files, git blob ids)
before it is used (`isojax.hf.verify`): a damaged file is removed from the cache and is an error.

Safetensors files are opened with the `safetensors` package (`safe_open`, framework numpy):
it checks the header against the file size when the file is opened, so a truncated download
fails with a clear message, and reads one tensor at a time (`read`) or a block of rows
(`rows`, for matrices too big to hold). bfloat16 is upcast to float32 because numpy has no
bfloat16 arithmetic. `.bin` files are only ever opened with `torch.load(weights_only=True)`;
nothing here runs remote code.
"""

from __future__ import annotations

import abc
import difflib
import json
import os
import pathlib
import re
import time

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors' numpy reader needs it)
import numpy as np
from safetensors import SafetensorError, safe_open

from isojax.hf.family.presets import base_preset, hub_id
from isojax.errors import UserError
from isojax.hf.network import LOGIN_HINT, hub_error, status_of, transient_api_error  # noqa: F401 (LOGIN_HINT: data's)
from isojax.log import log

class RowBlocks(abc.ABC):
    """A matrix too big to hold, read in row blocks: `W[a:b]` -> ndarray [b - a, d].

    `analyze_matrix` takes one in place of an array and never asks for more than a block.
    """
    shape: tuple[int, int]

    @abc.abstractmethod
    def __getitem__(self, rows: slice) -> np.ndarray: ...



# the JSON files (config, index, tokenizer) and merges.txt: OPT's repositories ship a GPT-2-style
# tokenizer (vocab.json + merges.txt) and no tokenizer.json
SAFETENSORS_PATTERNS = ["*.json", "merges.txt", "*.safetensors"]
BIN_PATTERNS = ["*.json", "merges.txt", "*.bin"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

_ST_DTYPES = {  # safetensors dtype -> the name `CheckpointReader.dtype` reports
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def preset_hub_id(name: str) -> str | None:
    """Hub id of a preset name (`pythia-70m` or `pythia-70m-deduped`), or None."""
    return hub_id(name) if base_preset(name) else None


def resolve_checkpoint(name_or_path: str, revision: str | None = None, *,
                       allow_patterns=None) -> pathlib.Path:
    """Local directory of a checkpoint given a directory, preset name or hub id."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"not a directory: {name_or_path}")
    repo_id = preset_hub_id(name_or_path)
    if repo_id is None and _HUB_ID.match(name_or_path) and not name_or_path.startswith("."):
        repo_id = name_or_path
    if repo_id is None:
        kind = "directory" if os.sep in name_or_path or name_or_path.startswith(".") else "preset, hub id or directory"
        raise UserError(f"model not found: {name_or_path} (no such {kind})")
    import huggingface_hub

    from isojax.hf.network import hub_reachable, why_unreachable
    online = hub_reachable()
    try:  # no network: the cache only, without huggingface_hub's ~30 s of retries
        for attempt in range(API_ATTEMPTS):
            try:
                local = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                                          local_files_only=not online)
                break
            except Exception as exc:
                if not online or attempt + 1 == API_ATTEMPTS or not transient_api_error(exc):
                    raise
                log(f"the hub answered {status_of(exc) or type(exc.__cause__ or exc).__name__} for {repo_id}@"
                    f"{revision or 'main'}; trying again ({attempt + 2}/{API_ATTEMPTS})")
                time.sleep(2.0 * (attempt + 1))
    except Exception as exc:  # every hub/network failure becomes one line for the user
        err = hub_error(exc, repo_id, revision)
        if repo_id == name_or_path:  # it could also have been meant as a local path
            err = UserError(f"{err} (and there is no local directory {name_or_path})")
        raise err from exc
    local = pathlib.Path(local)
    _verify(local, allow_patterns, f"{repo_id}@{revision or 'main'}")
    if not online and (repo_id, revision) not in _ANNOUNCED:
        _ANNOUNCED.add((repo_id, revision))
        log(f"{why_unreachable()}: {repo_id}@{revision or 'main'} read offline from the Hugging Face cache")
    return local


def _verify(snapshot: pathlib.Path, allow_patterns, label: str) -> None:
    """The snapshot's files that the patterns take, checked against the hub's hashes (isojax.hf.verify)."""
    from huggingface_hub.utils import filter_repo_objects

    from isojax.hf.verify import verify_snapshot
    names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    verify_snapshot(snapshot, filter_repo_objects(names, allow_patterns=allow_patterns), label)


_ANNOUNCED: set = set()
API_ATTEMPTS = 3  # huggingface_hub retries neither the repo info and tree listing nor a file's GET on a 5xx


def resolve_model(name_or_path: str, revision: str | None = None) -> pathlib.Path:
    """A whole checkpoint for measuring: its JSON files (config, tokenizer, index) and one copy of
    the weights, safetensors when the revision has them, else `.bin` (never both: Pythia's `main`
    ships both, twice the bytes)."""
    return resolve_weights(name_or_path, revision)


def resolve_weights(name_or_path: str, revision: str | None = None, *,
                    tensors=None) -> pathlib.Path:
    """Like `resolve_checkpoint`, but download only the weight files needed.

    Safetensors are preferred; `.bin` files are fetched only when the revision has no
    safetensors. With `tensors` (names) and a sharded checkpoint, only the shards that hold
    them are downloaded (open the result with `CheckpointReader(dir, only=tensors)`).
    """
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    meta = resolve_checkpoint(name_or_path, revision, allow_patterns=["*.json"])
    for index, patterns in (("model.safetensors.index.json", SAFETENSORS_PATTERNS),
                            ("pytorch_model.bin.index.json", BIN_PATTERNS)):
        if (meta / index).is_file():
            if tensors is not None:
                weight_map = _read_index(meta / index)
                patterns = ["*.json", "merges.txt"] + sorted({weight_map[t] for t in tensors if t in weight_map})
            return resolve_checkpoint(name_or_path, revision, allow_patterns=patterns)
    local = resolve_checkpoint(name_or_path, revision, allow_patterns=SAFETENSORS_PATTERNS)
    if not any(local.glob("*.safetensors")):
        local = resolve_checkpoint(name_or_path, revision, allow_patterns=BIN_PATTERNS)
    return local


def _read_index(index: pathlib.Path) -> dict:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise UserError(f"corrupt checkpoint index: {index}") from None
    return weight_map


def open_safetensors(path: pathlib.Path):
    """`safe_open(path, "numpy")`; a truncated or corrupt file -> UserError naming it."""
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as exc:
        size = path.stat().st_size
        reason = str(exc).removeprefix("Error while deserializing header: ")
        if "not fully covered" in reason:
            raise UserError(f"truncated safetensors file: {path} ({size} bytes, fewer than "
                            "its header lists)") from None
        if "header too small" in reason or "invalid header length" in reason:
            raise UserError(f"truncated safetensors file: {path} ({size} bytes, the header "
                            "is incomplete; or not a safetensors file)") from None
        raise UserError(f"corrupt safetensors file: {path} ({reason})") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _to_numpy(get, name: str, f: pathlib.Path) -> np.ndarray:
    """Run a safetensors read; bfloat16 -> float32, unsupported dtypes -> UserError."""
    try:
        a = get()
    except (TypeError, SafetensorError) as exc:  # numpy has no such dtype (float8, ...)
        raise UserError(f"cannot read {name!r} from {f}: {exc}") from None
    return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a


class SafetensorsRows(RowBlocks):
    """One 2-D tensor of an open safetensors file, read a block of rows at a time."""

    def __init__(self, handle, name: str, path: pathlib.Path):
        self._slice, self.name, self.path = handle.get_slice(name), name, path
        self.shape = tuple(self._slice.get_shape())
        st = self._slice.get_dtype()
        self.dtype = _ST_DTYPES.get(st, st.lower())  # as stored: blocks of bfloat16 are float32

    def __getitem__(self, rows: slice) -> np.ndarray:
        # safetensors refuses slices past the end, which numpy clips: clip them here
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("SafetensorsRows reads contiguous row blocks only")
        stop = max(start, stop)
        if start == stop:
            return np.empty((0, *self.shape[1:]), np.float32)
        return _to_numpy(lambda: self._slice[start:stop], self.name, self.path)


def torch_load(f: pathlib.Path):
    """`torch.load(f, weights_only=True)`, memory-mapped when the file format allows it."""
    import torch

    try:
        try:
            return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            return torch.load(f, map_location="cpu", weights_only=True)  # pre-zip format
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load {f} with weights_only=True (refusing to unpickle "
                        f"arbitrary objects): {reason[:200]}") from None


def torch_to_numpy(t) -> np.ndarray:
    """A CPU tensor as numpy (shared memory where possible); bfloat16 and float8 -> float32."""
    import torch

    t = t.detach()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return t.numpy()


class CheckpointReader:
    """Tensor-by-tensor access to the weights of one Hugging Face checkpoint directory.

    `only` (tensor names) lets a partly downloaded sharded checkpoint open: then only the
    shards holding those tensors must be present.
    """

    def __init__(self, directory, *, only=None):
        self.directory = d = pathlib.Path(directory)
        if not d.is_dir():
            raise UserError(f"model directory not found: {d}")
        self._files: dict[str, pathlib.Path] = {}  # tensor name -> file
        self._st: dict[pathlib.Path, object] = {}  # open safe_open handles
        self._bin: dict[pathlib.Path, dict] = {}
        self._maps: dict[pathlib.Path, tuple] = {}  # file -> (uint8 memmap, data start, header)
        self._index: pathlib.Path | None = None
        for index, single, kind in (("model.safetensors.index.json", "model.safetensors", "st"),
                                    ("pytorch_model.bin.index.json", "pytorch_model.bin", "bin")):
            self.format = "safetensors" if kind == "st" else "bin"
            if (d / index).is_file():
                self._index = d / index
                self._files = {k: d / v for k, v in _read_index(d / index).items()}
                needed = self._files.values() if only is None else \
                    [self._files[t] for t in only if t in self._files]
                for f in sorted(set(needed)):
                    self._require(f)
                return
            files = [d / single] if (d / single).is_file() else \
                sorted(d.glob("*.safetensors")) if kind == "st" else []
            if files:
                for f in files:
                    self._open(f)
                return
        raise UserError(f"no weights found in {d} (expected model.safetensors, "
                        "model.safetensors.index.json, pytorch_model.bin or its index)")

    def _require(self, f: pathlib.Path) -> None:
        if f in self._st or f in self._bin:
            return
        if not f.is_file():
            raise UserError(f"missing shard {f.name} listed in {self._index}")
        self._open(f)

    def _open(self, f: pathlib.Path) -> None:
        if f.suffix == ".safetensors":
            self._st[f] = open_safetensors(f)
            names = self._st[f].keys()
        else:
            sd = torch_load(f)
            if not isinstance(sd, dict):
                raise UserError(f"{f} does not hold a state dict")
            self._bin[f] = sd
            names = sd.keys()
        for name in names:
            self._files[name] = f

    def names(self) -> list[str]:
        return sorted(self._files)

    def files(self) -> list[pathlib.Path]:
        """The weight files behind the tensors."""
        return sorted(set(self._files.values()))

    def _file(self, name: str) -> pathlib.Path:
        if name not in self._files:
            close = difflib.get_close_matches(name, self._files, n=4, cutoff=0.5)
            hint = "; close names: " + ", ".join(close) if close else \
                f"; it has {len(self._files)} tensors, e.g. " + ", ".join(self.names()[:3])
            raise UserError(f"tensor {name!r} not found in {self.directory}{hint}")
        f = self._files[name]
        self._require(f)
        if f in self._st and name not in self._st[f].keys() or f in self._bin and name not in self._bin[f]:
            raise UserError(f"tensor {name!r} listed in {self._index} is missing from {f}")
        return f

    def shape(self, name) -> tuple:
        f = self._file(name)
        if f in self._st:
            return tuple(self._st[f].get_slice(name).get_shape())
        return tuple(self._bin[f][name].shape)

    def dtype(self, name) -> str:
        """Stored dtype as a lowercase numpy-style name: float32, float16, bfloat16, ..."""
        f = self._file(name)
        if f in self._st:
            return SafetensorsRows(self._st[f], name, f).dtype
        return str(self._bin[f][name].dtype).removeprefix("torch.")

    def read(self, name) -> np.ndarray:
        """One tensor, read from its file alone (bfloat16 upcast to float32)."""
        f = self._file(name)
        if f in self._st:
            return _to_numpy(lambda: self._st[f].get_tensor(name), name, f)
        return torch_to_numpy(self._bin[f][name])

    def mapped(self, name) -> np.ndarray:
        """One tensor as stored (bfloat16 too), a read-only view of the memory-mapped file where it
        is safetensors: nothing is copied until the view is read (e.g. by jax.device_put, which
        then reads the page cache once instead of a copy of it); else `read`."""
        f = self._file(name)
        if f not in self._st:
            return self.read(name)
        if f not in self._maps:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            self._maps[f] = (np.memmap(f, np.uint8, "r"), 8 + n, header)
        buf, start, header = self._maps[f]
        entry = header[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None or dtype == "bool":
            return self.read(name)
        begin, end = entry["data_offsets"]
        return buf[start + begin:start + end].view(np.dtype(dtype)).reshape(entry["shape"])

    def rows(self, name):
        """A 2-D tensor to read in row blocks (`RowBlocks`; `.bin`: memory-mapped)."""
        f = self._file(name)
        if f in self._st:
            return SafetensorsRows(self._st[f], name, f)
        return self.read(name)
