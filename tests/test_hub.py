"""isojax against a Hugging Face hub on 127.0.0.1 (tests/hub_server.py): the real `huggingface_hub`
and `datasets` clients, HF_ENDPOINT pointing at the loopback hub, HF_HOME a temporary folder, no
other network. Every command runs in a subprocess, as a user runs it (huggingface_hub reads its
environment when imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import build_hf_checkpoint, need
from hub_server import LoopbackHub

REPO = Path(__file__).resolve().parents[1]
A, B, DATA = "tiny-org/neox-a", "tiny-org/neox-b", "tiny-org/pile-tiny"
SOURCES = ["Enron Emails", "HackerNews", "Github"]
WORDS = ("the model reads a sentence and every layer keeps its state while tokens pass through heads of "
         "attention that weigh words by their meaning in context").split()
SMALL = dict(vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)


def write_zst_jsonl(path: Path, n_docs: int, seed: int) -> None:
    import zstandard
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 30))))
        lines.append(json.dumps({"text": text, "meta": {"pile_set_name": SOURCES[i % len(SOURCES)]}}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))


def save_bin(model, directory: Path) -> None:
    """pytorch_model.bin beside what save_pretrained wrote (it writes safetensors only)."""
    torch = need("torch")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "pytorch_model.bin")


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Folders of the repositories' branches, built once for the module:
    A: step0, step1000 (sharded safetensors), main (model.safetensors AND pytorch_model.bin);
    B: step0, step1000, main, .bin only; DATA: Pile-shaped .jsonl.zst shards."""
    root = tmp_path_factory.mktemp("repos")
    a = {r: root / "a" / r for r in ("step0", "step1000", "main")}
    build_hf_checkpoint(a["step0"], seed=0, **SMALL)
    build_hf_checkpoint(a["step1000"], seed=1, max_shard_size="4MB", **SMALL)
    save_bin(build_hf_checkpoint(a["main"], seed=2, **SMALL), a["main"])
    b = {r: root / "b" / r for r in ("step0", "step1000", "main")}
    for seed, r in enumerate(b):
        save_bin(build_hf_checkpoint(b[r], seed=10 + seed, **dict(SMALL, hidden_size=48)), b[r])
        (b[r] / "model.safetensors").unlink()
    data = root / "data"
    write_zst_jsonl(data / "data" / "test-00000-of-00002.jsonl.zst", 90, seed=1)
    write_zst_jsonl(data / "data" / "test-00001-of-00002.jsonl.zst", 90, seed=2)
    write_zst_jsonl(data / "data" / "train-00000-of-00001.jsonl.zst", 30, seed=3)
    (data / "README.md").write_text("---\nlicense: other\n---\n# a Pile-shaped test corpus\n")
    return {"a": a, "b": b, "data": {"main": data}}


@pytest.fixture
def hub(repos):
    h = LoopbackHub().start()
    h.add_model(A, repos["a"])
    h.add_model(B, repos["b"])
    h.add_dataset(DATA, repos["data"])
    yield h
    h.stop()


def hub_env(hub_url: str, home: Path, **extra) -> dict:
    """The environment of a user whose HF_ENDPOINT is the loopback hub, with an empty cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in ("TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0",
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5",
               HF_HUB_DOWNLOAD_TIMEOUT="5", ISOJAX_CACHE=str(home / "isojax-cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def env(hub, tmp_path):
    return hub_env(hub.url, tmp_path)


def run(*args, env, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def py(code: str, env):
    return run("-c", code, env=env)


def last_line(proc) -> str:
    lines = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# --- the server speaks what the real clients need ----------------------------------------------

def test_real_client_downloads_refs_tree_and_errors(hub, env, repos):
    code = f"""
import huggingface_hub as h, json
api = h.HfApi()
refs = api.list_repo_refs({A!r})
info = api.model_info({A!r}, revision="step1000")
files = api.list_repo_files({A!r}, revision="step1000")
d = h.snapshot_download({A!r}, revision="step1000")
f = h.hf_hub_download({B!r}, "pytorch_model.bin", revision="step0")
errs = {{}}
for what, call in [("rev", lambda: h.hf_hub_download({A!r}, "config.json", revision="step9")),
                   ("entry", lambda: h.hf_hub_download({A!r}, "nope.json")),
                   ("repo", lambda: h.hf_hub_download("tiny-org/none", "config.json"))]:
    try:
        call()
    except Exception as e:
        errs[what] = type(e).__name__
print(json.dumps(dict(refs=sorted(b.name for b in refs.branches), sha=info.sha, files=sorted(files), d=d, f=f,
                      errs=errs)))
"""
    p = py(code, env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["refs"] == ["main", "step0", "step1000"]
    assert out["sha"] == hub.repos[("model", A)].branches["step1000"].commit
    assert "model.safetensors.index.json" in out["files"]
    local = Path(out["d"])
    for name in out["files"]:
        assert (local / name).read_bytes() == (repos["a"]["step1000"] / name).read_bytes()
    assert Path(out["f"]).read_bytes() == (repos["b"]["step0"] / "pytorch_model.bin").read_bytes()
    assert out["errs"] == {"rev": "RevisionNotFoundError", "entry": "RemoteEntryNotFoundError",
                           "repo": "RepositoryNotFoundError"}


def closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


EXTRACT_SMALL = ["--seq-len", "64", "--batch-tokens", "512", "--no-plots"]


def write_jsonl(path: Path, n_docs: int = 40) -> Path:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=12)),
                                "meta": {"pile_set_name": SOURCES[i % 2]}}) + "\n")
    return path


# --- findings of issue 29 ------------------------------------------------------------------------

def test_hub_reachable_follows_hf_endpoint(hub, env, tmp_path):
    """HF_ENDPOINT decides whether the hub is reachable: a mirror that answers is, one that does
    not is not (huggingface.co plays no part); HF_HUB_OFFLINE=1 is offline whatever the endpoint."""
    code = "from isojax.hf.network import hub_reachable; print(hub_reachable())"
    assert py(code, env).stdout.strip() == "True"
    down = dict(env, HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert py(code, down).stdout.strip() == "False"
    assert py(code, dict(env, HF_HUB_OFFLINE="1")).stdout.strip() == "False"


@pytest.mark.slow
def test_mirror_down_no_cache_is_an_error_naming_the_endpoint(tmp_path):
    """A hub model with HF_ENDPOINT unreachable and nothing cached: one error line naming the
    endpoint, exit 2, no traceback."""
    url = f"http://127.0.0.1:{closed_port()}"
    p = run("-m", "isojax.extract", "--model", A, "--data", write_jsonl(tmp_path / "d.jsonl"), *EXTRACT_SMALL,
            "--out", tmp_path / "out", env=hub_env(url, tmp_path))
    assert p.returncode == 2, p.stderr[-2000:]
    assert last_line(p).startswith("error:") and url in last_line(p) and "cache" in last_line(p)
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_default_model_not_on_the_hub_is_an_error_not_random_weights(hub, env, tmp_path):
    """The hub at HF_ENDPOINT answers but has no pythia-70m: the default command must not fall back
    to random weights with exit 0 (that fallback is for a machine that cannot reach any hub)."""
    p = run("-m", "isojax.extract", "--data", write_jsonl(tmp_path / "d.jsonl"), *EXTRACT_SMALL,
            "--out", tmp_path / "out", env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "RANDOM WEIGHTS" not in p.stderr
    assert last_line(p).startswith("error:") and "EleutherAI/pythia-70m" in last_line(p)
    assert "not found" in last_line(p)


@pytest.mark.slow
def test_unknown_revision_and_repo_are_named_not_unreachable(hub, env, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl")
    p = run("-m", "isojax.extract", "--model", A, "--revisions", "step0,step77", "--data", data, *EXTRACT_SMALL,
            "--out", tmp_path / "out", env=env)
    assert p.returncode == 2 and "step77" in last_line(p), p.stderr[-2000:]
    assert "main, step0, step1000" in last_line(p)  # the revisions that exist
    assert not hub.downloads()  # refused before anything was downloaded
    p = run("-m", "isojax.extract", "--model", A, "--revision", "step77", "--data", data, *EXTRACT_SMALL,
            "--out", tmp_path / "out2", env=env)
    assert p.returncode == 2 and "revision 'step77' not found" in last_line(p), p.stderr[-2000:]
    p = run("-m", "isojax.extract", "--model", "tiny-org/none", "--data", data, *EXTRACT_SMALL,
            "--out", tmp_path / "out3", env=env)
    assert p.returncode == 2 and "tiny-org/none not found" in last_line(p), p.stderr[-2000:]
    assert "unreachable" not in p.stderr and "cannot be reached" not in p.stderr


def test_model_download_takes_safetensors_only(hub, env):
    """A revision shipping model.safetensors and pytorch_model.bin (Pythia's main): one copy of
    the weights is fetched, the safetensors; a .bin-only repo gets its .bin; shards all come."""
    code = f"""
from isojax.hf.files import resolve_model
for repo, rev in [({A!r}, None), ({B!r}, "step0"), ({A!r}, "step1000")]:
    print(sorted(p.name for p in resolve_model(repo, rev).iterdir()))
"""
    p = py(code, env)
    assert p.returncode == 0, p.stderr[-2000:]
    main, b0, sharded = (eval(line) for line in p.stdout.strip().splitlines()[-3:])
    assert "model.safetensors" in main and "pytorch_model.bin" not in main and "tokenizer.json" in main
    assert "pytorch_model.bin" in b0
    assert sum(n.endswith(".safetensors") for n in sharded) == 3
    got = hub.downloads(A)
    assert not any(g.endswith("pytorch_model.bin") for g in got), got


@pytest.mark.slow
def test_weights_refuses_unknown_revision_before_measuring(hub, env, tmp_path):
    p = run("-m", "isojax.weights", "--model", A, "--revisions", "step0,step9999", "--out", tmp_path / "w",
            env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert last_line(p).startswith("error:") and "step9999" in last_line(p)
    assert not hub.downloads(), hub.downloads()  # step0 was not downloaded (nor measured)


def test_tokenizer_comes_from_the_requested_revision(hub, env, repos, tmp_path):
    """A checkpoint whose snapshot has no tokenizer.json: the tokenizer of that revision on the hub,
    never main's."""
    main = tmp_path / "c-main"
    main.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (main / f).write_bytes((repos["a"]["main"] / f).read_bytes())
    tok = json.loads((main / "tokenizer.json").read_text())
    tok["added_tokens"] = tok["added_tokens"][:1]  # main's differs from step0's
    (main / "tokenizer.json").write_text(json.dumps(tok))
    hub.add_model("tiny-org/neox-c", {"main": main, "step0": repos["a"]["step0"]})
    code = f"""
import json
from isojax.hf.family import read_hf_config
from isojax.hf.tokenizer import load_tokenizer
cfg = read_hf_config(__import__("pathlib").Path({str(main)!r}))
tok, desc = load_tokenizer(None, cfg, hub_repo="tiny-org/neox-c", hub_revision="step0")
print(json.dumps(desc))
"""
    p = py(code, env)
    assert p.returncode == 0, p.stderr[-2000:]
    desc = json.loads(p.stdout.strip().splitlines()[-1])
    assert hub.repos[("model", "tiny-org/neox-c")].branches["step0"].commit in desc


@pytest.mark.slow
def test_missing_hub_dataset_error_is_the_last_line(hub, env, tmp_path):
    p = run("-m", "isojax.extract", "--model", A, "--data", "hub:tiny-org/nope:test", *EXTRACT_SMALL,
            "--out", tmp_path / "out", env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert last_line(p).startswith("error:") and "tiny-org/nope" in last_line(p), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not hub.downloads(A)  # refused before the model was fetched


@pytest.mark.slow
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "no route"])
def test_offline_hub_data_fails_at_once(hub, env, tmp_path, offline):
    import time
    env = dict(env, HF_HUB_OFFLINE="1") if offline == "HF_HUB_OFFLINE" else \
        dict(env, HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    p = run("-m", "isojax.extract", "--model", "random:pythia-70m", "--data", f"hub:{DATA}:test",
            *EXTRACT_SMALL, "--out", tmp_path / "out", env=env)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and last_line(p) == errors[0] and DATA in errors[0], p.stderr[-2000:]
    assert "Retrying" not in p.stderr and took < 25, took


# --- the README's commands, run against the loopback hub ---------------------------------------

def paper_steps() -> list[str]:
    return ["step0", *(f"step{(i * 143 // 20) * 1000}" for i in range(1, 21))]


@pytest.mark.slow
def test_readme_paper_commands_end_to_end(hub, env, repos, tmp_path):
    """The commands of "The paper's setup" and "Sweeps" with tiny models: sizes over several
    sources, a training sweep over two models x two revisions (the hub holds step0 and step1000:
    --paper-steps is refused naming them), `weights --paper-steps` (a repo holding all 21 steps),
    report and correlate; one result folder per model and revision, per-source metrics,
    sweep.csv, report.html; one copy of the weights downloaded per checkpoint."""
    import csv
    P = "tiny-org/neox-p"
    hub.add_model(P, {r: repos["a"]["step0"] for r in ["main", *paper_steps()]})
    out = tmp_path / "out"
    data = ["--data", f"hub:{DATA}:test"]
    both = ["--model", A, "--model", B]

    p = run("-m", "isojax.extract", *both, "--paper-steps", *data, "--source", "Enron Emails", *EXTRACT_SMALL,
            "--out", out / "training", env=env)
    assert p.returncode == 2 and "step7000" in last_line(p) and "step1000" in last_line(p), p.stderr[-2000:]
    assert not hub.downloads()

    p = run("-m", "isojax.extract", *both, "--revisions", "step0,step1000", *data, "--source", "Enron Emails",
            *EXTRACT_SMALL, "--out", out / "training", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    for m in (A, B):
        for r in ("step0", "step1000"):
            metrics = json.loads((out / "training" / m.replace("/", "--") / r / "metrics.json").read_text())
            assert metrics["model"] == m and metrics["revision"] == r
            assert metrics["weights"] == ("initialization (step 0)" if r == "step0" else "trained")
    rows = list(csv.DictReader(open(out / "training" / "sweep.csv")))
    assert {(r["model"], r["revision"]) for r in rows} == {(m, s) for m in (A, B) for s in ("step0", "step1000")}
    got = hub.downloads()
    assert not any(g.endswith(".bin") for g in got if A in g)  # A's safetensors, B's .bin
    assert any(g.endswith("pytorch_model.bin") for g in got if B in g)
    assert len([g for g in got if g.endswith("model-00001-of-00003.safetensors")]) == 1  # fetched once

    p = run("-m", "isojax.extract", *both, *data, "--source", "Enron Emails", "--source", "HackerNews",
            "--source", "Github", *EXTRACT_SMALL, "--out", out / "sizes", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    for m in (A, B):
        found = list((out / "sizes").rglob("metrics.json"))
        assert found, list((out / "sizes").rglob("*"))
    assert not any(g.endswith(f"{A}/resolve/main/pytorch_model.bin".split("/", 1)[1]) for g in hub.downloads(A))
    docs = [json.loads(f.read_text()) for f in (out / "sizes").rglob("metrics.json")]
    assert {d["model"] for d in docs} == {A, B}
    assert all(set(SOURCES) <= set(json.dumps(d.get("sources") or d)) for d in docs) or \
        all(all(s in json.dumps(d) for s in SOURCES) for d in docs)

    p = run("-m", "isojax.weights", "--model", P, "--paper-steps", "--out", out / "w", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    wrows = list(csv.DictReader(open(out / "w" / "sweep.csv")))
    assert [r["revision"] for r in wrows] == paper_steps()

    with open(tmp_path / "scores.csv", "w") as f:
        f.write("model,revision,task,score\n")
        for i, r in enumerate(paper_steps()):
            f.write(f"{P},{r},sciq/acc,{0.2 + 0.03 * i + 0.01 * (i % 3)}\n")
    p = run("-m", "isojax.correlate", out / "w", "--scores", tmp_path / "scores.csv", "--metric",
            "embed_out.isotropy", "--out", tmp_path / "correlation.json", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    corr = json.loads((tmp_path / "correlation.json").read_text())
    entries = corr if isinstance(corr, list) else corr.get("entries") or corr.get("correlations") or []
    assert any(e.get("n") == 20 for e in entries), corr

    # one report per corpus: sizes (several sources) and training (Enron Emails) were measured on
    # two corpora, which report refuses to mix
    p = run("-m", "isojax.report", out / "sizes", out / "training", "--out", out / "mixed", env=env)
    assert p.returncode == 2 and "different corpora" in last_line(p), p.stderr[-2000:]
    for name, inputs in (("report", [out / "sizes", out / "w"]), ("report-training", [out / "training", out / "w"])):
        p = run("-m", "isojax.report", *inputs, "--out", out / name, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert (out / name / "report.html").stat().st_size > 10_000
        assert list((out / name / "figures").glob("*.png"))


# --- faults a download meets ---------------------------------------------------------------------

RESOLVE = """
import sys
from isojax.errors import UserError
from isojax.hf.files import CheckpointReader, resolve_model
try:
    d = resolve_model({repo!r}, {rev!r})
    r = CheckpointReader(d)
    print("OK", d, len(r.names()))
except UserError as e:
    print(f"error: {{e}}", file=sys.stderr)
    sys.exit(2)
"""


def resolve(repo, rev, env):
    return py(RESOLVE.format(repo=repo, rev=rev), env)


@pytest.mark.slow
def test_connection_dropped_mid_weight_file_is_resumed(hub, env, repos):
    hub.fail(r"/resolve/[^/]+/model\.safetensors$", drop_after=1_000_000, methods=("GET",))
    p = resolve(A, "step0", env)
    assert p.returncode == 0, p.stderr[-3000:]
    local = Path(p.stdout.split()[1])
    assert (local / "model.safetensors").read_bytes() == (repos["a"]["step0"] / "model.safetensors").read_bytes()
    gets = hub.seen(r"model\.safetensors$", "GET")
    assert len(gets) == 2  # the cut download was fetched again (resumed or whole), once


@pytest.mark.slow
def test_connection_dropped_every_time_is_a_clean_error(hub, env):
    hub.fail(r"/resolve/[^/]+/model\.safetensors$", drop_after=100_000, methods=("GET",), times=-1)
    p = resolve(A, "step0", env)
    assert p.returncode == 2 and last_line(p).startswith("error:"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    snap = list((Path(env["HF_HOME"]) / "hub").rglob("model.safetensors"))
    assert not snap  # no truncated file in the cache to be taken as a model later


@pytest.mark.slow
def test_server_errors_then_success(hub, env):
    hub.fail(r"/api/models/", status=503, times=2)
    hub.fail(r"/resolve/[^/]+/model\.safetensors$", status=502, times=1, methods=("GET",))
    p = resolve(A, "step0", env)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_server_errors_always_end_in_one_error(hub, env):
    import time
    hub.fail(r"/resolve/[^/]+/model\.safetensors$", status=503, times=-1)
    t0 = time.monotonic()
    p = resolve(A, "step0", env)
    assert p.returncode == 2 and last_line(p).startswith("error:") and "503" in p.stderr, p.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    assert len(hub.seen(r"model\.safetensors$")) <= 12  # bounded retries


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "hf_wrong"])
def test_gated_repo_says_to_log_in(hub, env, repos, token):
    hub.add_model("tiny-org/gated", {"main": repos["a"]["step0"]}, gated=True, tokens=["hf_good"])
    p = resolve("tiny-org/gated", None, dict(env, HF_TOKEN=token) if token else env)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "gated" in last_line(p) and "hf auth login" in last_line(p) and "HF_TOKEN" in last_line(p)
    assert ("403" if token else "401") in last_line(p)
    assert resolve("tiny-org/gated", None, dict(env, HF_TOKEN="hf_good")).returncode == 0


@pytest.mark.slow
def test_unreachable_hub_with_warm_cache_runs_offline(hub, env, tmp_path):
    assert resolve(A, "step1000", env).returncode == 0
    n = len(hub.requests)
    down = dict(env, HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    p = resolve(A, "step1000", down)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "cannot be reached" in p.stderr and "offline from the Hugging Face cache" in p.stderr
    p = resolve(A, "step0", down)  # not cached: an error naming the endpoint
    assert p.returncode == 2 and down["HF_ENDPOINT"] in last_line(p)
    assert len(hub.requests) == n


@pytest.mark.slow
@pytest.mark.parametrize("where", [r"/api/models/", r"/resolve/[^/]+/model\.safetensors$"])
def test_a_hub_that_stops_answering_ends_in_one_error(hub, env, where):
    """A hub that takes the connection and sends nothing, for its API (huggingface_hub sets no timeout
    there: a run hung for as long as the server waited) or a weight file (tried 6 times by
    huggingface_hub, then 3 times more by isojax): bounded by HF_HUB_DOWNLOAD_TIMEOUT, one error."""
    import time
    hub.fail(where, delay=120, times=-1, methods=("GET",))
    t0 = time.monotonic()
    p = resolve(A, "step0", dict(env, HF_HUB_DOWNLOAD_TIMEOUT="2"))
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [last_line(p)] and "sent nothing" in errors[0] and "HF_HUB_DOWNLOAD_TIMEOUT" in errors[0]
    assert ("model.safetensors" if "resolve" in where else "its API") in errors[0]
    assert "Traceback" not in p.stderr
    assert took < 60, took  # 3 tries of 2 s per API call; 6 of 2 s for the file (untouched: 3 x 6 x 2 s and more)


# --- sweeps over the hub as over local folders (issue 29) ------------------------------------------

def commit(hub, repo, revision) -> str:
    return hub.repos[("model", repo)].branches[revision].commit


def weight_gets(requests, hub, repo, revision) -> list:
    """GETs of a revision's weight files (downloads ask for them by the revision's commit)."""
    c = commit(hub, repo, revision)
    return [r for r in requests if r[0] == "GET" and f"/resolve/{c}/" in r[1] and r[1].endswith((".safetensors", ".bin"))]


@pytest.mark.slow
def test_sweep_downloads_the_next_checkpoint_while_measuring_one(hub, env, tmp_path):
    """The next revision's weights are asked for before the current one's have even arrived (the
    server holds step0's file 5 s): a weights sweep fetched its revisions one after the other."""
    hub.fail(rf"/resolve/{commit(hub, A, 'step0')}/model\.safetensors$", delay=5, methods=("GET",))
    p = run("-m", "isojax.weights", "--model", A, "--revisions", "step0,step1000", "--no-plots",
            "--out", tmp_path / "w", env=dict(env, HF_HUB_DOWNLOAD_TIMEOUT="30"))
    assert p.returncode == 0, p.stderr[-3000:]
    current, following = weight_gets(hub.requests, hub, A, "step0"), weight_gets(hub.requests, hub, A, "step1000")
    assert len(current) == 1 and following, hub.requests
    assert min(r[4] for r in following) < current[0][2]  # asked (arrival) before step0's file was sent


@pytest.mark.slow
def test_resumed_sweep_downloads_nothing_for_finished_steps(hub, env, tmp_path):
    """A sweep killed with step1000 done and step0 not: --resume measures step0 (downloading it into
    an empty cache) and never asks for step1000's weights, not even to prefetch them."""
    out = tmp_path / "out"
    args = ["-m", "isojax.extract", "--model", A, "--revisions", "step0,step1000", "--data",
            write_jsonl(tmp_path / "d.jsonl"), *EXTRACT_SMALL, "--out", out]
    p = run(*args, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    import shutil
    shutil.rmtree(out / "tiny-org--neox-a" / "step0")  # as if killed before step0's results were in
    fresh = hub_env(hub.url, tmp_path / "fresh", ISOJAX_CACHE=env["ISOJAX_CACHE"])  # an empty Hugging Face cache
    n = len(hub.requests)
    p = run(*args, "--resume", env=fresh)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("done earlier") == 1 and (out / "tiny-org--neox-a" / "step0" / "metrics.json").exists()
    assert weight_gets(hub.requests[n:], hub, A, "step0")
    assert not weight_gets(hub.requests[n:], hub, A, "step1000"), hub.requests[n:]


@pytest.mark.slow
def test_one_name_and_one_layout_for_a_checkpoint(hub, env, repos, tmp_path):
    """A local folder of revisions and the hub repository, through extract and weights sweeps: the
    same OUT/<model>/<revision>/ folders, the same (model, revision) in every output (a local
    revision folder given alone too), and report and correlate match them with their scores."""
    import csv
    local = tmp_path / "tiny-neox"
    local.mkdir()
    revisions = ["step0", "step1000", "main"]
    for r in revisions:
        (local / r).symlink_to(repos["a"][r], target_is_directory=True)
    x, w = tmp_path / "x", tmp_path / "w"
    p = run("-m", "isojax.extract", "--model", local, "--model", A, "--revisions", ",".join(revisions), "--data",
            write_jsonl(tmp_path / "d.jsonl"), *EXTRACT_SMALL, "--out", x, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    for model, name in ((local, "local"), (A, "hub")):
        p = run("-m", "isojax.weights", "--model", model, "--revisions", ",".join(revisions), "--no-plots",
                "--out", w / name, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
    p = run("-m", "isojax.weights", "--model", local / "step1000", "--no-plots", "--out", tmp_path / "w1", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    one = json.loads((tmp_path / "w1" / "weights.json").read_text())
    assert (one["model"], one["revision"]) == ("tiny-neox", "step1000")

    names = {(m, r) for m in ("tiny-neox", A) for r in revisions}
    folders = {(m.replace("/", "--"), r) for m, r in names}
    extract = {f.parent.relative_to(x).parts: json.loads(f.read_text()) for f in x.rglob("metrics.json")}
    weights = {f.parent.relative_to(w / n).parts: json.loads(f.read_text())
               for n in ("local", "hub") for f in (w / n).rglob("weights.json")}
    assert set(extract) == set(weights) == folders
    for folder, doc in extract.items():
        assert (doc["model"], doc["revision"]) == (weights[folder]["model"], weights[folder]["revision"])
    assert {(d["model"], d["revision"]) for d in extract.values()} == names
    rows = list(csv.DictReader(open(x / "sweep.csv"))) + [
        r for n in ("local", "hub") for r in csv.DictReader(open(w / n / "sweep.csv"))]
    assert {(r["model"], r["revision"]) for r in rows} == names

    with open(tmp_path / "scores.csv", "w") as f:
        f.write("model,revision,task,score\n")
        for i, (m, r) in enumerate(sorted(names)):
            f.write(f"{m},{r},sciq/acc,{0.3 + 0.1 * i}\n")
    p = run("-m", "isojax.correlate", x, w, "--scores", tmp_path / "scores.csv", "--include-step0",
            "--out", tmp_path / "correlation.json", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    entries = json.loads((tmp_path / "correlation.json").read_text())
    assert {pt["model"] for e in entries for pt in e["points"]} == {"tiny-neox", A}
    assert all(e["n"] == 3 for e in entries)
    p = run("-m", "isojax.report", x, w, "--scores", tmp_path / "scores.csv", "--include-step0",
            "--out", tmp_path / "report", env=env)
    assert p.returncode == 0, p.stderr[-3000:]


def cached(repo: str, env) -> set:
    """Files and symlinks of a repository in the Hugging Face cache, relative to its folder."""
    folder = Path(env["HF_HOME"]) / "hub" / f"models--{repo.replace('/', '--')}"
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_symlink() or p.is_file()}


@pytest.mark.slow
def test_delete_downloads_removes_only_what_the_sweep_downloaded(hub, env, tmp_path):
    """--delete-downloads: a revision cached before the run stays whole; the files the sweep
    downloaded (blobs and snapshot links) are gone once their revision is measured, while the
    revision after it, sharing its config and tokenizer blobs, still measures; --resume then
    downloads nothing for the finished revisions."""
    assert py(f"from isojax.hf.files import resolve_model; resolve_model({A!r}, 'step0')", env).returncode == 0
    before = cached(A, env)
    assert any(p.parts[0] == "blobs" for p in before)
    p = run("-m", "isojax.weights", "--model", A, "--revisions", "step0,step1000,main", "--delete-downloads",
            "--no-plots", "--out", tmp_path / "wa", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list((tmp_path / "wa").rglob("weights.json"))) == 3
    assert weight_gets(hub.requests, hub, A, "step1000") and weight_gets(hub.requests, hub, A, "main")
    after = cached(A, env)
    assert before <= after and all((Path(env["HF_HOME"]) / "hub" / f"models--{A.replace('/', '--')}" / q).exists()
                                   for q in before)  # links of step0 still reach their blobs
    assert {q.parts[0] for q in after - before} <= {"refs"}, after - before  # refs/step1000, refs/main: a few bytes

    b = ["--model", B, "--revisions", "step1000,main", "--tensor", "gpt_neox.embed_in.weight", "--no-plots"]  # .bin
    p = run("-m", "isojax.weights", *b, "--delete-downloads", "--out", tmp_path / "wb", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list((tmp_path / "wb").rglob("weights.json"))) == 2
    assert {q.parts[0] for q in cached(B, env)} <= {"refs"}, cached(B, env)
    n = len(hub.requests)
    p = run("-m", "isojax.weights", *b, "--resume", "--out", tmp_path / "wb", env=env)
    assert p.returncode == 0 and p.stderr.count("done earlier") == 2, p.stderr[-3000:]
    assert not [r for r in hub.requests[n:] if "/resolve/" in r[1]], hub.requests[n:]
