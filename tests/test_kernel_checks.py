"""The kernels' probes kept per machine (isojax.device.kernel_choice.CheckRecord): a recorded
outcome, passed or failed, is reused while every part of its key stays (kernel source, card,
driver, versions, arguments); a changed part, a damaged record or ISOJAX_RECHECK_KERNELS=1 runs the
probe again. The probes here are counters the test controls, so this runs on CPU where the GPU
kernels do not apply."""

from __future__ import annotations

import json
import types

import jax
import pytest

from isojax.device import kernel_choice
from isojax.device.kernel_choice import CheckRecord
from isojax.kernels import mlp, norm, packed_attention
from isojax.hf.family.presets import preset


def fake_kernel(tmp_path, why=None):
    """A kernel module stand-in: a source file of its own and a works() that counts its calls."""
    source = tmp_path / "fake_kernel.py"
    source.write_text("# version 1\n")
    calls = []

    def works(**args):
        calls.append(args)
        return why

    return types.SimpleNamespace(__name__="isojax.kernels.fake_kernel", __file__=str(source), works=works), calls


@pytest.fixture(autouse=True)
def no_recheck(monkeypatch):
    monkeypatch.delenv(kernel_choice.RECHECK, raising=False)


def test_a_recorded_outcome_is_reused_by_a_later_run(tmp_path):
    kernel, calls = fake_kernel(tmp_path)
    assert CheckRecord(tmp_path / "rec").outcome(kernel, dict(d=64)) is None
    later = CheckRecord(tmp_path / "rec")  # another run's record, same folder
    assert later.outcome(kernel, dict(d=64)) is None
    assert len(calls) == 1 and later.used == ["fake_kernel"]
    [path] = (tmp_path / "rec").glob("fake_kernel-*.json")
    record = json.loads(path.read_text())
    assert record["passed"] is True and record["key"]["args"] == {"d": 64}
    assert record["key"]["device_kind"] == jax.devices()[0].device_kind


def test_a_failed_outcome_is_reused_with_its_reason(tmp_path):
    kernel, calls = fake_kernel(tmp_path, why="ValueError: no sm_90 here")
    assert CheckRecord(tmp_path).outcome(kernel, {}) == "ValueError: no sm_90 here"
    assert CheckRecord(tmp_path).outcome(kernel, {}) == "ValueError: no sm_90 here"
    assert len(calls) == 1


@pytest.mark.parametrize("change", ["source", "args", "device_kind", "driver", "platform_version", "packages"])
def test_a_changed_key_runs_the_check_again(tmp_path, monkeypatch, change):
    kernel, calls = fake_kernel(tmp_path)
    CheckRecord(tmp_path).outcome(kernel, dict(head_dim=64, rotary_dims=16))
    args = dict(head_dim=64, rotary_dims=16)
    if change == "source":
        (tmp_path / "fake_kernel.py").write_text("# version 2: an edited kernel\n")
    elif change == "args":
        args = dict(head_dim=128, rotary_dims=16)
    else:
        env = dict(kernel_choice.environment())
        env[change] = ["jax==99.0", "jaxlib==99.0"] if change == "packages" else "another"
        monkeypatch.setattr(kernel_choice, "environment", lambda: env)
    record = CheckRecord(tmp_path)
    record.outcome(kernel, args)
    assert len(calls) == 2 and calls[1] == args and record.used == []
    CheckRecord(tmp_path).outcome(kernel, args)  # and the new outcome is kept beside the old
    assert len(calls) == 2


@pytest.mark.parametrize("damage", ["", "{not json", "[1, 2]", '{"key": {}, "passed": true, "why": null}',
                                    "\xff\xfe"])
def test_a_damaged_record_is_ignored_and_rewritten(tmp_path, damage):
    kernel, calls = fake_kernel(tmp_path, why="too slow")
    CheckRecord(tmp_path / "rec").outcome(kernel, {})
    [path] = (tmp_path / "rec").glob("fake_kernel-*.json")
    path.write_bytes(damage.encode("latin-1"))
    assert CheckRecord(tmp_path / "rec").outcome(kernel, {}) == "too slow"
    assert len(calls) == 2
    assert json.loads(path.read_text())["why"] == "too slow"
    assert CheckRecord(tmp_path / "rec").outcome(kernel, {}) == "too slow"
    assert len(calls) == 2


def test_a_record_that_contradicts_itself_is_ignored(tmp_path):
    kernel, calls = fake_kernel(tmp_path, why="bad")
    CheckRecord(tmp_path).outcome(kernel, {})
    [path] = tmp_path.glob("fake_kernel-*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "passed": True}))  # passed, with a reason
    assert CheckRecord(tmp_path).outcome(kernel, {}) == "bad"
    assert len(calls) == 2


@pytest.mark.parametrize("value, runs", [("1", 2), ("0", 1)])
def test_recheck_runs_it_again(tmp_path, monkeypatch, value, runs):
    kernel, calls = fake_kernel(tmp_path)
    CheckRecord(tmp_path).outcome(kernel, {})
    monkeypatch.setenv(kernel_choice.RECHECK, value)
    CheckRecord(tmp_path).outcome(kernel, {})
    assert len(calls) == runs


def test_a_record_that_cannot_be_written_does_not_fail_the_run(tmp_path):
    kernel, calls = fake_kernel(tmp_path, why="no")
    (tmp_path / "file").write_text("a file where the folder would be")
    assert CheckRecord(tmp_path / "file" / "rec").outcome(kernel, {}) == "no"
    assert CheckRecord(tmp_path / "file" / "rec").outcome(kernel, {}) == "no"
    assert len(calls) == 2


def test_run_false_takes_the_record_and_never_runs_the_check(tmp_path):
    kernel, calls = fake_kernel(tmp_path, why="no")
    assert CheckRecord(tmp_path).outcome(kernel, {}, run=False) is None  # nothing recorded: assumed to work
    CheckRecord(tmp_path).outcome(kernel, {})
    record = CheckRecord(tmp_path)
    assert record.outcome(kernel, {}, run=False) == "no"
    assert len(calls) == 1 and record.used == []  # the plan's expected choice: not reported as a check


def counting(monkeypatch, module, why=None):
    calls = []
    monkeypatch.setattr(module, "works", lambda **args: calls.append(args) or why)
    return calls


def test_the_choices_go_through_the_record(tmp_path, monkeypatch):
    """choose_* ask the record: each probe runs on the first run only; the plan's expected choice
    (check=False) follows a recorded failure instead of assuming the kernel works."""
    cfg = preset("pythia-410m")
    attention = counting(monkeypatch, packed_attention)
    mlp_calls = counting(monkeypatch, mlp)
    norm_calls = counting(monkeypatch, norm, why="its result is 1 beyond bf16 rounding")
    monkeypatch.setattr(mlp, "applies", lambda *a, **k: True)
    monkeypatch.setattr(norm, "applies", lambda *a, **k: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

    def choices(check=True):
        record = CheckRecord(tmp_path)
        chosen = (kernel_choice.choose_attention("packed", True, cfg, "bfloat16", 512, check, record),
                  kernel_choice.choose_mlp_kernel("auto", cfg, "bfloat16", 65536, check, record),
                  kernel_choice.choose_norm_kernel("auto", cfg, "bfloat16", 65536, check, record))
        return tuple(kernel for kernel, why in chosen), sorted(record.used)

    assert choices(check=False) == (("packed", "mosaic", "pallas"), [])  # nothing recorded yet
    assert choices() == (("packed", "mosaic", "xla"), [])
    assert choices() == (("packed", "mosaic", "xla"), ["mlp", "norm", "packed_attention"])
    assert choices(check=False) == (("packed", "mosaic", "xla"), [])
    assert attention == [dict(head_dim=64, rotary_dims=16, qk_norm=False, clip=False)] and mlp_calls == [{}] and norm_calls == [dict(d=1024)]


def test_the_plans_choice_keeps_each_reason_and_is_compared_by_its_kernels(tmp_path, monkeypatch, capsys):
    """kernel_choice makes the run's one KernelChoice with the reason given for each kernel (a failed
    check's, the one the log shows); choices of the same kernels are equal whatever their reasons
    (the plan's expected choice against its checks'), and the model builder takes one whole."""
    from isojax.hf.loading import build_module
    from isojax.model.options import ForwardOptions, KernelChoice
    cfg = preset("pythia-410m")
    counting(monkeypatch, mlp)
    counting(monkeypatch, norm, why="its result is 1 beyond bf16 rounding")
    monkeypatch.setattr(mlp, "applies", lambda *a, **k: True)
    monkeypatch.setattr(norm, "applies", lambda *a, **k: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    record = CheckRecord(tmp_path)
    k = kernel_choice
    choice = k.kernel_choice(k.choose_attention("cudnn", False, cfg, "bfloat16", 512, True, record),
                             k.choose_mlp_kernel("auto", cfg, "bfloat16", 65536, True, record),
                             k.choose_norm_kernel("auto", cfg, "bfloat16", 65536, True, record))
    assert (choice.attention, choice.mlp, choice.norm) == ("cudnn", "mosaic", "xla")
    reasons = dict(choice.reasons)
    assert reasons == {"attention": "asked for", "mlp": "applies and works here",
                       "norm": "the LayerNorm kernel does not run here (its result is 1 beyond bf16 rounding): "
                               "XLA's LayerNorms instead"}
    assert reasons["norm"] in capsys.readouterr().err
    same = KernelChoice("cudnn", "mosaic", "xla")
    assert choice == same and hash(choice) == hash(same) and choice != KernelChoice("cudnn", "mosaic", "pallas")
    assert build_module(cfg, "bfloat16", choice).options == ForwardOptions("cudnn", mlp_kernel="mosaic")


def test_an_explicit_mosaic_mlp_goes_through_the_record(tmp_path, monkeypatch):
    """--mlp-kernel mosaic's early check (check_mlp_kernel, before any weights load) takes the
    record as the plan's probes do: its probe runs once per machine, and a recorded failure is the
    same error without running it again."""
    from isojax.errors import UserError
    calls = counting(monkeypatch, mlp, why="ValueError: no sm_90 here")
    for _ in range(2):
        with pytest.raises(UserError, match="mlp kernel mosaic does not run here: ValueError: no sm_90 here"):
            kernel_choice.check_mlp_kernel("mosaic", "bfloat16", CheckRecord(tmp_path))
    assert len(calls) == 1 and len(list(tmp_path.glob("mlp-*.json"))) == 1
