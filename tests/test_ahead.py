"""The step compiled ahead of the weights (device/ahead.py, run/plan.py): the same accumulators as
the step compiled at its first batch, once per shape in a sweep, and its errors raised as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import build_hf_checkpoint
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ahead_equals_lazy_on_one_and_two_devices_in_float32_and_bfloat16(tmp_path):
    """A Runner running the executable compiled from shapes alone (hf.loading.abstract_params, the
    Layout) ends with the accumulators, bit for bit, of one whose step compiles at its first batch."""
    script = textwrap.dedent("""
        import dataclasses, jax, numpy as np
        from isojax.device import ahead
        from isojax.device import mesh as parallel
        from isojax.device.runner import Layout
        from isojax.hf.loading import abstract_params, build_module, random_params
        from isojax.hf.family.presets import preset
        from isojax.run.plan import step_module
        from isojax.device.runner import Runner
        cfg = dataclasses.replace(preset("pythia-70m"), hidden_size=32, intermediate_size=64, num_layers=2,
                                  num_heads=2, vocab_size=96)
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, 96, (4, 16)).astype(np.int32) for _ in range(3)]
        for dtype in ("float32", "bfloat16"):
            for shape in ({"data": 1, "model": 1}, {"data": 2, "model": 1}):
                mesh = parallel.make_mesh(shape)
                module = step_module(build_module(cfg, dtype), mesh)
                kw = dict(token_stats=True, num_groups=2, sample_size=8)
                executable, sig = ahead.compile_step(Layout(module, mesh, **kw), abstract_params(cfg, dtype, mesh), 4, 16)
                runners = [Runner(module, random_params(cfg, dtype, mesh=mesh), mesh, **kw) for _ in range(2)]
                assert ahead.matches(ahead.runner_signature(runners[0], 4, 16), sig)
                runners[0].use_compiled(executable)
                for runner in runners:
                    for i, tokens in enumerate(batches):
                        seg = np.ones_like(tokens)
                        pos = np.tile(np.arange(16, dtype=np.int32), (4, 1))
                        runner.step(tokens, seg, pos, i % 2, seg * (np.arange(4)[:, None] + 4 * i))
                assert runners[1]._step._cache_size() == 1  # the lazy one compiled; the other ran the executable
                for a, b in zip(jax.tree.leaves(runners[0].acc), jax.tree.leaves(runners[1].acc)):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), (dtype, shape)
        print("same")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "ISOJAX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "same"


@pytest.mark.slow
def test_a_sweep_compiles_the_step_once(tmp_path):
    """Three checkpoints of one shape in one extract process: the step compiles (or is read from
    the persistent cache) once, the later checkpoints run the same executable."""
    for seed, rev in enumerate(("step1", "step2", "step3")):
        build_hf_checkpoint(tmp_path / "repo" / rev, seed=seed, vocab_size=50304, hidden_size=32, num_layers=1,
                            num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 30, seed=3)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ISOJAX_CACHE": str(tmp_path / "cache"), "JAX_LOG_COMPILES": "1"}
    proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(tmp_path / "repo"), "--revisions",
                           "step1,step2,step3", "--data", str(tmp_path / "pile.jsonl"), "--seq-len", "64",
                           "--batch-tokens", "512", "--no-plots", "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all((tmp_path / "out" / "repo" / r / "metrics.json").exists() for r in ("step1", "step2", "step3"))
    assert proc.stderr.count("Compiling jit(step) ") == 1, [ln[:120] for ln in proc.stderr.splitlines()
                                                           if ln.startswith("Compiling") or "Compiling jit" in ln]


def test_an_error_in_the_plan_is_raised_as_before(tmp_path, monkeypatch):
    """The plan runs on a thread beside the load: its UserError (here: a sample larger than the
    corpus) reaches the caller as itself, and nothing is left waiting."""
    import threading

    import isojax
    from isojax.errors import UserError
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 5, seed=1)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="sample_states 1,000,000 is more than"):
        isojax.measure(str(tmp_path / "ckpt"), [str(tmp_path / "pile.jsonl")], unit="document", seq_len=64,
                       batch_tokens=512, sample_states=10**6, progress=False)
    assert not [t for t in threading.enumerate() if t.name == "isojax-plan"]


@pytest.mark.slow
def test_a_kernel_whose_check_fails_gets_the_step_compiled_again(tmp_path, monkeypatch, capfd):
    """The plan compiles the step for the kernels expected to pass their checks while the checks
    run; where a check chooses otherwise (here the LayerNorm kernel, whose compile also fails on
    CPU), the step compiles for what the checks chose, and the run measures with it."""
    import isojax
    from isojax.device import kernel_choice
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 5, seed=1)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "choose_norm_kernel", lambda kind, cfg, dtype, rows, check=True, record=None:
                        ("xla", "its check failed") if check else ("pallas", "expected to pass its check"))
    results = isojax.measure(str(tmp_path / "ckpt"), [str(tmp_path / "pile.jsonl")], unit="document", seq_len=64,
                             batch_tokens=512, progress=False)
    assert results.config.kernels.norm == "xla"
    assert "kernel checks chose xla/xla/xla: compiling the step for them" in capfd.readouterr().err
    assert results.layers and all(0 < layer["inter_sim"] <= 1 for layer in results.layers)


def test_the_first_batch_of_a_step_compiled_ahead_is_counted_in_the_loop(tmp_path, monkeypatch):
    """With the step compiled beside the load, its first batch compiles nothing: manifest.json's
    `loop` counts it (it was counted in `compile`, which made a sweep's later checkpoints look as if
    0.4-0.5 s of each went to a first batch beside the loop). The first step is held 1.5 s here: the
    loop's time holds those seconds, whatever the machine's speed."""
    import time

    import isojax
    from isojax.device.runner import Runner
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    write_pile_jsonl(tmp_path / "pile.jsonl", 5, seed=1)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    step, held = Runner.step, []

    def first_held(self, *args, **kwargs):
        assert self.compiled_ahead
        if not held:
            held.append(time.sleep(1.5))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "step", first_held)
    results = isojax.measure(str(tmp_path / "ckpt"), [str(tmp_path / "pile.jsonl")], unit="document", seq_len=64,
                             batch_tokens=512, progress=False)
    assert held and results.timings["loop"] >= 1.5
