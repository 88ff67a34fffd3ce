"""Data parallelism: 2 devices (forced host devices) give the metrics of 1 device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import build_hf_checkpoint
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]


def test_two_devices_equal_one(tmp_path):
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 80, seed=7)
    results = []
    for devices in (1, 2):
        env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        out = tmp_path / f"out{devices}"
        proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(tmp_path / "ckpt"), "--data",
                               str(tmp_path / "pile.jsonl"), "--unit", "document", "--seq-len", "64",
                               "--batch-tokens", "256", "--no-plots", "--out", str(out)],
                              cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"devices: {devices} x" in proc.stderr
        results.append(json.loads((out / "metrics.json").read_text()))
    one, two = results
    assert one["tokens"] == two["tokens"] and one["sources"].keys() == two["sources"].keys()
    for a, b in zip(one["layers"], two["layers"]):
        assert a["count"] == b["count"] and a["intra_tokens"] == b["intra_tokens"]
        for key in ("inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "mean_norm"):
            assert abs(a[key] - b[key]) < 1e-7 * max(1.0, abs(a[key])), key  # merge order only
