"""Results, checkpoints and corpora on Google Cloud Storage (gs://), against fake-gcs-server (a GCS
emulator) on 127.0.0.1: the commit rule without renames (isojax.run.remote_out), checkpoints that
resume a killed run from gs://, --data gs://, credentials that never reach the outputs, and bad
input refused in one line before anything is measured."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import _free_port, build_hf_checkpoint
from isojax import storage
from isojax.device import checkpoints as checkpointing
from isojax.errors import UserError
from isojax.run import outdir

REPO = Path(__file__).resolve().parents[1]
SECRET = "ya29.SECRET-ACCESS-TOKEN-4f2c"  # what the test's token endpoint hands out


def test_results_commit_without_renames(bucket):
    """The record is written last and lists every object; a user's object stays (also with
    overwrite); overwrite replaces and deletes only recorded objects; readers refuse a folder whose
    objects differ from its record, or whose commit was cut short (its journal)."""
    out = storage.path(f"gs://{bucket}/run")
    storage.write_bytes(out / "mine.txt", b"the user's")
    storage.write_bytes(out / "plots" / "mine.png", b"the user's too")
    with outdir.claim(out, overwrite=False, names={"metrics.json", "layers.csv"}):
        with outdir.staged(out) as stage:
            (stage / "metrics.json").write_text('{"tokens": 1}')
            (stage / "layers.csv").write_text("name\n")
    record = json.loads(storage.read_bytes(out / ".isojax-results.json"))
    assert sorted(record["files"]) == ["layers.csv", "metrics.json"]
    assert record["files"]["metrics.json"][0] == len('{"tokens": 1}')
    outdir.check_results(out, reads=("metrics.json",))
    with pytest.raises(UserError, match="already holds results"):
        with outdir.claim(out, overwrite=False, names={"metrics.json"}):
            pass
    with pytest.raises(UserError, match="isojax did not write it"):  # plots/ holds a user's object
        with outdir.claim(out, overwrite=True, names={"metrics.json", "plots"}):
            pass
    with outdir.claim(out, overwrite=True, names={"metrics.json"}):
        with outdir.staged(out) as stage:
            (stage / "metrics.json").write_text('{"tokens": 2}')
    assert sorted(storage.listing(out)) == [".isojax-results.json", "metrics.json", "mine.txt", "plots/mine.png"]
    assert json.loads(storage.read_bytes(out / "metrics.json")) == {"tokens": 2}
    outdir.check_results(out, reads=("metrics.json",))
    storage.write_bytes(out / "metrics.json", b'{"tokens": 3}')  # same size, other bytes
    outdir.check_results(out)  # sizes only
    with pytest.raises(UserError, match="differs from what isojax wrote"):
        outdir.check_results(out, reads=("metrics.json",))
    storage.write_bytes(out / ".isojax-commit.json", json.dumps({"new": ["extra.csv"]}))  # a commit cut short
    storage.write_bytes(out / "extra.csv", b"half")
    with pytest.raises(UserError, match="incomplete"):
        outdir.check_results(out)
    with outdir.claim(out, overwrite=True, names={"metrics.json"}):  # the journal's objects are isojax's
        with outdir.staged(out) as stage:
            (stage / "metrics.json").write_text('{"tokens": 4}')
    assert sorted(storage.listing(out)) == [".isojax-results.json", "metrics.json", "mine.txt", "plots/mine.png"]
    outdir.check_results(out, reads=("metrics.json",))


def test_checkpoints_round_trip_on_gcs(bucket):
    """Checkpoints under gs:// read back bit for bit; the last two steps stay; a step whose meta.json
    is missing (a kill mid-upload) does not count; clear refuses objects isojax did not write;
    remove leaves them."""
    directory = f"gs://{bucket}/run/checkpoint"
    trees = {s: {"x": jnp.arange(12.0).reshape(3, 4) * s, "n": jnp.full((5,), s, jnp.int32)} for s in (1, 2, 3)}
    saver = checkpointing.Checkpointer(directory)
    for step, tree in trees.items():
        saver.save(step, tree, {"step": step})
    saver.close()
    assert sorted({rel.split("/")[0] for rel in storage.listing(directory)}) == ["2", "3"]
    assert checkpointing.latest(directory) == (3, {"step": 3})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trees[3])
    got = checkpointing.load(directory, 3, abstract)
    for a, b in zip(jax.tree.leaves(trees[3]), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    storage.delete(storage.path(directory), ["3/process_0/meta.json"])
    assert checkpointing.complete_steps(directory) == [2]
    storage.write_bytes(storage.path(directory) / "notes.txt", b"mine")
    with pytest.raises(UserError, match="notes.txt"):
        checkpointing.clear(directory)
    checkpointing.remove(directory)
    assert list(storage.listing(directory)) == ["notes.txt"]


class _TokenEndpoint(http.server.BaseHTTPRequestHandler):
    """Google's OAuth token endpoint for the test's service account: hands out SECRET."""
    calls = 0

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).calls += 1
        body = json.dumps({"access_token": SECRET, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _service_account(path: Path, token_uri: str) -> str:
    """A service account's key file (a new RSA key) whose token endpoint is token_uri; returns a line
    of its private key, a secret to look for."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({"type": "service_account", "project_id": "isojax-test", "private_key_id": "k1",
                                "private_key": pem, "client_email": "runner@isojax-test.iam.gserviceaccount.com",
                                "client_id": "1", "token_uri": token_uri}))
    return pem.splitlines()[5]


def _extract(*args, env, **kw):
    return subprocess.run([sys.executable, "-m", "isojax.extract", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **env}, timeout=600, **kw)


def _corpus(path: Path) -> None:
    rng = np.random.default_rng(7)
    words = ["time", "river", "stone", "light", "paper", "north", "music", "glass", "field", "number", "sound"]
    with open(path, "w") as f:
        for _ in range(60):
            text = ". ".join(" ".join(rng.choice(words, rng.integers(4, 12))) for _ in range(rng.integers(2, 5)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")


def test_run_killed_and_resumed_on_gcs_equals_a_local_run(bucket, gcs_server, tmp_path):
    """--data and --out on gs://, credentials from GOOGLE_APPLICATION_CREDENTIALS (a service
    account whose token endpoint is the test's): killed by SIGKILL after its first checkpoint, resumed
    from the checkpoint on gs://, its metrics equal a local run's; the record lists every result
    object; no credential appears in any object or in the logs."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        key_line = _service_account(tmp_path / "key.json", f"http://127.0.0.1:{server.server_address[1]}/token")
        build_hf_checkpoint(tmp_path / "model", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
        _corpus(tmp_path / "corpus.jsonl")
        storage._fs().put_file(str(tmp_path / "corpus.jsonl"), f"{bucket}/data/corpus.jsonl")
        common = ["--model", tmp_path / "model", "--unit", "document", "--seq-len", "64", "--batch-tokens", "128",
                  "--no-plots", "--no-sample", "--checkpoint-every-tokens", "300"]
        env = {"ISOJAX_CACHE": str(tmp_path / "cache"), "STORAGE_EMULATOR_HOST": gcs_server,
               "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "key.json")}
        local = _extract(*common, "--data", tmp_path / "corpus.jsonl", "--out", tmp_path / "local", env=env)
        assert local.returncode == 0, local.stderr[-3000:]
        out = f"gs://{bucket}/runs/one"
        remote = [*common, "--data", f"gs://{bucket}/data/corpus.jsonl", "--out", out]
        cut = _extract(*remote, env={**env, "ISOJAX_FAULT": "checkpoint_written:1"})
        assert cut.returncode == -9, cut.stderr[-3000:]
        objects = storage.listing(out)
        assert any(rel.startswith("checkpoint/") and rel.endswith("/meta.json") for rel in objects), objects
        assert "metrics.json" not in objects
        again = _extract(*remote, "--resume", env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming after" in again.stderr, again.stderr[-3000:]
        assert "on this host); taken over" in again.stderr  # the killed run's lock
        assert _TokenEndpoint.calls > 0  # the credentials were used, not anonymous requests
    finally:
        server.shutdown()
    objects = storage.listing(out)
    record = json.loads(storage.read_bytes(storage.path(out) / ".isojax-results.json"))
    assert sorted(record["files"]) == sorted(set(objects) - {".isojax-results.json"})  # no checkpoint left
    assert all(objects[rel] == size for rel, (size, _) in record["files"].items())
    outdir.check_results(out, reads=("metrics.json",))
    got = json.loads(storage.read_bytes(storage.path(out) / "metrics.json"))
    want = json.loads((tmp_path / "local" / "metrics.json").read_text())
    assert got["tokens"] == want["tokens"] > 600 and got["sequences"] == want["sequences"]
    for a, b in zip(got["layers"], want["layers"], strict=True):
        assert a["count"] == b["count"]
        for key in ("inter_sim", "intra_sim", "anisotropy", "mean_norm"):
            assert abs(a[key] - b[key]) <= 1e-12 * max(1.0, abs(b[key])), key
    for secret in (SECRET, key_line):
        for proc in (cut, again):
            assert secret not in proc.stdout + proc.stderr
        for rel in objects:
            assert secret.encode() not in storage.read_bytes(storage.path(out) / rel), rel


def test_bad_gcs_paths_are_one_error_line_before_any_work(bucket, gcs_server, tmp_path):
    """A missing bucket (for --out and for --data), credentials that cannot be found and credentials
    whose token endpoint refuses: one `error:` line, before the model is loaded, and nothing written."""
    _service_account(tmp_path / "key.json", f"http://127.0.0.1:{_free_port()}/token")  # nothing listens there
    env = {"ISOJAX_CACHE": str(tmp_path / "cache"), "STORAGE_EMULATOR_HOST": gcs_server}
    args = ["--model", "random:pythia-70m", "--no-plots"]
    cases = {
        "missing bucket, --out": ([*args, "--out", "gs://no-such-bucket/run"], {}, "no bucket 'no-such-bucket'"),
        "missing bucket, --data": ([*args, "--data", "gs://no-such-bucket/corpus.jsonl", "--out", tmp_path / "o"],
                                   {}, "no bucket 'no-such-bucket'"),
        "no credentials": ([*args, "--out", f"gs://{bucket}/run"],
                           {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json")}, "no Google credentials"),
        "credentials refused": ([*args, "--out", f"gs://{bucket}/run"],
                                {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "key.json")}, "credentials refused"),
    }
    for what, (argv, extra, message) in cases.items():
        proc = _extract(*argv, env={**env, **extra})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (what, proc.stderr[-2000:])
        assert lines[-1].startswith("error:") and message in lines[-1], (what, lines[-1])
        assert "model random:pythia-70m" not in proc.stderr, what  # refused before the model loaded
    assert storage.listing(f"gs://{bucket}/run") == {}
    assert not (tmp_path / "o").exists()


def test_commands_without_gcs_support_refuse_it_in_one_line(tmp_path, capsys):
    """report, correlate, weights and sweeps write local folders only: gs:// is one `error:` line."""
    from isojax import extract
    from isojax.report import build, correlate
    from isojax.weights import command
    calls = {"report": (build.main, ["gs://b/runs", "--out", tmp_path / "r"]),
             "correlate": (correlate.main, [tmp_path, "--scores", "gs://b/scores.csv", "--out", tmp_path / "c.json"]),
             "weights": (command.main, ["--model", "random:pythia-70m", "--out", "gs://b/w"]),
             "a sweep": (extract.main, ["--model", "random:pythia-70m", "--revisions", "step0,step1",
                                        "--out", "gs://b/sweep"])}
    for what, (main, argv) in calls.items():
        assert main(list(map(str, argv))) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error:") and "gs://" in err[-1], (what, err[-3:])
    assert list(tmp_path.iterdir()) == []


_HOLD = ("import sys\nfrom isojax.run import outdir\n"
         "with outdir.claim(sys.argv[1], overwrite=True, names={'metrics.json'}):\n"
         "    with outdir.staged(sys.argv[1]) as stage:\n"
         "        (stage / 'metrics.json').write_text(sys.argv[2])\n"
         "    print('ready', flush=True)\n    sys.stdin.readline()\n")


def _holder(url: str, text: str, env: dict) -> subprocess.Popen:
    """A run (another process) that writes metrics.json = text into url and holds url until told."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, url, text], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
    return proc


def _snapshot(url: str) -> dict:
    return {rel: storage.read_bytes(storage.path(url) / rel) for rel in storage.listing(url)}


def test_a_gs_out_is_locked_while_a_run_writes_there(bucket, gcs_server, tmp_path, monkeypatch):
    """A run holds OUT/.isojax.lock (created only where none is) with its pid, host and start time,
    no credential: a second run into the same gs:// --out is one `error:` line naming the first and
    how to delete a lock its dead holder left, before the model loads, and the first's results stay
    as they were; once the first ends (its lock deleted) a run proceeds; a lock left by a process
    killed on this host is taken over; one from another host is refused until it is deleted."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = f"gs://{bucket}/run"
    lock = storage.path(out) / ".isojax.lock"
    try:
        key_line = _service_account(tmp_path / "key.json", f"http://127.0.0.1:{server.server_address[1]}/token")
        env = {"STORAGE_EMULATOR_HOST": gcs_server, "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "key.json"),
               "ISOJAX_CACHE": str(tmp_path / "cache")}
        first = _holder(out, '{"tokens": 1}', env)
        try:
            held = storage.read_bytes(lock)
            assert sorted(json.loads(held)) == ["host", "pid", "since", "token"]
            assert json.loads(held)["pid"] == first.pid
            assert SECRET.encode() not in held and key_line.encode() not in held and b"BEGIN" not in held
            before = _snapshot(out)
            second = _extract("--model", "random:pythia-70m", "--no-plots", "--out", out, "--overwrite", env=env)
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
            assert lines[-1].startswith(f"error: --out {out} is in use by another isojax run (pid {first.pid} on "), \
                lines[-1]
            assert f"gcloud storage rm {lock}" in lines[-1], lines[-1]
            assert "model random:pythia-70m" not in second.stderr  # refused before the model loaded
            assert _snapshot(out) == before  # the first's results and its lock, as they were
            first.communicate("go\n", timeout=120)
            assert first.returncode == 0
            assert _TokenEndpoint.calls > 0  # the holder used the service account's credentials
        finally:
            first.kill()
            first.wait()
    finally:
        server.shutdown()
    assert not lock.exists()  # deleted at the end
    assert json.loads(storage.read_bytes(storage.path(out) / "metrics.json")) == {"tokens": 1}
    env = {"STORAGE_EMULATOR_HOST": gcs_server}
    with outdir.claim(out, overwrite=True, names={"metrics.json"}):  # released: proceeds
        with outdir.claim(out, overwrite=True, names={"metrics.json"}):  # the same process again (extract, then save)
            with outdir.staged(out) as stage:
                (stage / "metrics.json").write_text('{"tokens": 2}')
        assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
    assert not lock.exists()
    killed = _holder(out, '{"tokens": 3}', env)
    killed.kill()  # SIGKILL: its lock stays
    killed.wait()
    assert json.loads(storage.read_bytes(lock))["pid"] == killed.pid
    logged = []
    monkeypatch.setattr("isojax.run.remote_out.log", logged.append)
    with outdir.claim(out, overwrite=True, names={"metrics.json"}):
        assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
    assert any(f"pid {killed.pid} on this host); taken over" in line for line in logged), logged
    storage.write_bytes(lock, json.dumps({"pid": 4242, "host": "elsewhere", "since": "2026-01-01 00:00:00 UTC"}))
    with pytest.raises(outdir.Busy, match=rf"pid 4242 on elsewhere, since 2026-01-01 00:00:00 UTC\).*"
                                           rf"gcloud storage rm {lock}"):
        with outdir.claim(out, overwrite=True, names={"metrics.json"}):
            pass
    storage.delete(out, [".isojax.lock"])  # what `gcloud storage rm` does
    with outdir.claim(out, overwrite=True, names={"metrics.json"}):
        pass
    assert json.loads(storage.read_bytes(storage.path(out) / "metrics.json")) == {"tokens": 3}
    assert sorted(storage.listing(out)) == [".isojax-results.json", "metrics.json"]


def test_a_run_told_to_wait_takes_a_gs_lock_once_it_is_deleted(bucket, monkeypatch):
    """With wait (a sweep's claim of OUT), a lock held elsewhere is waited for, not refused: the
    waiting run proceeds once the lock is gone, and holds it then."""
    from isojax.run import remote_out
    out = storage.path(f"gs://{bucket}/run")
    lock = out / ".isojax.lock"
    storage.write_bytes(lock, json.dumps({"pid": 4242, "host": "elsewhere"}))
    waiting, got = threading.Event(), []
    monkeypatch.setattr(remote_out, "POLL_S", 0.05)
    monkeypatch.setattr(remote_out, "log", lambda m: waiting.set() if "waiting for another isojax run" in m else None)

    def run():
        with outdir.claim(out, overwrite=True, wait=True):
            got.append(json.loads(storage.read_bytes(lock)))
    thread = threading.Thread(target=run)
    thread.start()
    assert waiting.wait(120)
    assert not got
    storage.delete(out, [".isojax.lock"])
    thread.join(120)
    assert got and got[0]["pid"] == os.getpid() and got[0]["host"] != "elsewhere"
    assert not lock.exists()
