"""The step compiled ahead (runner.AheadStep, started by api.measure before the weights load): the
loop calls that executable and no other, the metrics are bit-identical to those of the step
compiled at the first batch, and a signature that does not fit falls back to the jit path. CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import isojax
from conftest import build_hf_checkpoint
from isojax import api, model as model_mod, runner as runner_mod
from isojax.config import GPTNeoXConfig
from isojax.model import GPTNeoX
from isojax.runner import AheadStep, Runner
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]
OPTIONS = dict(seq_len=64, batch_tokens=256, progress=False, sample_states=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ahead")
    build_hf_checkpoint(tmp / "ckpt", vocab_size=50304, hidden_size=32, num_layers=2, num_heads=2)
    write_pile_jsonl(tmp / "pile.jsonl", 60, seed=3)
    return tmp


@pytest.fixture
def counted(monkeypatch):
    """Counts the step's jit calls (the path without a compile ahead) and its lowerings (ahead)."""
    calls = {"jit": 0, "lower": 0}
    real = runner_mod._compiled_step

    class Counted:
        def __init__(self, jitted):
            self.jitted = jitted

        def __call__(self, *args):
            calls["jit"] += 1
            return self.jitted(*args)

        def lower(self, *args):
            calls["lower"] += 1
            return self.jitted.lower(*args)

    monkeypatch.setattr(runner_mod, "_compiled_step", lambda *a: Counted(real(*a)))
    return calls


def _measure(setup, monkeypatch, **kw):
    monkeypatch.setenv("ISOJAX_CACHE", str(setup / "cache"))
    return isojax.measure(str(setup / "ckpt"), [str(setup / "pile.jsonl")], **OPTIONS, **kw)


def test_measure_uses_the_step_compiled_ahead_and_gives_the_same_metrics(setup, monkeypatch, counted, capsys):
    first = _measure(setup, monkeypatch)  # a first run (tokens streaming, the label scan in the background)
    ahead = _measure(setup, monkeypatch)  # cached
    assert counted == {"jit": 0, "lower": 2}  # every step of both runs called the executable compiled ahead
    assert "does not fit" not in capsys.readouterr().err
    for run in (first, ahead):
        info = run.manifest["compile_ahead"]
        assert info["seconds"] > 0 and info["waited"] == run.timings["compile"] >= 0
    monkeypatch.setattr(api, "compile_ahead", lambda *a, **k: None)
    plain = _measure(setup, monkeypatch)
    assert counted["lower"] == 2 and counted["jit"] > 1
    assert plain.manifest["compile_ahead"] is None and plain.timings["compile"] > 0
    assert set(ahead.metrics["sources"]) == {"Enron Emails", "HackerNews"}
    assert json.dumps(first.metrics) == json.dumps(ahead.metrics) == json.dumps(plain.metrics)  # bit-identical


def test_a_signature_that_does_not_fit_falls_back_to_jit(setup, monkeypatch, counted, capsys):
    """The loaded weights are not what the config promised (here: float16 shapes): the ahead
    compile is dropped with a log line, the step compiles at the first batch, same metrics."""
    real = model_mod.param_shapes
    monkeypatch.setattr(model_mod, "param_shapes", lambda cfg, dtype: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16), real(cfg, dtype)))
    wrong = _measure(setup, monkeypatch)
    assert "step compiled ahead does not fit this run (argument shapes, dtypes or shardings)" in capsys.readouterr().err
    assert counted["lower"] == 1 and counted["jit"] > 1
    assert wrong.manifest["compile_ahead"] is None
    monkeypatch.setattr(model_mod, "param_shapes", real)
    assert json.dumps(wrong.metrics) == json.dumps(_measure(setup, monkeypatch).metrics)


def _tiny_runner(ahead=None, **kw):
    cfg = GPTNeoXConfig(vocab_size=96, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                        max_position_embeddings=32, name="tiny")
    module = GPTNeoX(cfg)
    params = jax.jit(lambda: module.init(jax.random.PRNGKey(1), *model_mod.single_row(np.zeros(4, np.int32)),
                                         None, lambda obs, s, x: obs)["params"])()
    return Runner(module, params, token_stats=True, num_groups=2, ahead=ahead, **kw), module


def _feed(runner):
    rng = np.random.default_rng(0)
    for group in (0, 1, 0):
        tokens = rng.integers(0, 96, (4, 16)).astype(np.int32)
        runner.step(tokens, np.ones_like(tokens), np.tile(np.arange(16, dtype=np.int32), (4, 1)), group)
    return jax.tree.map(np.asarray, runner.acc)


@pytest.mark.parametrize("case", ["fits", "rows", "groups", "broken"])
def test_runner_takes_only_a_step_compiled_for_its_call(case, counted, capsys):
    """A Runner built directly: an AheadStep compiled for its very call is used (the same
    accumulators, bit for bit); one for other rows, another number of groups or whose build
    failed leaves the jit path to compile the step."""
    plain, module = _tiny_runner()
    expected = _feed(plain)
    kwargs = dict(rows=4 if case != "rows" else 8, row_len=16, num_groups=1 if case == "groups" else 2)

    def build():
        if case == "broken":
            raise RuntimeError("no config")
        # the model's name does not matter to the step (peek_config and the loaded config differ in it)
        renamed = module.clone(cfg=dataclasses.replace(module.cfg, name="other"))
        return renamed, model_mod.param_shapes(module.cfg), plain.mesh, kwargs

    counted.update(jit=0, lower=0)
    runner, _ = _tiny_runner(AheadStep(build))
    got = _feed(runner)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)))
    err = capsys.readouterr().err
    if case == "fits":
        assert counted == {"jit": 0, "lower": 1} and runner.compile_seconds > 0 and "does not fit" not in err
    else:
        assert counted["jit"] == 3 and runner.compile_waited is None and "does not fit" in err


def test_several_devices_compile_ahead(setup):
    """4 host devices, rows over all of them and parameters over 'model': the step compiled
    ahead is used and gives the metrics of the jit path bit for bit."""
    script = textwrap.dedent(f"""
        import json
        import isojax
        from isojax import api
        out = {{}}
        for mesh in ({{"data": 4, "model": 1}}, {{"data": 2, "model": 2}}):
            kw = dict(mesh=mesh, seq_len=64, batch_tokens=256, progress=False)
            r = isojax.measure({str(setup / "ckpt")!r}, [{str(setup / "pile.jsonl")!r}], **kw)
            ahead = r.manifest["compile_ahead"] is not None
            real, api.compile_ahead = api.compile_ahead, lambda *a, **k: None
            p = isojax.measure({str(setup / "ckpt")!r}, [{str(setup / "pile.jsonl")!r}], **kw)
            api.compile_ahead = real
            out[str(mesh)] = [ahead, json.dumps(r.metrics) == json.dumps(p.metrics)]
        print("RESULT" + json.dumps(out))
    """)
    env = {**os.environ, "ISOJAX_CACHE": str(setup / "cache4"), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "does not fit" not in p.stderr
    result = json.loads(p.stdout.split("RESULT")[-1])
    assert result == {"{'data': 4, 'model': 1}": [True, True], "{'data': 2, 'model': 2}": [True, True]}
