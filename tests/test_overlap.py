"""The fixed costs of a run overlapped (issue 39, item 2): the weights read while the token cache
opens, the figures and files that need only the whole population made while the per-source
reductions are read out. Events the tests control order the threads (isojax.faults.hook), so no
verdict depends on the machine's speed; a timeout only ends a wait that the old order never ends."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import build_hf_checkpoint
from isojax import faults
from isojax.extract import main
from test_extract import WORDS

WAIT_S = 120  # only code that does not overlap waits this long, and then fails
RUN_SPECIFIC = {"timings", "timeline", "seconds_wall", "seconds_device_loop", "tokens_per_second", "step_plan_s",
                "finished", "command", "from_cache"}


def write_sources(path: Path, n_docs: int, sources=("A", "B", "C")) -> None:
    import numpy as np
    rng = np.random.default_rng(4)
    with open(path, "w") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": sources[i % len(sources)]}}) + "\n")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    build_hf_checkpoint(root / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_sources(root / "pile.jsonl", 90)
    return root


def _args(inputs: Path, out: Path) -> list[str]:
    return ["--model", str(inputs / "ckpt"), "--data", str(inputs / "pile.jsonl"), "--seq-len", "64",
            "--batch-tokens", "512", "--out", str(out)]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", ".isojax-results.json")}


def test_figures_and_weights_overlap_and_outputs_equal_a_run_without(tmp_path, monkeypatch, inputs):
    """In `python -m isojax.extract`: the weights' read starts before the token cache is open, the
    figures start before the per-source reductions are read back, the manifest's timeline shows
    both; every file equals that of isojax.measure + save, which reads the sources out first."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    weights_read, drawing, seen = threading.Event(), threading.Event(), {}
    wait = lambda name, event: lambda: seen.setdefault(name, event.wait(WAIT_S))
    with faults.hook("weights_read", weights_read.set), faults.hook("plots_drawing", drawing.set), \
            faults.hook("tokens_opened", wait("tokens opened after the weights' read began", weights_read)), \
            faults.hook("sources_readout", wait("sources read after the figures began", drawing)):
        assert main(_args(inputs, tmp_path / "cli")) == 0
    assert seen == {"tokens opened after the weights' read began": True, "sources read after the figures began": True}
    spans = json.loads((tmp_path / "cli" / "manifest.json").read_text())["timeline"]
    first = lambda name: next(s for s in spans if s[0] == name)
    load = [s for s in spans if s[0] == "load"][-1]  # the weights' (the first: the config and tokenizer)
    assert first("tokenize (beside)")[2] >= load[1]  # the cache was still opening when the read began
    assert first("plots (beside)")[1] <= first("finalize (beside)")[2]  # drawn beside the read-out

    import isojax
    results = isojax.measure(str(inputs / "ckpt"), [str(inputs / "pile.jsonl")], seq_len=64, batch_tokens=512,
                             progress=False)
    assert results.pending is None and set(results.metrics["sources"]) == {"A", "B", "C"}
    results.save(tmp_path / "library")
    cli, library = _files(tmp_path / "cli"), _files(tmp_path / "library")
    assert "plots/sources_anisotropy.png" in cli and "metrics.json" in cli
    assert cli.keys() == library.keys()
    assert [name for name in cli if cli[name] != library[name]] == []
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("cli", "library")]
    assert [{k: v for k, v in m.items() if k not in RUN_SPECIFIC} for m in manifests][0] == \
        [{k: v for k, v in m.items() if k not in RUN_SPECIFIC} for m in manifests][1]


@pytest.mark.parametrize("point", ["tokens_opened", "sources_readout"])
def test_an_error_beside_the_main_thread_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, capsys, inputs,
                                                                      point):
    """A UserError raised on the thread beside the load (the token cache) or beside the writes
    (the per-source read-out) ends the run with one `error:` line and nothing in --out."""
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ISOJAX_FAULT", f"{point}:raise")
    assert main(_args(inputs, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == \
        [f"error: fault injected at {point} (ISOJAX_FAULT)"], err[-2000:]
    assert "Traceback" not in err
    out = tmp_path / "out"
    assert not out.exists() or not [p for p in out.iterdir() if p.name != "checkpoint"], list(out.iterdir())


def test_no_thread_that_may_outlive_measure_is_a_daemon(tmp_path, monkeypatch, inputs):
    """measure() returns while the sampled tokens' ids are still recovered beside (a JAX program on
    the host). That thread must hold the interpreter at exit: a daemon one still inside JAX when the
    interpreter finalized aborted the process (SIGABRT, "terminate called ...") about every other
    time a script ended right after measure(). The thread is held at its start here, so it is
    surely alive when measure() returns."""
    import isojax
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    release = threading.Event()
    with faults.hook("sample_identify", lambda: release.wait(WAIT_S)):
        results = isojax.measure(str(inputs / "ckpt"), [str(inputs / "pile.jsonl")], seq_len=64, batch_tokens=512,
                                 progress=False, sample_states=200)
        beside = [t for t in threading.enumerate() if t.name.startswith("isojax-sample-ids")]
        release.set()
    assert beside and not any(t.daemon for t in beside), [(t.name, t.daemon) for t in beside]
    ids = results.final["sample_tokens"].result()
    assert len(ids["token_ids"]) == 200 and (ids["token_ids"] >= 0).all()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("isojax") and t.daemon and t.is_alive()]
