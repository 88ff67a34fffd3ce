"""README's pod recipe ("A TPU v5p slice from queued resources"), each step that runs without a TPU
run here: the wheel of the install step (installed without its dependencies, and run from there,
not from the repository), the dry run for the slice, and the run and its resume after a
preemption: README's own extract commands, with the model, bucket, checkpoint interval and batch
shrunk, in 4 processes of one CPU device each joined by `--distributed` (SLURM's variables stand
in for the TPU VM's metadata), against fake-gcs-server on 127.0.0.1 (conftest.gcs_server)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from conftest import build_hf_checkpoint
from isojax import storage
from isojax.device import checkpoints as checkpointing
from isojax.run import outdir
from test_dry_run import dry_args
from test_host_shares import _free_slurm_port, write_corpus
from test_parallel import _assert_same

REPO = Path(__file__).resolve().parents[1]
PROCESSES = 4  # the hosts of a v5p-32
SMALL = ["--unit", "document", "--seq-len", "64", "--batch-tokens", "128", "--no-plots", "--no-sample"]


def recipe() -> list[str]:
    """The commands of README's pod recipe, continuation lines joined, comments left out."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- pod-recipe -->\n```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()
            and not line.lstrip().startswith("#")]


def extract_args(line: str) -> list[str]:
    """The arguments of `python -m isojax.extract` in a recipe line (or in its ssh --command)."""
    words = shlex.split(line)
    if "--command" in words:
        words = shlex.split(words[words.index("--command") + 1])
    return words[words.index("isojax.extract") + 1:]


def shrunk(args: list[str], model: Path, bucket: str, every: int) -> list[str]:
    """args with this test's model, bucket and checkpoint interval, and a small batch."""
    out = [a.replace("gs://BUCKET/", f"gs://{bucket}/") for a in args]
    out[out.index("--model") + 1] = str(model)
    if "--checkpoint-every-tokens" in out:
        out[out.index("--checkpoint-every-tokens") + 1] = str(every)
    return out + SMALL


def test_a_process_keeps_its_part_of_every_step_after_the_last_whole_one(bucket, monkeypatch):
    """Three processes; the third still uploads its part of step 2 when the second has written step 3:
    the second keeps its part of step 1, the newest step every process has written, so a preemption
    then resumes from step 1 (keeping only its own newest two steps, it left no whole step). Once
    the later steps are whole, a process that writes a step removes its parts of the older ones."""
    directory = f"gs://{bucket}/run/checkpoint"
    monkeypatch.setattr(checkpointing.jax, "process_count", lambda: 3)
    monkeypatch.setattr(checkpointing.mesh, "exchange", lambda name, value: [value] * 3)  # no peers to wait for
    tree = {"x": jnp.arange(4.0)}

    def write(process: int, *steps: int) -> None:
        monkeypatch.setattr(checkpointing, "_process_dir", lambda: f"process_{process}")
        saver = checkpointing.Checkpointer(directory)
        for step in steps:
            saver.save(step, tree, {"step": step})
        saver.close()

    for process in range(3):
        write(process, 1)
    write(0, 2)
    write(1, 2, 3)
    assert checkpointing.complete_steps(directory) == [1]  # as process 1 sees it
    monkeypatch.setattr(checkpointing, "_process_dir", lambda: "process_0")
    assert checkpointing.complete_steps(directory) == [1]
    write(2, 2, 3)
    write(0, 3)
    assert checkpointing.complete_steps(directory) == [3, 2]
    mine = {rel.split("/")[0] for rel in storage.listing(directory) if rel.split("/")[1] == "process_0"}
    assert mine == {"2", "3"}  # the others' parts of step 1 go at their next checkpoint


def test_a_dry_run_writes_its_plan_to_gcs(bucket, tmp_path, monkeypatch):
    """--dry-run --out gs://...: plan.json is an object in the bucket, recorded as a result (it went
    to a local folder named "gs:" under the working directory)."""
    from isojax.run.dry_run import dry_run
    monkeypatch.chdir(tmp_path)
    out = f"gs://{bucket}/plans/70m"
    dry_run(dry_args("--target", "tpu-v5p-8", "--model", "random:pythia-70m", "--seq-len", "128", out=out))
    planned = json.loads(storage.read_bytes(storage.path(out) / "plan.json"))
    assert planned["target"] == "tpu-v5p-8" and planned["devices"] == 4
    outdir.check_results(out, reads=("plan.json",))
    assert list(tmp_path.iterdir()) == []


def _wheel_site(tmp_path: Path, line: str) -> Path:
    """The install step: README's `pip wheel` in a copy of the repository's tracked files, the wheel
    installed (without its dependencies, offline) into a folder of its own; that folder."""
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in tracked:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    words = shlex.split(line)
    assert words[:2] == ["pip", "wheel"], line
    build = subprocess.run([sys.executable, "-m", "pip", *words[1:], "--no-build-isolation", "-q"], cwd=src,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = list((src / "dist").glob("isojax-*.whl"))
    assert [w.name for w in wheels] == ["isojax-0.1.0-py3-none-any.whl"], wheels  # the name the recipe copies
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheels[0])], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return site


def _env(tmp_path: Path, site: Path, gcs_server: str, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GOOGLE_APPLICATION"))}
    return {**env, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "STORAGE_EMULATOR_HOST": gcs_server,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "ISOJAX_CACHE": str(tmp_path / f"cache-{name}")}


def _extract(args, env, log: Path) -> subprocess.Popen:
    """extract in the background, its stderr in log (not a pipe, which nobody reads while it runs)."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "isojax.extract", *map(str, args)], env=env, cwd=log.parent,
                                stdout=subprocess.DEVNULL, stderr=err)
    proc.log = log
    return proc


def _wait(procs, timeout: float = 300) -> list[str]:
    """Their stderr, once every process has ended (killed past timeout)."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.log.read_text() for p in procs]


def _pod(args, tmp_path, site, gcs_server, what: str, **extra_env) -> list[subprocess.Popen]:
    """PROCESSES processes of args, each a host with its own cache, `--distributed` from SLURM's variables."""
    port = _free_slurm_port()
    return [_extract(args, {**_env(tmp_path, site, gcs_server, f"host{p}"), **extra_env,
                            "SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "localhost",
                            "SLURM_NTASKS": str(PROCESSES), "SLURM_PROCID": str(p), "SLURM_LOCALID": str(p),
                            "SLURM_STEP_NUM_NODES": "1"}, tmp_path / f"{what}{p}.err") for p in range(PROCESSES)]


def _whole_steps(checkpoint: storage.GsPath) -> dict[str, set[str]]:
    """{step: the process parts with their meta.json} under a gs:// checkpoint folder."""
    parts: dict = {}
    for rel in storage.listing(checkpoint):
        step, part, name = rel.split("/")
        if name == "meta.json":
            parts.setdefault(step, set()).add(part)
    return parts


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_pod_recipe_runs_on_cpu_and_resumes_after_a_preemption(bucket, gcs_server, tmp_path):
    """Install (the wheel), plan (--dry-run --target tpu-v5p-32, lowered for TPU), run on 4 processes
    with gs:// data and output, SIGTERM to every process: each checkpoints at the step they agree on,
    every process's part on gs://, and exits 143; then README's resume command: process 0 alone
    commits the results, no checkpoint is left, and the metrics equal one local process's."""
    lines = recipe()
    plan, run, resume = (extract_args(line) for line in lines if "isojax.extract" in line)
    assert "--dry-run" in plan and plan[plan.index("--target") + 1] == "tpu-v5p-32"
    assert "--distributed" in run and resume == [*run, "--resume"]
    assert {run[run.index(flag) + 1][:12] for flag in ("--data", "--out")} == {"gs://BUCKET/"}
    site = _wheel_site(tmp_path, next(line for line in lines if line.startswith("pip wheel")))
    assert not (site / "tests").exists() and (site / "isojax" / "hf" / "family").is_dir()

    build_hf_checkpoint(tmp_path / "model", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_corpus(tmp_path / "pile")  # step 2: the corpus into the bucket
    storage._fs().put(str(tmp_path / "pile"), f"{bucket}/pile", recursive=True)
    assert len(storage.listing(f"gs://{bucket}/pile")) == 7
    # one local process (the reference) beside the dry run (step 1)
    one = _extract(["--model", tmp_path / "model", "--data", tmp_path / "pile", "--out", tmp_path / "local", *SMALL],
                   _env(tmp_path, site, gcs_server, "local"), tmp_path / "local.err")
    dry = _extract(shrunk(plan, tmp_path / "model", bucket, 0), _env(tmp_path, site, gcs_server, "plan"),
                   tmp_path / "plan.err")
    errs = _wait([one, dry])
    assert [one.returncode, dry.returncode] == [0, 0], [err[-3000:] for err in errs]
    assert "the step was lowered for TPU" in errs[1], errs[1][-3000:]
    planned = json.loads((tmp_path / "plans" / "1.4b" / "plan.json").read_text())
    assert planned["target"] == "tpu-v5p-32" and planned["devices"] == 16, planned
    assert planned["lowered"]["platform"] == "tpu", planned["lowered"]

    out = storage.path(f"gs://{bucket}/runs/1.4b")
    # the preemption: every process gets SIGTERM once it has handed its first checkpoint to its writer
    # and waits there until JAX's preemption service of every process has taken its step (faults.py):
    # they agree on the next step, where each checkpoints, however fast the run would end
    cut = _pod(shrunk(run, tmp_path / "model", bucket, 300), tmp_path, site, gcs_server, "run",
               ISOJAX_FAULT="checkpoint_saved:sigterm")
    errs = _wait(cut)
    assert [p.returncode for p in cut] == [143] * PROCESSES, [err[-2000:] for err in errs]
    stopped = re.search(r"stopped by SIGTERM after ([\d,]+) tokens", errs[0])
    assert stopped, errs[0][-3000:]
    at_kill = _whole_steps(out / "checkpoint")
    assert "metrics.json" not in storage.listing(out)
    steps = sorted(map(int, at_kill))  # the first checkpoint's step and the one after it, agreed on
    assert len(steps) == 2 and steps[1] == steps[0] + 1, at_kill
    agreed = steps[1]
    assert at_kill[str(agreed)] == {f"process_{p}" for p in range(PROCESSES)}, at_kill
    meta = json.loads(storage.read_bytes(out / "checkpoint" / str(agreed) / "process_0" / "meta.json"))
    assert f"{meta['meta']['done']['tokens']:,}" == stopped[1], (meta["meta"]["done"], stopped[1])

    again = _pod(shrunk(resume, tmp_path / "model", bucket, 300), tmp_path, site, gcs_server, "resume")
    errs = _wait(again)
    assert [p.returncode for p in again] == [0] * PROCESSES, [err[-2000:] for err in errs]
    assert f"resuming after {stopped[1]} tokens" in errs[0], errs[0][-3000:]  # from the step they agreed on
    objects = storage.listing(out)
    record = json.loads(storage.read_bytes(out / ".isojax-results.json"))
    assert sorted(record["files"]) == sorted(set(objects) - {".isojax-results.json"}), objects  # no checkpoint left
    outdir.check_results(out, reads=("metrics.json", "manifest.json"))
    got = json.loads(storage.read_bytes(out / "metrics.json"))
    _assert_same(json.loads((tmp_path / "local" / "metrics.json").read_text()), got, "the pod recipe on 4 processes")
    manifest = json.loads(storage.read_bytes(out / "manifest.json"))
    assert len(manifest["host_shares"]) == PROCESSES and all(s["tokens"] for s in manifest["host_shares"])
