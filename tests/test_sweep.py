"""Sweeps: local directories stand in for hub revisions (DIR/step1000/, ...); one result folder
per (model, revision), sweep.csv, resume at the first unfinished step, the report over it."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_hf_checkpoint
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]


def run(*args, env):
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_sweep_over_local_revisions_and_models(tmp_path):
    import os
    env = {**os.environ, "ISOJAX_CACHE": str(tmp_path / "cache")}
    for seed, rev in enumerate(("step1000", "step2000")):
        build_hf_checkpoint(tmp_path / "small" / rev, seed=seed, vocab_size=50304, hidden_size=32, num_layers=1,
                            num_heads=2)
        build_hf_checkpoint(tmp_path / "big" / rev, seed=10 + seed, vocab_size=50304, hidden_size=48, num_layers=2,
                            num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 40, seed=9)
    common = ["isojax.extract", "--model", tmp_path / "small", "--model", tmp_path / "big", "--data",
              tmp_path / "pile.jsonl", "--seq-len", "64", "--batch-tokens", "512", "--no-plots", "--out", tmp_path / "out"]
    bad = run(*common, "--revisions", "step1000,step3000", env=env)
    assert bad.returncode == 2 and "step3000" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("metrics.json"))

    first = run(*common, "--revisions", "step1000,step2000", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    steps = {(m, r): json.loads((tmp_path / "out" / m / r / "metrics.json").read_text())
             for m in ("small", "big") for r in ("step1000", "step2000")}
    assert all(v["revision"] == r for (m, r), v in steps.items())
    # each step equals a run of its checkpoint alone
    single = run("isojax.extract", "--model", tmp_path / "big" / "step2000", "--data", tmp_path / "pile.jsonl",
                 "--seq-len", "64", "--batch-tokens", "512", "--no-plots", "--out", tmp_path / "single", env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    alone = json.loads((tmp_path / "single" / "metrics.json").read_text())
    for a, b in zip(alone["layers"], steps["big", "step2000"]["layers"]):
        assert a["inter_sim"] == b["inter_sim"] and a["intra_sim"] == b["intra_sim"]
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv")))
    assert len(rows) == 2 * 3 + 2 * 4  # (L + 2) states per step
    assert {r["step"] for r in rows} == {"1000", "2000"}
    row = next(r for r in rows if r["model"] == "big" and r["revision"] == "step1000" and r["name"] == "final_ln")
    assert float(row["inter_sim"]) == steps["big", "step1000"]["layers"][-1]["inter_sim"]

    # a killed sweep: one step unfinished; --resume redoes only that one
    (tmp_path / "out" / "small" / "step2000" / "metrics.json").unlink()
    refused = run(*common, "--revisions", "step1000,step2000", env=env)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    again = run(*common, "--revisions", "step1000,step2000", "--resume", env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("done earlier") == 3
    assert json.loads((tmp_path / "out" / "small" / "step2000" / "metrics.json").read_text())["layers"] == \
        steps["small", "step2000"]["layers"]

    # the paper's figures from the sweep
    report = run("isojax.report", tmp_path / "out", "--out", tmp_path / "report", env=env)
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "report" / "report.html").stat().st_size > 10_000
