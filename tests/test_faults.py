"""Faults a long run meets, named for what they are: a full disk is never reported as the device
out of memory, a device out of memory names the flags that lower memory, SIGTERM checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from isojax.errors import OUT_OF_MEMORY, explain, run_command


def _raises(e):
    def body(_):
        raise e
    return body


def test_a_full_disk_is_called_a_full_disk(small_disk, capsys):
    import tensorstore as ts
    disk = small_disk("disk", 64)
    with pytest.raises(ValueError) as tensorstore_error:  # tensorstore says RESOURCE_EXHAUSTED, as XLA does
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(disk / "x.zarr")}}, create=True,
                        dtype="float64", shape=(300, 300)).result()
        store.write(np.random.default_rng(0).random((300, 300))).result()  # incompressible
    with pytest.raises(OSError) as numpy_error:
        np.save(disk / "y.npy", np.ones((300, 300)))
    for e in (tensorstore_error.value, numpy_error.value):
        assert (explain(e) or "").startswith("disk full"), repr(e)
        assert run_command(_raises(e), None) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: disk full") and "memory" not in err and err.count("\n") == 1


def test_device_out_of_memory_names_the_flags(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 42949672960 bytes.")
    assert explain(xla) == OUT_OF_MEMORY
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a pool grown piece by piece: say so first
    assert explain(xla).startswith(OUT_OF_MEMORY) and "unset it" in explain(xla)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    assert explain(xla) == OUT_OF_MEMORY
    assert "--batch-tokens" in OUT_OF_MEMORY and "--mesh" in OUT_OF_MEMORY
    assert explain(RuntimeError("INTERNAL: something else")) is None
    with pytest.raises(RuntimeError):  # a bug stays a traceback
        run_command(_raises(RuntimeError("INTERNAL: something else")), None)


def test_results_that_cannot_fit_the_disk_are_refused_before_any_work(small_disk, tmp_path):
    """pythia-70m's per-token arrays alone need ~3.6 MB: a 1 MB --out is refused at once, before any
    weights load, and nothing is left there."""
    import subprocess
    import sys
    from pathlib import Path
    disk = small_disk("disk", 1024)
    proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", "random:pythia-70m", "--out",
                           str(disk / "out")], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                          env={**__import__("os").environ, "ISOJAX_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "GB free" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model random:pythia-70m" not in proc.stderr  # refused before the model was loaded
    assert list(disk.iterdir()) == []
