"""Scale-out on CPU: 1, 2, 3, 4 and 8 devices, parameters split over 'model', and two processes
joined by jax.distributed give the metrics of one device; bad meshes and coordinators are
refused cleanly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ACCELERATOR_ENV, ACCELERATOR_FLAGS, build_hf_checkpoint
from test_extract import write_pile_jsonl

REPO = Path(__file__).resolve().parents[1]
KEYS = ("inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "anisotropy_uncentered", "unit_anisotropy",
        "mean_norm", "norm_of_mean", "mean_sq_norm")
MESHES = [{"data": 1, "model": 1}, {"data": 2, "model": 1}, {"data": 3, "model": 1}, {"data": 4, "model": 1},
          {"data": 8, "model": 1}, {"data": 2, "model": 2}, {"data": 2, "model": 4}, {"data": 1, "model": 3}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    build_hf_checkpoint(tmp / "ckpt", vocab_size=50304, hidden_size=32, num_layers=2, num_heads=2)
    write_pile_jsonl(tmp / "pile.jsonl", 120, seed=7)
    return tmp


def _env(tmp: Path, devices: int, accelerator: bool = False) -> dict:
    """A CPU run on `devices` host devices; accelerator: in the configuration of a GPU run (bfloat16,
    the default sample: conftest.ACCELERATOR_ENV)."""
    return {**os.environ, "ISOJAX_CACHE": str(tmp / "cache"), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **(ACCELERATOR_ENV if accelerator else {})}


SPECTRAL = ("anisotropy", "anisotropy_uncentered", "unit_anisotropy", "mean_sq_norm")  # from the Grams


def _assert_same(one: dict, other: dict, what: str) -> None:
    """The same metrics up to the order of float32 additions (1e-6). In bfloat16 runs the Grams are
    products of bf16-rounded deviations from each device's running mean (README "bfloat16": within
    1e-4 relative of the exact Gram; 1, 2 and 8 CPU devices differed by up to 3.8e-4 relative), so
    the metrics read from the Grams get 5e-4 relative; the others still 1e-6."""
    bf16 = one.get("dtype") == "bfloat16"
    assert one["tokens"] == other["tokens"] and one["sequences"] == other["sequences"], what
    assert one["sources"].keys() == other["sources"].keys(), what

    def close(key, a, b):
        tol = 5e-4 * abs(a) if bf16 and key in SPECTRAL else 1e-6 * max(1.0, abs(a))
        return abs(a - b) <= tol

    for a, b in zip(one["layers"], other["layers"]):
        assert a["count"] == b["count"] and a["intra_tokens"] == b["intra_tokens"], (what, a["name"])
        for key in KEYS:
            assert close(key, a[key], b[key]), (what, a["name"], key, a[key], b[key])
        # the effective rank sums square roots of every eigenvalue, float32 noise of tiny ones included
        assert abs(a["effective_rank"] - b["effective_rank"]) <= (1e-3 if bf16 else 1e-4) * a["effective_rank"], \
            (what, a["name"])
    for name in one["sources"]:
        for a, b in zip(one["sources"][name]["layers"], other["sources"][name]["layers"]):
            assert close("inter_sim", a["inter_sim"], b["inter_sim"]) and close("anisotropy", a["anisotropy"],
                                                                                b["anisotropy"]), (what, name)


@pytest.mark.slow
def test_every_device_count_and_mesh_gives_the_same_metrics(setup):
    """One process with 8 host devices measures the same corpus on meshes of 1, 2, 3 (the
    all-gather merge), 4 and 8 devices (the butterfly merge), data=2 x model=2 and data=2 x
    model=4 (parameters and Grams split over 'model') and model=3 (parameters split, Grams not:
    3 does not divide D = 32); 24 rows per batch divide every count. In the configuration of a GPU
    run (bfloat16)."""
    script = textwrap.dedent(f"""
        import json, sys
        import isojax
        out = []
        for mesh in {MESHES!r}:
            r = isojax.measure({str(setup / "ckpt")!r}, [{str(setup / "pile.jsonl")!r}], unit="document", seq_len=64,
                               batch_tokens=24 * 64, mesh=mesh, progress=False, sample_states=1000)
            out.append({{"mesh": mesh, "metrics": r.metrics, "devices": r.manifest["device"]["count"]}})
        json.dump(out, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(setup, 8, accelerator=True),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout)
    assert [r["devices"] for r in runs] == [1, 2, 3, 4, 8, 4, 8, 3]
    assert runs[0]["metrics"]["dtype"] == "bfloat16"
    for run in runs[1:]:
        _assert_same(runs[0]["metrics"], run["metrics"], str(run["mesh"]))
        # the same 1000 sampled tokens on every mesh (keys follow token identity): the same
        # intrinsic dimension and batch anisotropy up to float32 rounding of their states
        for a, b in zip(runs[0]["metrics"]["layers"], run["metrics"]["layers"]):
            for key, value in a["intrinsic_dimension"].items():
                other = b["intrinsic_dimension"][key]
                assert value is None and other is None or abs(value - other) <= 1e-4 * value, (run["mesh"], a["name"])
            assert abs(a["anisotropy_batch_mean"] - b["anisotropy_batch_mean"]) <= 1e-6 if a["anisotropy_batches"] else \
                a["anisotropy_batch_mean"] is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", [None, "data=1,model=4"])
def test_two_processes_equal_one(setup, tmp_path, mesh):
    """Two processes on localhost (2 host devices each, CPU collectives through jax.distributed)
    against one process on one device; only process 0 writes results. model=4: parameters and
    Grams split over the devices of both processes (D = 32 rows: 8 per device)."""
    common = ["--model", setup / "ckpt", "--data", setup / "pile.jsonl", "--unit", "document", "--seq-len", "64",
              "--batch-tokens", "1536", "--no-plots", "--sample-states", "500"]
    single = subprocess.run([sys.executable, "-m", "isojax.extract", *map(str, common), "--out", str(tmp_path / "one")],
                            cwd=REPO, env=_env(setup, 1), capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-2000:]
    port = _free_port()
    split = ["--mesh", mesh] if mesh else []
    procs = [subprocess.Popen([sys.executable, "-m", "isojax.extract", *map(str, common), *split, "--out", str(tmp_path / "two"),
                               "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=REPO, env=_env(setup, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "devices: 4 x cpu, processes: 2" in outs[0][1]
    if mesh:
        assert "mesh data=1,model=4" in outs[0][1], outs[0][1][-2000:]
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    _assert_same(one, two, "2 processes")
    for a, b in zip(one["layers"], two["layers"]):  # the same sampled tokens, gathered over processes
        for key, value in a["intrinsic_dimension"].items():
            other = b["intrinsic_dimension"][key]
            assert value is None and other is None or abs(value - other) <= 1e-4 * value, (a["name"], key)
    assert (tmp_path / "two" / "samples.zarr").is_dir()
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["device"]["processes"] == 2 and manifest["device"]["count"] == 4


@pytest.mark.parametrize("extra,accelerator", [(ACCELERATOR_FLAGS, True), (["--sample-states", "500", "--centered"], False),
                                               (["--mesh", "data=1,model=4", *ACCELERATOR_FLAGS], True)],
                         ids=["accelerator", "float32 sample+centered", "accelerator grams split"])
@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_killed_and_resumed_equal_one(setup, tmp_path, extra, accelerator):
    """Two processes (2 host devices each) on a first run, each tokenizing into its own cache,
    checkpointing, both SIGKILLed after the first checkpoint every process finished, then resumed: the metrics of one process
    on 4 devices, and nothing counted twice; with a sample and --centered's second pass too, and
    with the Grams split over model=4 (each device keeps its rows)."""
    import signal
    import time
    common = ["--model", setup / "ckpt", "--data", setup / "pile.jsonl", "--unit", "document", "--seq-len", "64",
              "--batch-tokens", "512", "--no-plots", *extra]
    whole = subprocess.run([sys.executable, "-m", "isojax.extract", *map(str, common), "--out", str(tmp_path / "one")],
                           cwd=REPO, env=_env(setup, 4, accelerator), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]

    def launch(*extra):
        port = _free_port()
        return [subprocess.Popen([sys.executable, "-m", "isojax.extract", *map(str, common), "--out", str(tmp_path / "two"),
                                  "--checkpoint-every-tokens", "1500", "--coordinator", f"localhost:{port}",
                                  "--num-processes", "2", "--process-id", str(i), *extra],
                                 cwd=REPO, env={**_env(setup, 2, accelerator), "ISOJAX_CACHE": str(tmp_path / f"cache{i}")},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    procs = launch()  # a first run: each process tokenizes into its own cache while it measures
    ckpt, deadline = tmp_path / "two" / "checkpoint", time.time() + 300
    while time.time() < deadline and not any(len(list(d.glob("process_*"))) == 2 for d in ckpt.glob("[0-9]*")):
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert not (tmp_path / "two" / "metrics.json").exists(), "killed too late to test anything"
    procs = launch("--resume")
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "resuming after" in outs[0][1]
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    _assert_same(one, two, "2 processes, killed and resumed")
    for a, b in zip(one["layers"], two["layers"]):  # the same sampled tokens after the resume
        for key, value in (a.get("intrinsic_dimension") or {}).items():
            other = b["intrinsic_dimension"][key]
            assert value is None and other is None or abs(value - other) <= 1e-4 * value, (a["name"], key)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bad_meshes_and_coordinators_exit_cleanly(setup, tmp_path):
    cases = [
        (["--mesh", "data=3"], 2, "does not divide"),
        (["--mesh", "data=2,model=2"], 2, "does not divide"),
        (["--mesh", "model=x"], 2, "expected data=N,model=M"),
        (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "1", "--coordinator-timeout", "2"], 1,
         "unreachable"),
        (["--coordinator", "localhost:1", "--num-processes", "2"], 1, "go together"),
    ]
    for args, devices, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(setup / "ckpt"), "--data",
                               str(setup / "pile.jsonl"), *args, "--out", str(tmp_path / "o")], cwd=REPO,
                              env=_env(setup, devices), capture_output=True, text=True)
        assert proc.returncode == 2, (args, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr and needle in proc.stderr, (args, proc.stderr[-1500:])


@pytest.mark.slow
def test_resume_refuses_another_device_count(setup, tmp_path):
    """A checkpoint written on 2 devices is not resumed on 1: its layout depends on the count."""
    script = textwrap.dedent(f"""
        import isojax
        isojax.measure({str(setup / "ckpt")!r}, [{str(setup / "pile.jsonl")!r}], unit="document", seq_len=64,
                       batch_tokens=256, checkpoint_dir={str(tmp_path / "o" / "checkpoint")!r},
                       checkpoint_every_tokens=300, progress=False)
    """)
    first = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(setup, 2), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert any((tmp_path / "o" / "checkpoint").iterdir())
    again = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(setup / "ckpt"), "--data",
                            str(setup / "pile.jsonl"), "--unit", "document", "--seq-len", "64", "--batch-tokens", "256",
                            "--out", str(tmp_path / "o"), "--resume"], cwd=REPO, env=_env(setup, 1),
                           capture_output=True, text=True)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert "other settings (devices" in again.stderr


@pytest.mark.slow
def test_token_exchange_in_one_round_and_in_many_equals_float64(tmp_path):
    """The per-token sums with the vocabulary split over 4 devices: the default exchange (one
    round) and exchange_rows=4 (one row per owner per round: many rounds) against float64 sums
    per token id, over three batches with padding and Zipf-distributed ids."""
    script = textwrap.dedent("""
        import json, sys
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from isojax.device import mesh as parallel
        from isojax.stats import accumulators as stats, token_sums
        from isojax.stats.measures import intra_sim
        from isojax.stats.options import StatsOptions
        from isojax.device.runner import vocab_rows
        from isojax.stats.accumulators import token_order
        parallel.use_gspmd_partitioner()
        mesh = parallel.make_mesh({"data": 4, "model": 1})
        n, V, D, N = 4, 50, 8, 64
        rng = np.random.default_rng(0)
        ids = (rng.zipf(1.3, (3, n * N)) % V).astype(np.int32)
        x = rng.normal(size=(3, n * N, D)).astype(np.float32)
        valid = rng.random((3, n * N)) > 0.1
        ref = np.zeros((V, D))
        np.add.at(ref, ids[valid], x[valid].astype(np.float64))
        count = np.bincount(ids[valid], minlength=V)
        rows = vocab_rows(V, n)
        out = {}
        for exchange_rows in (None, 4):
            opts = StatsOptions(token_shards=n, token_axes=parallel.ALL, exchange_rows=exchange_rows)

            def local(x_BxNxD, ids_BxN, valid_BxN):
                count, tok = intra_sim.init(1, 1, 1, rows // n, D)
                for b in range(3):
                    index = stats.index_tokens(ids_BxN[b], valid_BxN[b], rows, n)
                    count, tok = token_sums._add_batch_sharded(
                        count, tok, 0, jnp.where(valid_BxN[b][:, None], x_BxNxD[b], 0.0), index, opts)
                return count, tok.hi.astype(jnp.float64) + tok.lo.astype(jnp.float64)

            f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, parallel.ALL),) * 3,
                                      out_specs=(P(None, parallel.ALL), P(None, parallel.ALL)), check_vma=False))
            with jax.enable_x64(True):
                got_count, got_sum = f(x, ids, valid)
            got_sum = np.asarray(got_sum)[0].reshape(n, rows // n, D).transpose(1, 0, 2).reshape(rows, D)[:V]
            out[str(exchange_rows)] = {"count_ok": bool((token_order(np.asarray(got_count), n, V)[0] == count).all()),
                                       "err": float(np.abs(got_sum - ref).max())}
        json.dump(out, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(tmp_path, 4), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for exchange_rows, res in json.loads(proc.stdout).items():
        assert res["count_ok"], exchange_rows
        assert res["err"] <= 1e-5, (exchange_rows, res)


def test_exchange_cap_pads_less_than_a_quarter_of_large_batches():
    """A round's rows per owner: a quarter of a batch of up to 65,536 split over the owners, then
    growing as n^0.6 (what 262,144-token batches of text hold), never more than an owner holds."""
    from isojax.device import mesh as parallel
    from isojax.stats.token_sums import exchange_cap
    from isojax.stats.options import StatsOptions
    for shards in (2, 4, 8):
        opts, held = StatsOptions(token_shards=shards, token_axes=parallel.ALL), -(-50304 // shards)
        assert [exchange_cap(opts, n, held) for n in (8192, 65536)] == [8192 // 4 // shards, 65536 // 4 // shards]
        caps = [exchange_cap(opts, n, held) for n in (65536, 131072, 262144, 1 << 20)]
        assert caps == sorted(caps) and caps[-1] <= held
        assert exchange_cap(opts, 262144, held) < 262144 // 4 // shards * 0.6
    assert exchange_cap(StatsOptions(token_shards=4, token_axes=parallel.ALL), 262144, 100) == 100
    assert exchange_cap(StatsOptions(token_shards=4, token_axes=parallel.ALL, exchange_rows=8), 262144, 100) == 2


@pytest.mark.slow
def test_grams_split_over_model_equal_float64(tmp_path):
    """Second moments pooled over model groups and split by rows (data=2 x model=4: each device
    keeps 4 of 16 rows), three batches whose means drift and whose devices see different
    numbers of valid rows, merged on the devices (runner._compiled_merge): the covariance of x
    and of unit vectors against float64 over every valid row."""
    script = textwrap.dedent("""
        import json, sys
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from isojax.device import mesh as parallel
        from isojax.device import runner
        from isojax.stats import accumulators as stats
        from isojax.stats.finalize import _state_m2
        from isojax.stats.options import StatsOptions
        mesh = parallel.make_mesh({"data": 2, "model": 4})
        n, D, N, B = 8, 16, 32, 3
        rng = np.random.default_rng(1)
        x = (rng.normal(size=(B, n * N, D)) + 3.0 * np.arange(B)[:, None, None] * rng.normal(size=D)).astype(np.float32)
        valid = rng.random((B, n * N)) < np.repeat(np.linspace(0.3, 1.0, n), N)  # device k keeps a different share
        opts = StatsOptions(gram_shards=4, gram_axis="model")

        def local(x_BxNxD, valid_BxN):
            acc = stats.init_accumulators(1, D, gram_rows=D // 4)
            for b in range(B):
                acc = stats.update_state(acc, 0, x_BxNxD[b], jnp.zeros(N, jnp.int32), valid_BxN[b], 0, opts=opts)
            return jax.tree.map(lambda a: a[None], acc)

        shapes = jax.eval_shape(lambda: stats.init_accumulators(1, D, gram_rows=D // 4))
        specs = jax.tree.map(lambda _: P(parallel.ALL), shapes)
        acc = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, parallel.ALL), P(None, parallel.ALL)),
                                    out_specs=specs, check_vma=False))(x, valid)
        merged = runner._compiled_merge(mesh, specs, 1, True)(acc)
        out = {}
        for field, vec in (("m2_HxSxDxD", lambda v: v), ("unit_m2_HxSxDxD", lambda v: v / np.linalg.norm(v, axis=1, keepdims=True))):
            got = np.asarray(_state_m2(runner.model_rows(mesh, getattr(merged, field).hl), 0), np.float64)[0]
            rows = vec(x[valid].astype(np.float64))
            want = (rows - rows.mean(0)).T @ (rows - rows.mean(0))
            out[field] = float(np.abs(got[..., 0] + got[..., 1] - want).max() / np.abs(want).max())
        json.dump(out, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(tmp_path, 8), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for field, err in json.loads(proc.stdout).items():
        assert err <= 1e-6, (field, err)


@pytest.mark.slow
def test_two_devices_without_token_stats_equal_one(setup):
    """--no-token-stats on 2 devices (its empty per-token fields once came back from the step
    with a sharding the next step refused) gives one device's metrics."""
    script = textwrap.dedent(f"""
        import json, sys
        import isojax
        out = [isojax.measure({str(setup / "ckpt")!r}, [{str(setup / "pile.jsonl")!r}], unit="document", seq_len=64,
                              batch_tokens=8 * 64, mesh=mesh, token_stats=False, progress=False).metrics
               for mesh in ({{"data": 1, "model": 1}}, {{"data": 2, "model": 1}})]
        json.dump(out, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(setup, 2), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = json.loads(proc.stdout)
    assert one["tokens"] == two["tokens"] > 0
    for a, b in zip(one["layers"], two["layers"]):
        assert a["intra_sim"] is None and b["intra_sim"] is None
        for key in ("inter_sim", "anisotropy", "mean_norm", "mean_sq_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["name"], key)


@pytest.mark.slow
def test_the_step_compiles_once_on_two_devices(setup):
    """The step hands the accumulators back with the shardings they came in with: on 2 devices
    XLA once put the empty fields (no token stats, no sample, not centered) elsewhere, and the
    second batch compiled the step again."""
    script = textwrap.dedent(f"""
        import numpy as np, jax
        from isojax.run import measure as api
        from isojax.device import mesh as parallel
        from isojax.hf.loading import load_model
        mesh = parallel.make_mesh({{"data": 2, "model": 1}})
        loaded = load_model({str(setup / "ckpt")!r}, dtype="float32", mesh=mesh)
        runner = api.make_runner(loaded, mesh, token_stats=False, num_groups=1)
        rng = np.random.default_rng(0)
        for _ in range(3):
            tokens = rng.integers(0, 50304, (4, 64)).astype(np.int32)
            runner.step(tokens, np.ones_like(tokens), np.tile(np.arange(64, dtype=np.int32), (4, 1)), 0)
        jax.block_until_ready(runner.acc)
        print(runner._step._cache_size())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(setup, 2), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1", proc.stdout


def test_no_persistent_compilation_cache_in_multi_process_runs(monkeypatch, tmp_path):
    """A cache only process 0 writes made a second two-process GPU run hang (api.use_compilation_cache):
    with several processes isojax keeps none; alone it keeps one under ISOJAX_CACHE/xla."""
    import jax

    from isojax.run import measure as api
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path))
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        api.use_compilation_cache()
        assert not jax.config.jax_compilation_cache_dir
        monkeypatch.setattr(jax, "process_count", lambda: 1)
        api.use_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.multiprocess
def test_an_exchange_a_process_never_joins_ends_at_its_deadline(tmp_path):
    """Three processes joined by jax.distributed: an exchange that process 2 never publishes to
    raises, once its deadline passes, a UserError naming the exchange and the processes missing
    (process 1 waits while process 0 is held back behind it: both 0 and 2 are missing for it; for
    process 0, after 1 published, only 2); the processes then go on exchanging."""
    script = textwrap.dedent("""
        import sys
        from isojax.device import mesh
        from isojax.errors import UserError
        port, i = sys.argv[1], int(sys.argv[2])
        mesh.initialize(f"localhost:{port}", 3, i)
        assert mesh.exchange("hello", str(i).encode()) == [b"0", b"1", b"2"]
        def lonely():
            try:
                mesh.exchange("lonely", b"here", deadline_s=0.2)
            except UserError as e:
                print(f"process {i}: {e}", flush=True)
        if i == 1:
            lonely()
        mesh.exchange("between", b"")
        if i == 0:
            lonely()
        assert mesh.exchange("bye", str(i).encode()) == [b"0", b"1", b"2"]
        print(f"process {i}: done", flush=True)
    """)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(port), str(i)], cwd=REPO, env=_env(tmp_path, 1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert outs[0][0].splitlines() == [
        "process 0: exchange 'lonely': process 2 of 3 did not publish within 0.2 s (dead, stuck or far behind: see "
        "their logs); ISOJAX_EXCHANGE_TIMEOUT=SECONDS waits longer", "process 0: done"], outs[0][0]
    assert outs[1][0].splitlines()[0].startswith("process 1: exchange 'lonely': processes 0, 2 of 3 did not "
                                                 "publish within 0.2 s"), outs[1][0]
    assert outs[2][0].splitlines() == ["process 2: done"], outs[2][0]


def test_the_exchange_deadline_comes_from_the_environment(monkeypatch):
    from isojax.device import mesh
    from isojax.errors import UserError
    monkeypatch.delenv("ISOJAX_EXCHANGE_TIMEOUT", raising=False)
    assert mesh._exchange_deadline() == mesh.EXCHANGE_DEADLINE_S
    monkeypatch.setenv("ISOJAX_EXCHANGE_TIMEOUT", "90")
    assert mesh._exchange_deadline() == 90
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("ISOJAX_EXCHANGE_TIMEOUT", bad)
        with pytest.raises(UserError, match="ISOJAX_EXCHANGE_TIMEOUT"):
            mesh._exchange_deadline()
