"""bench/bench_sweep.py on CPU (--tiny): local revision folders, a warm-up and a timed isojax sweep, the
Hugging Face peer per checkpoint over the same tokens, one table and its JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import bench_sweep  # noqa: E402


@pytest.mark.slow  # ~40 s on 2 cores: two extract processes and the peer
def test_tiny_sweep_bench_prints_both_sides_per_checkpoint(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_sweep.main(["--tiny", "--tokens", "2000", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["revisions"] == ["step1000", "step2000"] and list(doc["isojax"]) == ["isojax"]
    run = doc["isojax"]["isojax"]
    assert [s["revision"] for s in run["steps"]] == [p["revision"] for p in doc["peer"]] == doc["revisions"]
    for step, peer in zip(run["steps"], doc["peer"]):
        # the same tokens through the same weights: the peer's count and InterSim are isojax's (float32 on CPU)
        assert step["tokens"] == peer["tokens"] == doc["measured"] > 0
        assert step["inter_sim"] == pytest.approx(peer["inter_sim"], abs=1e-5)
        assert step["wall"] == pytest.approx(sum(step[k] for k in bench_sweep.PHASES))
        assert any(span[0] == "loop" for span in step["timeline"])
    assert run["sum_loops"] == pytest.approx(sum(s["loop"] for s in run["steps"]))
    assert run["target_ratio"] == pytest.approx(run["wall"] / (1.25 * run["sum_loops"] + run["steps"][0]["compile"]))
    printed = capsys.readouterr().out
    assert "peer/isojax" in printed and "(target <= 1)" in printed and "(target >= 1.5)" in printed
    assert sum(line.startswith(("step1000", "step2000")) for line in printed.splitlines()) == 4
