"""extract --dry-run [--target KIND] (isojax/run/dry_run.py, device/targets.py): slices named as Google
and NVIDIA name them, the step of every family lowered for TPU over abstract v5e-8 and v5p-64 meshes with
the TPU kernels (Mosaic custom calls in the module), the split that fits gpt-neox-20b on v5e-256 (the
default batch shrunk to fit), the refusal naming the smallest slice that fits, the same mesh and batch
a run chooses, the plan's memory figure against XLA's own analysis of the same step compiled for 8 CPU
devices, and the command end to end, offline."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from isojax.errors import UserError
from isojax.hf.family.presets import preset

REPO = Path(__file__).resolve().parents[1]
FAMILY_PRESETS = ["pythia-70m", "llama-1b", "mistral-1b", "falcon-mqa-1b", "olmo-1b", "olmo2-1b", "opt-1.3b",
                  "gpt2-xl", "qwen2-1.5b"]  # one preset per family (configs/); two layers each below
GiB = 1 << 30


def dry_args(*argv, out="/nonexistent/out"):
    from isojax.extract import build_parser
    return build_parser().parse_args(["--dry-run", "--out", str(out), *argv])


def two_layers(name):
    return dataclasses.replace(preset(name), num_layers=2)


def test_targets_count_chips_as_google_and_nvidia_name_them():
    """v4 and v5p names count TensorCores (two per chip), v5e and v6e names count chips; memory per chip
    from the vendors' pages; an unknown kind or size is one UserError that lists the kinds."""
    from isojax.device.targets import parse
    expected = {"tpu-v4-8": (4, 32 * GiB), "tpu-v5p-64": (32, 95 * GiB), "tpu-v5e-8": (8, 16 * GiB),
                "tpu-v5e-256": (256, 16 * GiB), "tpu-v6e-4": (4, 32 * GiB), "gpu-h100-8": (8, 0.9 * 80 * GiB),
                "gpu-a100-40g-2": (2, 0.9 * 40 * GiB), "gpu-h200-1": (1, 0.9 * 141e9)}
    for name, (chips, memory) in expected.items():
        target = parse(name)
        assert (target.chips, target.chip_memory) == (chips, pytest.approx(memory, abs=1)), name
    assert {parse("tpu-v5p-64").platform, parse("gpu-a100-80g-8").platform} == {"tpu", "gpu"}
    for bad in ("tpu-v9-8", "h100-8", "tpu-v5e", ""):
        with pytest.raises(UserError, match="tpu-v4-N, tpu-v5e-N, tpu-v5p-N, tpu-v6e-N, gpu-h100-N"):
            parse(bad)
    with pytest.raises(UserError, match="sizes 1, 4, 8"):
        parse("tpu-v5e-3")


def lowered_for_tpu(name, target, *argv):
    from isojax.run.dry_run import plan
    result = plan(dry_args("--target", target, "--model", f"random:{name}", *argv), two_layers(name))
    assert result["platform"] == "tpu" and result["lowered"]["platform"] == "tpu"
    # the TPU kernels extract chooses there: Pallas flash attention (segment ids), the scanned per-token sums
    assert (result["kernels"], result["segment_sum"]) == ({"attention": "pallas", "mlp": "xla", "norm": "xla"}, "scan")
    assert "stablehlo.custom_call @tpu_custom_call" in result["stablehlo"]  # the Mosaic kernel, lowered for TPU
    assert 'mhlo.sharding = "{manual}"' in result["stablehlo"]  # inside shard_map: one kernel per chip
    return result


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_every_family_lowers_for_tpu_v5e_8(name):
    """The whole step of each family, lowered for TPU over an abstract v5e-8 (8 chips, all on 'data').
    Before the attention ran per device (options.per_device), Mosaic refused to be partitioned."""
    result = lowered_for_tpu(name, "tpu-v5e-8")
    assert (result["devices"], result["mesh"]) == (8, {"data": 8, "model": 1})


@pytest.mark.parametrize("name", ["pythia-70m", "llama-1b"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in FAMILY_PRESETS if n not in ("pythia-70m", "llama-1b")])
def test_every_family_lowers_for_tpu_v5p_64(name):
    """The same over an abstract v5p-64: 32 chips (64 TensorCores)."""
    result = lowered_for_tpu(name, "tpu-v5p-64")
    assert (result["devices"], result["mesh"]) == (32, {"data": 32, "model": 1})


@pytest.mark.parametrize("kind", list(__import__("isojax.device.targets", fromlist=["KINDS"]).KINDS))
def test_every_documented_target_plans_offline_with_the_kernels_it_would_choose(kind):
    """Each kind of targets.KINDS, 8 of its chips (or TensorCores), plans on this CPU (two layers each):
    TPUs pythia-70m (every family: the tests above), GPUs pythia-2.8b (head dim 80: cuDNN's attention)
    and, on H100 and A100-40G, pythia-70m (head dim 64: packed attention; the Hopper MLP kernel) and
    llama-1b (grouped heads, SwiGLU). The module
    holds the Pallas kernels as a GPU compiles them (Triton custom calls, not Pallas' interpret mode)
    and Mosaic GPU's on Hopper; cuDNN's attention, which jax lowers only with the cuDNN library, is
    named in one line as not lowered, with XLA's attention standing in."""
    from isojax.run.dry_run import plan
    gpu, hopper = kind.startswith("gpu"), kind in ("gpu-h100", "gpu-h200")
    names = ("pythia-70m", "llama-1b", "pythia-2.8b") if kind in ("gpu-h100", "gpu-a100-40g") else \
        ("pythia-2.8b",) if gpu else ("pythia-70m",)  # H200 and A100-80G: H100's and A100-40G's kernels
    for name in names:
        result = plan(dry_args("--target", f"{kind}-8", "--model", f"random:{name}", "--seq-len", "512"),
                      two_layers(name))
        kernels, lowered, calls = result["kernels"], result["lowered"], result["lowered"]["custom_calls"]
        assert lowered["platform"] == ("cuda" if gpu else "tpu") and lowered["module_chars"] > 0, name
        if not gpu:
            assert kernels["attention"] == "pallas" and calls.get("tpu_custom_call") and not lowered["not_lowered"]
            continue
        want = "cudnn" if name == "pythia-2.8b" else "packed"
        mosaic = hopper and name != "llama-1b"  # auto takes the Hopper MLP kernel for GELU MLPs (SwiGLU's: asked for)
        assert kernels["attention"] == want and kernels["mlp"] == ("mosaic" if mosaic else "xla"), (name, kernels)
        assert ("mosaic_gpu_v2" in calls) == mosaic, (name, calls)
        triton = (want == "packed") + (kernels["norm"] == "pallas")
        assert calls.get("__gpu$xla.gpu.triton", 0) == triton * 1, (name, calls)
        assert list(lowered["not_lowered"]) == (["attention cudnn"] if want == "cudnn" else []), name


def test_the_plan_names_hosts_the_command_on_each_and_the_time_from_a_measured_rate():
    """What renting the slice takes: hosts and processes (v5p: 4 chips a host, v5e 8, GPUs 8), the run's
    command with --distributed where there are several hosts, and the time from bench/RESULTS.md's rate
    (read from its §14b table here); no estimate, and why, where nothing was measured."""
    import re
    from isojax.run.dry_run import plan
    table = (REPO / "bench" / "RESULTS.md").read_text().split("### 14b.")[1]
    rate = int(re.search(r"\| gpt_neox \| pythia-1b \| ([\d,]+) \|", table).group(1).replace(",", ""))

    def launch(target, model, *extra):
        argv = ["--dry-run", "--target", target, "--model", model, *extra, "--out", "plans/x"]
        args = dry_args(*argv[:-2])
        args.argv = argv
        return plan(args, lower_step=False)["launch"]

    got = launch("gpu-h100-16", "pythia-1b", "--max-tokens", "1000000000")
    assert (got["hosts"], got["processes"]) == (2, 2)
    assert got["command"] == ("python -m isojax.extract --distributed --model pythia-1b --max-tokens 1000000000 "
                              "--out plans/x")
    assert got["estimate"]["seconds"] == pytest.approx(1e9 / (rate * 16), abs=0.1)
    one = launch("gpu-h100-8", "pythia-1b")
    assert one["hosts"] == 1 and "--distributed" not in one["command"]
    assert one["estimate"]["seconds"] is None and "--max-tokens" in one["estimate"]["why"]
    assert one["estimate"]["tokens_per_second"] == pytest.approx(rate * 8, abs=1)
    for target, hosts in (("tpu-v5p-32", 4), ("tpu-v5e-16", 2), ("tpu-v5e-8", 1), ("tpu-v4-8", 1)):
        got = launch(target, "random:pythia-70m", "--max-tokens", "1000")
        assert got["hosts"] == hosts and ("--distributed" in got["command"]) == (hosts > 1), target
        assert got["estimate"]["seconds"] is None and "no rate measured on tpu" in got["estimate"]["why"]
    assert "no rate measured on gpu-a100-80g" in launch("gpu-a100-80g-4", "phi-2", "--max-tokens", "9")[
        "estimate"]["why"]


def test_split_parameters_lower_for_tpu():
    """Parameters and Grams split over 'model' (data=8 x model=4 of a v5p-64): lowered for TPU too."""
    result = lowered_for_tpu("pythia-70m", "tpu-v5p-64", "--mesh", "data=8,model=4")
    assert result["mesh"] == {"data": 8, "model": 4}


def test_gpt_neox_20b_on_v5e_256_plans_a_split_that_fits(capsys):
    """20.6B parameters (41 GB in bf16) on 16 GiB chips: split over 'model', and the per-device total
    within the chips' memory (planned only; lowering it takes ~50 s: the CLI test below, marked slow).
    At the default 65,536 tokens per chip the step alone (~19 GB) does not fit: the default batch is
    halved to 32,768 per chip, and one line says so; an explicit --batch-tokens is never shrunk."""
    from isojax.run.dry_run import plan
    result = plan(dry_args("--target", "tpu-v5e-256", "--model", "random:gpt-neox-20b"), lower_step=False)
    mem, mesh = result["memory_per_device"], result["mesh"]
    assert mesh["model"] > 1 and mesh["data"] * mesh["model"] == 256 and result["tokens_per_device"] == 32768
    assert mem["parameters"] == pytest.approx(2 * preset("gpt-neox-20b").param_count() / mesh["model"])
    assert mem["total"] == mem["parameters"] + mem["accumulators"] + mem["step"] <= 0.95 * 16 * GiB
    shrunk = [line for line in capsys.readouterr().err.splitlines() if "default batch" in line]
    assert shrunk == ["isojax: the default batch (65,536 tokens per device) does not fit gpt-neox-20b on devices of "
                      "16.0 GiB: 32,768 tokens per device (--batch-tokens sets the batch)"]
    explicit = plan(dry_args("--target", "tpu-v5e-256", "--model", "random:gpt-neox-20b", "--batch-tokens",
                             str(256 * 32768)), lower_step=False)
    assert (explicit["mesh"], explicit["tokens_per_device"]) == (mesh, 32768)
    with pytest.raises(UserError, match="65,536 tokens per device.* at 32,768 tokens per chip .* tpu-v5e-128 fits"):
        plan(dry_args("--target", "tpu-v5e-256", "--model", "random:gpt-neox-20b", "--batch-tokens",
                      str(256 * 65536)), lower_step=False)
    assert "default batch" not in capsys.readouterr().err


def test_a_slice_too_small_names_the_smallest_that_fits():
    """gpt-neox-20b on tpu-v5e-4: refused even at one row per chip, naming the smallest v5e slice that
    fits with the default batch shrunk as a run there shrinks it; that slice plans, and the one below it is
    refused. With --batch-tokens, the smallest that fits at the same tokens per chip."""
    from isojax.run.dry_run import plan
    model = ["--model", "random:gpt-neox-20b"]
    with pytest.raises(UserError, match=r"does not fit tpu-v5e-4 even at one row of 512 tokens per device; the "
                                        r"smallest tpu-v5e slice that fits is tpu-v5e-(\d+) \(\d+ chips, ([\d,]+) "
                                        r"tokens per chip\)") as refused:
        plan(dry_args("--target", "tpu-v5e-4", *model), lower_step=False)
    text = str(refused.value)
    chips = int(text.split("is tpu-v5e-")[1].split()[0])
    tokens = int(text.split("chips, ")[1].split()[0].replace(",", ""))
    assert plan(dry_args("--target", f"tpu-v5e-{chips}", *model), lower_step=False)["tokens_per_device"] == tokens
    with pytest.raises(UserError, match="does not fit"):
        plan(dry_args("--target", f"tpu-v5e-{chips // 2}", *model), lower_step=False)
    with pytest.raises(UserError, match=r"16,384 tokens per device\) does not fit tpu-v5e-4; the smallest tpu-v5e "
                                        r"slice that fits is tpu-v5e-(\d+) \(\d+ chips\)") as refused:
        plan(dry_args("--target", "tpu-v5e-4", *model, "--batch-tokens", str(4 * 16384)), lower_step=False)
    chips = int(str(refused.value).split("is tpu-v5e-")[-1].split()[0])
    assert plan(dry_args("--target", f"tpu-v5e-{chips}", *model, "--batch-tokens", str(chips * 16384)),
                lower_step=False)


SAME_DECISION = textwrap.dedent("""
    import json, sys
    from isojax.data import load_corpus
    from isojax.device import memory
    from isojax.extract import build_parser
    from isojax.hf.family.presets import preset
    from isojax.run.config import MeasureConfig
    from isojax.run.dry_run import plan
    from isojax.run.measure import row_length
    for name, gib in json.loads(sys.argv[1]):
        memory.device_memory_bytes = lambda: int(gib * 2**30)  # 8 devices of this memory
        argv = ["--dry-run", "--out", "/nonexistent", "--model", "random:" + name]
        planned = plan(build_parser().parse_args(argv), lower_step=False)
        # the real run's planning (measure(): choose_mesh; make_plan: run_batch), as a run would call them
        cfg, config, dtype = preset(name), MeasureConfig.build("random:" + name), "bfloat16"
        corpus, row_len = load_corpus(None, unit="sentence"), row_length(cfg, "sentence", None)
        mesh = memory.choose_mesh(cfg, config, dtype, corpus, row_len)
        rows = memory.run_batch(cfg, config, dtype, corpus, mesh.size, row_len, mesh.shape["model"], say=True)[1]
        print(json.dumps({"dry": [planned["mesh"], planned["tokens_per_device"], planned["dtype"]],
                          "run": [dict(mesh.shape), rows // mesh.size * row_len, dtype]}))
""")


def test_the_dry_run_plans_what_a_run_chooses():
    """On 8 devices of a given memory (CPU devices, their memory overridden; accelerator defaults): the dry
    run's mesh and tokens per device are those the real run's planning chooses. qwen2-1.5b on 16 GiB: the
    default sample (counted by both) takes it to model=2 (a run used to choose model=1); pythia-1.4b on
    8 GiB: both shrink the default batch (a run used to refuse), and both say so."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO), ISOJAX_DEFAULTS="tpu")
    cases = [["qwen2-1.5b", 16], ["pythia-1.4b", 8]]
    done = subprocess.run([sys.executable, "-c", SAME_DECISION, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    qwen, pythia = [json.loads(line) for line in done.stdout.splitlines()[-2:]]
    assert qwen["dry"] == qwen["run"] == [{"data": 4, "model": 2}, 65536, "bfloat16"]
    assert pythia["dry"] == pythia["run"] and pythia["run"][1] < 65536
    shrunk = [line for line in done.stderr.splitlines() if "default batch (65,536 tokens per device)" in line]
    assert len(shrunk) == 2 and shrunk[0] == shrunk[1] and "pythia-1.4b on devices of 8.0 GiB" in shrunk[0]


MEMORY_CHECK = textwrap.dedent("""
    import json, sys
    import jax
    from isojax.device import ahead, mesh as parallel
    from isojax.extract import build_parser
    from isojax.hf.loading import abstract_params
    from isojax.hf.family.presets import preset
    from isojax.model.options import KernelChoice
    from isojax.run.dry_run import plan, step_layout
    name, mesh_spec, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = build_parser().parse_args(["--dry-run", "--out", "/nonexistent", "--model", "random:" + name, "--mesh",
                                      mesh_spec, "--batch-tokens", str(8 * tokens), "--seq-len", "512"])
    planned = plan(args, lower_step=False)  # this machine: 8 CPU devices
    cfg, dtype = preset(name), planned["dtype"]
    mesh = parallel.make_mesh(planned["mesh"])
    layout = step_layout(cfg, dtype, KernelChoice(**planned["kernels"]), mesh, "cpu", token_stats=True,
                         num_groups=1, sample_size=planned["sample_states"])
    compiled, _ = ahead.compile_step(layout, abstract_params(cfg, dtype, mesh), planned["rows"], 512)
    m = compiled.memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    print(json.dumps({"plan": planned["memory_per_device"], "xla": xla, "temp": m.temp_size_in_bytes,
                      "dtype": dtype, "mesh": planned["mesh"]}))
""")


def xla_memory(name, mesh, tokens_per_device):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cached executable may carry no memory analysis
    done = subprocess.run([sys.executable, "-c", MEMORY_CHECK, name, mesh, str(tokens_per_device)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name, tokens", [("pythia-160m", 16384),
                                          pytest.param("pythia-1.4b", 65536, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mesh", ["data=8", "data=2,model=4"])
def test_memory_figure_within_15_percent_of_xla(name, tokens, mesh):
    """The plan's per-device figure (parameters + accumulators + the step's estimate) against XLA's
    memory analysis (arguments + temporaries + unaliased outputs) of the same step, shapes and mesh
    compiled for 8 CPU devices (float32: the dtype a CPU run takes; CPU computes bf16 in float32)."""
    got = xla_memory(name, mesh, tokens)
    assert got["dtype"] == "float32" and got["mesh"]["model"] == (4 if "model" in mesh else 1)
    assert got["plan"]["total"] == pytest.approx(got["xla"], rel=0.15), got


def test_dry_run_writes_the_plan_as_a_result_and_a_run_may_follow(tmp_path):
    """plan.json is a recorded result (OUT/.isojax-results.json names it); a second dry run replaces it
    without --overwrite; a real run into that --out is not refused for it."""
    from isojax.extract import build_parser, check_out
    from isojax.run import outdir
    from isojax.run.dry_run import dry_run
    out = tmp_path / "out"
    args = dry_args("--target", "tpu-v4-8", "--model", "random:pythia-70m", "--seq-len", "128", out=out)
    dry_run(args)
    first = json.loads((out / "plan.json").read_text())
    assert outdir.owned(out) == ["plan.json"] and first["target"] == "tpu-v4-8" and first["devices"] == 4
    assert first["lowered"]["custom_calls"].get("tpu_custom_call") == 1 and "stablehlo" not in first
    dry_run(dry_args("--target", "tpu-v5e-4", "--model", "random:pythia-70m", "--seq-len", "128", out=out))
    assert json.loads((out / "plan.json").read_text())["target"] == "tpu-v5e-4"
    check_out(out, build_parser().parse_args(["--out", str(out), "--model", "random:pythia-70m"]))


def extract(*argv, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "isojax.extract", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_plans_pythia_1_4b_for_tpu_v5p_64_offline(tmp_path):
    done = extract("--dry-run", "--target", "tpu-v5p-64", "--model", "random:pythia-1.4b", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the step was lowered for TPU" in done.stderr and "mesh data=32,model=1 over 32 devices" in done.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["lowered"]["custom_calls"]["tpu_custom_call"] >= 1 and plan["model"]["layers"] == 24


def test_cli_refuses_an_unknown_kind_a_target_without_dry_run_and_a_slice_too_small(tmp_path):
    for argv, model in ((["--dry-run", "--target", "tpu-v7-8"], "pythia-70m"),
                        (["--target", "tpu-v5e-8"], "pythia-70m"), (["--dry-run", "--target", "tpu-v5e-4"], "gpt-neox-20b")):
        done = extract(*argv, "--model", f"random:{model}", "--out", str(tmp_path))
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "the smallest tpu-v5e slice that fits is tpu-v5e-32 (32 chips" in done.stderr
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target, model, mesh", [
    ("tpu-v5e-256", "gpt-neox-20b", "data=4,model=64"), ("tpu-v4-8", "llama-1b", "data=4,model=1")])
def test_cli_plans_and_lowers_at_full_size(tmp_path, target, model, mesh):
    """At the default batch: gpt-neox-20b's shrunk to fit v5e-256's 16 GiB chips (one line says so)."""
    done = extract("--dry-run", "--target", target, "--model", f"random:{model}", "--out", str(tmp_path))
    assert done.returncode == 0 and "the step was lowered for TPU" in done.stderr, done.stderr[-2000:]
    assert f"mesh {mesh} over" in done.stderr
    assert ("default batch" in done.stderr) == (model == "gpt-neox-20b")


PER_DEVICE_ATTENTION = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental.pallas import tpu as pltpu
    from isojax.device import mesh as parallel
    from isojax.hf.loading import random_params
    from isojax.model.config import ModelConfig
    from isojax.model.decoder import Decoder, collect_states
    from isojax.model.options import ForwardOptions
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                      rotary_pct=0.25, max_position_embeddings=256)
    params = random_params(cfg, seed=3)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 300, (4, 128)).astype(np.int32)
    seg = np.repeat(np.arange(1, 5), 32)[None].repeat(4, 0).astype(np.int32)
    seg[1, 100:] = 0
    pos = np.tile(np.arange(32), 4)[None].repeat(4, 0).astype(np.int32)
    buf = jnp.zeros((cfg.num_states, 4, 128, 64))
    rows = parallel.rows(parallel.make_mesh({"data": 4, "model": 1}))
    run = lambda options: np.asarray(jax.jit(Decoder(cfg, options=options).apply, static_argnums=5)(
        {"params": params}, tokens, seg, pos, buf, collect_states))
    xla = run(ForwardOptions(attention="xla"))
    with pltpu.force_tpu_interpret_mode():
        pallas = run(ForwardOptions(attention="pallas", activation_sharding=rows))
    real = seg > 0
    print("error", float(np.max(np.abs(pallas[:, real] - xla[:, real]) / np.abs(xla[:, real]).max())))
""")


def test_pallas_tpu_attention_runs_per_device_on_a_mesh():
    """Pallas flash attention on 4 devices (activation rows split, Pallas' TPU interpret mode on CPU): the
    states of XLA's attention. Before it ran under shard_map, XLA could not partition the Mosaic call."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", PER_DEVICE_ATTENTION], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-5, done.stdout


def test_the_plan_keeps_the_dtype_and_sample_a_run_keeps():
    """The plan's dtype and sample are the run's (run/plan.py run_dtype, run_sample): on a TPU slice
    bfloat16 and the default sample of 16,384 states, at most --max-tokens of them; a sample_states
    a run refuses (too few for the intrinsic dimension's 20 neighbours) is refused by the plan."""
    from isojax.run.dry_run import plan
    model = ("--target", "tpu-v5e-4", "--model", "random:pythia-70m")
    planned = plan(dry_args(*model), lower_step=False)
    assert (planned["dtype"], planned["sample_states"]) == ("bfloat16", 16384)
    assert plan(dry_args(*model, "--max-tokens", "5000"), lower_step=False)["sample_states"] == 5000
    with pytest.raises(UserError, match="too small for 20 neighbours"):
        plan(dry_args(*model, "--sample-states", "10"), lower_step=False)
