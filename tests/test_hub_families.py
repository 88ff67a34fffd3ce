"""Another family through the loopback hub, as a user with network meets it: an OLMo-2 repository
whose revisions are named as OLMo-2's are (`stage1-stepN-tokensM`), swept by `extract` and by
`weights` by hub id. The states' exactness per family is tests/test_families.py's; this checks the
path from the hub: revision listing, download, the repository's own tokenizer, one name per
checkpoint and the training steps read from OLMo's revision names."""

from __future__ import annotations

import csv
import json

import pytest

from hub_server import LoopbackHub
from test_families import build
from test_hub import hub_env, last_line, run

REPO_ID = "tiny-org/olmo2-tiny"
REVISIONS = ["stage1-step1000-tokens5B", "stage1-step2000-tokens10B"]
SHAPE = dict(vocab_size=50304, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="module")
def olmo_hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo")
    branches = {}
    for seed, rev in enumerate([*REVISIONS, "main"]):
        build(root / rev, "olmo2", seed=seed, tokenizer=True, **SHAPE)
        branches[rev] = root / rev
    hub = LoopbackHub().start()
    hub.add_model(REPO_ID, branches)
    yield hub
    hub.stop()


@pytest.mark.slow
def test_olmo_revisions_sweep_over_the_hub(olmo_hub, tmp_path):
    env = hub_env(olmo_hub.url, tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The model reads a sentence. Every layer keeps its state. " * 40)
    out = tmp_path / "out"
    p = run("-m", "isojax.extract", "--model", REPO_ID, "--revisions", ",".join(REVISIONS), "--data", corpus,
            "--seq-len", "64", "--batch-tokens", "256", "--no-plots", "--out", out, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    for rev in REVISIONS:
        metrics = json.loads((out / "tiny-org--olmo2-tiny" / rev / "metrics.json").read_text())
        assert (metrics["model"], metrics["revision"]) == (REPO_ID, rev)
        assert [layer["name"] for layer in metrics["layers"]] == ["embed", "block_1", "block_2", "final_ln"]
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert sorted({(r["revision"], r["step"]) for r in rows}) == [(REVISIONS[0], "1000"), (REVISIONS[1], "2000")]
    # the tokenizer is the repository's own, each revision's weights downloaded once, only safetensors
    got = olmo_hub.downloads(REPO_ID)
    assert not [f for f in got if f.endswith(".bin")], got
    # weights over the same revisions: the same (model, revision) names, the family read from config.json
    w = tmp_path / "w"
    p = run("-m", "isojax.weights", "--model", REPO_ID, "--revisions", ",".join(REVISIONS), "--no-plots",
            "--out", w, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    for rev in REVISIONS:
        doc = json.loads((w / "tiny-org--olmo2-tiny" / rev / "weights.json").read_text())
        assert (doc["model"], doc["revision"], doc["family"], doc["final_ln"]["norm"]) == \
            (REPO_ID, rev, "olmo2", "rmsnorm")


@pytest.mark.slow
def test_unknown_olmo_revision_is_named_before_anything_runs(olmo_hub, tmp_path):
    env = hub_env(olmo_hub.url, tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A sentence. " * 20)
    before = len(olmo_hub.downloads(REPO_ID))  # the hub is the module's: earlier tests downloaded
    p = run("-m", "isojax.extract", "--model", REPO_ID, "--revisions", "stage1-step3000-tokens15B", "--data", corpus,
            "--no-plots", "--out", tmp_path / "out", env=env)
    assert p.returncode != 0 and "stage1-step3000-tokens15B" in last_line(p), p.stderr[-1500:]
    assert "Traceback" not in p.stderr
    assert len(olmo_hub.downloads(REPO_ID)) == before
