"""A Hugging Face checkpoint folder of any supported family -> (config, its tensors as stored,
checksum of the weight files), through the family registry (isojax.hf.family)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from isojax.hf.family import hf_tensors, read_hf_config


def read_hf_tensors(path: Path, put: Callable | None = None):
    """Hugging Face checkpoint dir of any supported family -> (config, its tensors as stored
    (bfloat16 read as float32), checksum of the weight files). put: applied to each tensor as
    stored (bfloat16 too), a view of the memory-mapped file (CheckpointReader.mapped), e.g.
    jax.device_put: no copy in host memory."""
    from isojax.hf.files import CheckpointReader
    cfg = read_hf_config(path, name=path.name)
    reader = CheckpointReader(path)
    read = reader.read if put is None else (lambda name: put(reader.mapped(name)))
    tensors = hf_tensors(read, reader.names(), cfg)
    return cfg, tensors, files_checksum(reader.files())


def files_checksum(files, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """sha256 of each file's name and size, its first 1 MiB (a safetensors header and more) and
    `samples` evenly spaced blocks: any two checkpoints of one model differ in all of these, and a
    full hash of pythia-1.4b's weights took 15 s."""
    h = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for k in range(samples):
                fh.seek(size * k // samples)
                h.update(fh.read(sample_bytes))
    return "sha256:" + h.hexdigest()[:32]
