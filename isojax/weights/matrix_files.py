"""One 2-D matrix from a file, named `PATH[:KEY]` (`python -m isojax.weights --matrix`).

By the file's extension:

  .npy                      the array, memory-mapped; no KEY
  .npz                      KEY = array name (may be left out when the archive holds one array)
  .safetensors              KEY = tensor name (may be left out when the file holds one); read
                            lazily with `safe_open`, a block of rows at a time
  .bin, .pt, .pth           `torch.load(weights_only=True)`; KEY = state-dict key, nested dicts
                            as dotted keys (`model.embed.weight`); may be left out for one tensor
  .txt, .vec (also .gz)     word vectors, one per line: the word, then the values, separated by
                            single spaces; word2vec text format (first line "N D") or GloVe (no
                            header); no KEY. A first line of two integers is a word2vec header.
                            The words are not kept: row i is the i-th vector.

PATH[:KEY] is split at the first ':' whose left part is an existing file, so paths and keys
may both hold colons. Nothing is unpickled (np.load(allow_pickle=False),
torch.load(weights_only=True)); every bad input is a UserError naming the file.

Size bombs are refused before anything big is allocated: an .npz array whose header claims
more bytes than its archive member holds, or more than the memory available (MemAvailable);
word vectors beyond the available memory (from the "N D" header when there is one, else as
they are read; rows are read into blocks of at most 16 MB, and a line may hold at most 16 MB);
and any matrix whose D x D float64 Gram matrix and its eigendecomposition (~4 x 8 x D^2 bytes)
would not fit.
"""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import itertools
import os
import pathlib
import zipfile
import zlib

import numpy as np

from isojax.hf import files as hf_files
from isojax.errors import UserError

TEXT_SUFFIXES = (".txt", ".vec", ".txt.gz", ".vec.gz")
SUFFIXES = (".npy", ".npz", ".safetensors", ".bin", ".pt", ".pth") + TEXT_SUFFIXES
_BLOCK_BYTES = 16 << 20  # word vectors are read into blocks of this many bytes of rows
_MAX_LINE = 16 << 20  # bytes of one word-vector line (about a million values)
_SHOW_KEYS = 10


@dataclasses.dataclass
class MatrixFile:
    """A matrix read from `path` (the `key` entry of it, if any): an array or `RowBlocks`."""
    spec: str
    path: pathlib.Path
    key: str | None
    format: str
    dtype: str
    matrix: object


def split_spec(spec: str) -> tuple[pathlib.Path, str | None]:
    """`PATH[:KEY]` -> (path, key): the first split whose path is an existing file."""
    if pathlib.Path(spec).expanduser().is_file():
        return pathlib.Path(spec).expanduser(), None
    for i, ch in enumerate(spec):
        if ch == ":" and i > 0 and pathlib.Path(spec[:i]).expanduser().is_file():
            return pathlib.Path(spec[:i]).expanduser(), spec[i + 1:]
    head = spec.split(":", 1)[0] if not pathlib.Path(spec).expanduser().exists() else spec
    if pathlib.Path(head).expanduser().is_dir():
        raise UserError(f"--matrix {spec}: {head} is a directory (use --model for checkpoints)")
    raise UserError(f"--matrix {spec}: no such file")


def _suffix(path: pathlib.Path) -> str:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def read_matrix(spec: str) -> MatrixFile:
    """The matrix named by `PATH[:KEY]`; checks that it is a non-empty 2-D real array."""
    path, key = split_spec(spec)
    suffix = _suffix(path)
    if not suffix:
        raise UserError(f"--matrix {spec}: unknown file type {path.suffix or '(no extension)'!r}; "
                        f"supported: {', '.join(SUFFIXES)}")
    if suffix in (".npy",) + TEXT_SUFFIXES and key is not None:
        raise UserError(f"--matrix {spec}: a {suffix} file holds one matrix; drop ':{key}'")
    if suffix == ".npy":
        fmt, m = "npy", _load_npy(path)
    elif suffix == ".npz":
        fmt, (key, m) = "npz", _load_npz(path, key)
    elif suffix == ".safetensors":
        fmt, (key, m) = "safetensors", _load_safetensors(path, key)
    elif suffix in (".bin", ".pt", ".pth"):
        fmt, (key, m) = "torch", _load_torch(path, key)
    else:
        fmt, m = "text", read_word_vectors(path)
    where = f"{path}" + (f" [{key}]" if key is not None else "")
    if len(m.shape) != 2 or 0 in m.shape:
        raise UserError(f"{where} has shape {tuple(m.shape)}: the matrix metrics need a "
                        "non-empty 2-D array")
    _fits(4 * 8 * int(m.shape[1]) ** 2, f"{where}: its {m.shape[1]:,} columns need a "
          f"{m.shape[1]:,} x {m.shape[1]:,} float64 Gram matrix and its eigenvectors")
    dtype = str(m.dtype)
    if dtype.startswith("torch."):
        dtype = dtype.removeprefix("torch.")
        m = hf_files.torch_to_numpy(m)
    if isinstance(m, np.ndarray) and not (np.issubdtype(m.dtype, np.integer)
                                          or np.issubdtype(m.dtype, np.floating)
                                          or m.dtype == np.bool_):
        raise UserError(f"{where} has dtype {m.dtype}: the matrix metrics need real numbers")
    return MatrixFile(spec, path, key, fmt, dtype, m)


def _pick(path: pathlib.Path, key: str | None, names: list[str], what: str) -> str:
    """The entry `key` of a file holding `names`; `key` may be None when there is one."""
    if key is None:
        if len(names) == 1:
            return names[0]
        raise UserError(f"{path} holds {len(names)} {what}s: name one as {path}:KEY"
                        + _listing(names, ""))
    if key not in names:
        raise UserError(f"no {what} {key!r} in {path}" + _listing(names, key))
    return key


def _listing(names: list[str], key: str) -> str:
    if not names:
        return "; it holds none"
    close = difflib.get_close_matches(key, names, n=_SHOW_KEYS, cutoff=0.5) if key else []
    shown = close + [n for n in names if n not in close][:_SHOW_KEYS - len(close)]
    more = f" (and {len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    return f"; it holds: {', '.join(shown)}{more}"


def _load_npy(path: pathlib.Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(f"cannot read {path} as .npy: {exc}") from None


def available_bytes() -> int:
    """Memory a new allocation can take: MemAvailable on Linux, else all physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fits(nbytes: int, what: str) -> None:
    if nbytes > available_bytes():
        raise UserError(f"{what}: {nbytes / 2**30:,.1f} GiB, more than the "
                        f"{available_bytes() / 2**30:,.1f} GiB of memory available")


def _check_npz_member(path: pathlib.Path, npz, key: str) -> None:
    """Refuse an array whose header claims more bytes than its member holds, or than memory
    (np.load would allocate the claimed size first: a 300-byte file can claim 40 GB)."""
    name = key if key in npz.zip.namelist() else f"{key}.npy"
    info = npz.zip.getinfo(name)
    with npz.zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in read:
            return  # 3.0: only for non-latin-1 field names; np.load refuses or reads it
        shape, _, dtype = read[version](f)
        data = info.file_size - f.tell()
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=object))
    if nbytes > data:
        raise UserError(f"{path} [{key}]: its header claims shape {shape} ({nbytes:,} bytes) but "
                        f"the archive holds {data:,} bytes of it")
    _fits(nbytes, f"{path} [{key}] is {shape} {dtype}; .npz arrays are read whole (save it as "
          ".npy to memory-map it)")


def _load_npz(path: pathlib.Path, key: str | None):
    try:
        with np.load(path, allow_pickle=False) as npz:
            key = _pick(path, key, list(npz.files), "array")
            _check_npz_member(path, npz, key)
            return key, npz[key]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise UserError(f"cannot read {path} as .npz: {exc}") from None


def _load_safetensors(path: pathlib.Path, key: str | None):
    handle = hf_files.open_safetensors(path)
    key = _pick(path, key, list(handle.keys()), "tensor")
    return key, hf_files.SafetensorsRows(handle, key, path)


def _flatten(obj, prefix: str = ""):
    """(dotted name, tensor) for every tensor in nested dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))


def _load_torch(path: pathlib.Path, key: str | None):
    tensors = dict(_flatten(hf_files.torch_load(path)))
    if list(tensors) == [""]:  # the file holds one bare tensor
        if key is not None:
            raise UserError(f"{path} holds a single tensor, not a dict: drop ':{key}'")
        return None, tensors[""]
    key = _pick(path, key, list(tensors), "tensor")
    if tensors[key].is_complex():
        raise UserError(f"{path} [{key}] has dtype {tensors[key].dtype}: the matrix metrics "
                        "need real numbers")
    return key, tensors[key]


def read_word_vectors(path: pathlib.Path) -> np.ndarray:
    """float32 [N, D] from a word2vec text or GloVe file (module docstring), checked line by line."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    chunks, buf, filled, d, header_n, header_line = [], None, 0, None, None, None
    budget = available_bytes() // 2  # the blocks, then their concatenation
    try:
        with opener(path, "rb") as f:
            for lineno in itertools.count(1):
                line = f.readline(_MAX_LINE + 1)  # bounded: a file may be one endless line
                if not line:
                    break
                if len(line) > _MAX_LINE:
                    raise UserError(f"{path}, line {lineno}: longer than {_MAX_LINE >> 20} MB")
                parts = line.rstrip().split(b" ")
                if parts == [b""]:
                    continue  # blank line
                if header_line is None and d is None and len(parts) == 2 \
                        and all(p.isdigit() for p in parts):
                    header_n, d, header_line = int(parts[0]), int(parts[1]), lineno
                    if d < 1:
                        raise UserError(f"{path}, line {lineno}: the header gives {d} dimensions")
                    _fits(2 * 4 * header_n * d, f"{path}: the header's {header_n:,} x {d:,} "
                          "float32 vectors, read and joined")
                    continue
                if d is None:
                    d = len(parts) - 1
                    if d < 1:
                        raise UserError(f"{path}, line {lineno}: a word without a vector")
                if len(parts) - 1 != d:
                    why = "the header" if header_line else "the first vector"
                    raise UserError(f"{path}, line {lineno}: {len(parts) - 1} values after the "
                                    f"word, expected {d} (as {why} says)")
                if buf is None or filled == len(buf):
                    if buf is not None:
                        chunks.append(buf)
                    rows = max(1, _BLOCK_BYTES // (4 * d))
                    if 4 * d * (rows + sum(map(len, chunks))) > budget:
                        raise UserError(f"{path}, line {lineno}: the vectors so far, read and joined, "
                                        f"need more than the {2 * budget / 2**30:,.1f} GiB of memory available")
                    buf, filled = np.empty((rows, d), np.float32), 0
                try:
                    buf[filled] = parts[1:]
                except ValueError:
                    bad = next((p for p in parts[1:] if not _is_float(p)), b"a value")
                    raise UserError(f"{path}, line {lineno}: {bad[:40].decode(errors='replace')!r} "
                                    "is not a number") from None
                filled += 1
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise UserError(f"cannot read {path}: {exc}") from None
    if buf is not None:
        chunks.append(buf[:filled])
    n = sum(len(c) for c in chunks)
    if header_n is not None and n != header_n:
        raise UserError(f"{path}: the header says {header_n} vectors, the file holds {n}")
    if n == 0:
        raise UserError(f"{path} holds no word vectors")
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def _is_float(b: bytes) -> bool:
    try:
        float(b)
        return True
    except ValueError:
        return False
