"""Another family through the loopback hub, as a user with network meets it: an OLMo-2 repository
whose revisions are named as OLMo-2's are (`stage1-stepN-tokensM`), swept by `extract` and by
`weights` by hub id. The states' exactness per family is tests/test_families.py's; this checks the
path from the hub: revision listing, download, the repository's own tokenizer, one name per
checkpoint and the training steps read from OLMo's revision names; and the README's `weights`
commands for the paper's contrast rows and OLMo, verbatim, against tiny models served under their
names."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import LoopbackHub
from test_families import build
from test_hub import hub_env, last_line, run

REPO = Path(__file__).resolve().parents[1]
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


def readme_weights_commands() -> list[list[str]]:
    """The README's `weights` block, line by line (comments dropped), but for the lines that need no
    hub (random weights, matrices in files), which tests/test_weights.py runs."""
    import shlex

    text = (REPO / "README.md").read_text()
    block = text[text.index("python -m isojax.weights --model pythia-410m --revision step143000"):]
    block = block[:block.index("```")]
    lines = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]
    return [argv for argv in lines if "random:pythia-70m" not in argv and "--matrix" not in argv]


@pytest.mark.slow
def test_readme_weights_commands_of_other_families(tmp_path_factory, tmp_path):
    """Every hub command of the README's weights section, verbatim, against tiny models served under
    the README's names: Pythia, the paper's OPT-6.7B and Falcon-7B contrast rows (tied), OLMo's
    revisions, a --tensor run, and the report side by side."""
    from conftest import build_hf_checkpoint
    from isojax.steps import paper_steps

    root = tmp_path_factory.mktemp("readme-repos")
    neox = root / "neox"
    build_hf_checkpoint(neox, num_layers=1, hidden_size=32, num_heads=2)
    small = dict(vocab_size=320, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    for family, folder in (("opt", "opt"), ("falcon", "falcon"), ("olmo", "olmo")):
        build(root / folder, family, **dict(small, **({"ffn_dim": 96} if family == "opt" else {})))
    hub = LoopbackHub().start()
    try:
        hub.add_model("EleutherAI/pythia-410m", {"step143000": neox, "main": neox})
        hub.add_model("EleutherAI/pythia-70m", {r: neox for r in ["main", *paper_steps()]})
        hub.add_model("facebook/opt-6.7b", {"main": root / "opt"})
        hub.add_model("facebook/opt-125m", {"main": root / "opt"})
        hub.add_model("tiiuae/falcon-7b", {"main": root / "falcon"})
        hub.add_model("allenai/OLMo-1B-hf", {r: root / "olmo" for r in
                                             ("main", "step1000-tokens4B", "step20000-tokens84B")})
        env = hub_env(hub.url, tmp_path)
        commands = readme_weights_commands()
        assert len(commands) >= 6 and any("facebook/opt-6.7b" in c for c in commands)
        for argv in commands:
            assert argv[:2] == ["python", "-m"], argv
            p = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=600)
            assert p.returncode == 0, (argv, p.stderr[-2000:])
    finally:
        hub.stop()
    out = tmp_path / "out"
    for name, family in (("opt-6.7b", "opt"), ("falcon-7b", "falcon")):
        doc = json.loads((out / name / "weights.json").read_text())
        assert (doc["family"], doc["tied"], doc["embed_out"]["tied_to"]) == (family, True, "embed_in")
    rows = list(csv.DictReader(open(out / "olmo" / "sweep.csv")))
    assert sorted(int(r["step"]) for r in rows) == [1000, 20000]
    assert "model.decoder.embed_tokens.weight" in json.loads((out / "opt" / "weights.json").read_text())["tensors"]
    assert (out / "report-contrast" / "report.html").is_file()
