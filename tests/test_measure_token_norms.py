"""The mean norm per token id (stats/measures/token_norms.py, tokens.zarr/mean_norm) end to end against
float64 references from Hugging Face PyTorch hidden states of random checkpoints (GPT-NeoX, Llama), on 1
and 2 CPU devices, with --skip-positions, and in bf16 (the accelerator configuration); off with
token_norms=False; a checkpoint resumes into the sums of one pass, bit for bit; the planner counts its
sums; and nothing outside its file names it (a step measure is driven through its Step)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from test_streamed_measures import _build, _documents, _measure_in_subprocess

REPO = Path(__file__).resolve().parents[1]
ROW = 160  # test_streamed_measures._documents: a few documents make two windows


def _tokens_in_subprocess(tmp: Path, runs: list[dict], accelerator: bool = False) -> list[dict]:
    """{"count": [V], "mean_norm": [S, V] or None} of isojax.measure for each run's keywords, in one
    process of 2 CPU devices (rows of ROW tokens, 4 a batch)."""
    read = ('{"count": r.final["token"]["count_V"].tolist(), "mean_norm": r.final["token"]["mean_norm"].tolist() '
            'if "mean_norm" in r.final["token"] else None}')
    return _measure_in_subprocess(tmp, runs, accelerator, row=ROW, read=read)


def _reference(model, tmp: Path, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """(count [V], mean norm [S, V]: NaN where the count is 0) in float64 from Hugging Face's states of
    every window of ROW tokens, without each window's first `skip` positions."""
    from test_families import hf_states
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp / "ckpt" / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in (tmp / "docs.jsonl").read_text().splitlines()]
    ids = [np.array(tok.encode(t, add_special_tokens=False).ids) for t in texts]
    windows = [i[k:k + ROW] for i in ids for k in range(0, len(i), ROW)]
    assert max(map(len, ids)) > ROW  # some documents make two windows
    v = model.config.vocab_size
    count, sums = np.zeros(v), None
    for w in windows:
        x = hf_states(model, w)[:, skip:]  # [S, T, D] float64
        norms = np.linalg.norm(x, axis=-1)
        sums = np.zeros((x.shape[0], v)) if sums is None else sums
        for s in range(x.shape[0]):
            np.add.at(sums[s], w[skip:], norms[s])
        np.add.at(count, w[skip:], 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return count, np.where(count > 0, sums / count, np.nan)


def _check(got: dict, count: np.ndarray, want: np.ndarray, rtol: float, what) -> None:
    assert np.array_equal(np.asarray(got["count"]), count), what
    mean = np.asarray(got["mean_norm"], np.float64)
    assert mean.shape == want.shape and np.array_equal(np.isnan(mean), np.isnan(want)), what
    seen = count > 0
    assert seen.sum() > 100, what
    np.testing.assert_allclose(mean[:, seen], want[:, seen], rtol=rtol, err_msg=str(what))


@pytest.mark.parametrize("family", ["gpt_neox", pytest.param("llama", marks=pytest.mark.slow)])  # llama: ~20 s
def test_mean_norm_equals_float64_hugging_face_on_1_and_2_devices(tmp_path, family):
    """1 and 2 devices, with and without --skip-positions, against the float64 reference; off
    (token_norms=False): no mean_norm."""
    model = _build(tmp_path / "ckpt", family).double()
    _documents(tmp_path / "docs.jsonl", 16, seed=3)
    one, two = {"data": 1, "model": 1}, {"data": 2, "model": 1}
    runs = [dict(mesh=one), dict(mesh=two, skip_positions=2)]
    runs += [dict(mesh=one, token_norms=False)] if family == "gpt_neox" else []
    got = _tokens_in_subprocess(tmp_path, runs)
    for run, result in zip(runs, got):
        if run.get("token_norms") is False:
            assert result["mean_norm"] is None
            continue
        count, want = _reference(model, tmp_path, run.get("skip_positions", 0))
        _check(result, count, want, 1e-6, run)  # measured <= 2e-7


@pytest.mark.slow  # ~20-30 s on 2 shared cores
def test_mean_norm_in_bf16_on_1_and_2_devices(tmp_path):
    """The accelerator configuration (bf16 forward, the default sample) on 1 and 2 devices within bf16's
    error of the float64 reference, with --skip-positions."""
    model = _build(tmp_path / "ckpt", "gpt_neox").double()
    _documents(tmp_path / "docs.jsonl", 16, seed=4)
    runs = [dict(mesh={"data": n, "model": 1}, skip_positions=1) for n in (1, 2)]
    got = _tokens_in_subprocess(tmp_path, runs, accelerator=True)
    count, want = _reference(model, tmp_path, 1)
    for run, result in zip(runs, got):
        _check(result, count, want, 1e-2, run)  # bf16 states: measured <= 3e-3
    a, b = (np.asarray(r["mean_norm"], np.float64) for r in got)
    np.testing.assert_allclose(a[:, count > 0], b[:, count > 0], rtol=1e-6)  # the same bf16 states


def test_a_checkpoint_resumes_into_the_sums_of_one_pass(tmp_path):
    """Written after one batch and resumed: the sums are those of one pass, bit for bit (on 1 device, and
    on 2 where the process has them); a run without the measure is refused with the setting named."""
    import jax

    from conftest import build_hf_checkpoint
    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    from isojax.errors import UserError
    from isojax.hf.loading import load_model
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner

    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, tokenizer=False)
    rng = np.random.default_rng(0)
    batches = []
    for b in range(3):
        seg = np.repeat(np.arange(1, 5), 16).reshape(2, 32).astype(np.int32)
        pos = np.tile(np.arange(16), 4).reshape(2, 32).astype(np.int32)
        batches.append((rng.integers(0, 40, (2, 32)).astype(np.int32), seg, pos))  # 40 ids: many repeats
    on = {"step_measures": {"token_norms": 1}}
    for n in sorted({1, min(2, jax.device_count())}):
        mesh = parallel.make_mesh({"data": n, "model": 1})
        loaded = load_model(tmp_path / "ckpt", dtype="float32", mesh=mesh)
        runner = lambda k: make_runner(loaded, mesh, token_stats=True, num_groups=1, skip_positions=1,
                                       step_measures=(("token_norms", 1),) if k else ())

        def feed(r, part):
            for tokens, seg, pos in part:
                r.step(tokens, seg, pos, 0)
            return r

        whole = feed(runner(1), batches)
        ckpt = checkpointing.Checkpointer(tmp_path / f"ckpt{n}")
        ckpt.save(1, feed(runner(1), batches[:1]).acc, {"settings": on, "cursor": 1, "done": {"tokens": 0}})
        ckpt.close()
        resumed = runner(1)
        assert resume(resumed, tmp_path / f"ckpt{n}", on, {})[0] == 1
        feed(resumed, batches[1:])
        assert len(jax.tree.leaves(whole.acc.step)) == 5  # IntraSim's per-token sums (3 leaves), token_norms' (2)
        for x, y in zip(jax.tree.leaves(whole.acc.step), jax.tree.leaves(resumed.acc.step), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        sums = whole.step_sums()["token_norms"]
        count, _ = whole.token_readout()
        assert int(count.sum()) == 3 * 4 * 15  # 4 sequences a batch; --skip-positions 1: 15 of their 16
        assert sums.shape == (3, 512) and np.array_equal(sums[:, count == 0], np.zeros((3, int((count == 0).sum()))))
        assert (sums[:, count > 0] > 0).all()
        with pytest.raises(UserError, match="step_measures"):
            resume(runner(0), tmp_path / f"ckpt{n}", {}, {})


def test_the_planner_counts_its_sums():
    """device/memory.py step_bytes with it on adds token_norms.step_bytes, at least its per-device sums."""
    from isojax.device import mesh as parallel
    from isojax.device.memory import step_bytes
    from isojax.device.runner import Layout
    from isojax.model.config import ModelConfig
    from isojax.model.decoder import Decoder
    from isojax.stats.measures import token_norms
    from isojax.stats.options import StatsOptions

    cfg = ModelConfig(vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    on = (("token_norms", 1),)
    added = step_bytes(cfg, "float32", 256, 1, on) - step_bytes(cfg, "float32", 256, 1)
    assert added == token_norms.step_bytes(cfg, "float32", 256, 1) > 0
    mesh = parallel.make_mesh({"data": 1, "model": 1})
    layout = Layout(Decoder(cfg), mesh, token_stats=True, num_groups=1, options=StatsOptions(step_measures=on))
    import jax
    mine = [name for name, _ in layout.options.step_measures].index("token_norms")  # after IntraSim's sums
    sums = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout.abstract.step[mine]))
    assert 8 * cfg.num_states * cfg.vocab_size == sums <= added
    off = Layout(Decoder(cfg), mesh, token_stats=False, num_groups=1, options=StatsOptions(step_measures=on))
    assert off.options.step_measures == () and off.abstract.step == ()  # without token stats: off


def test_its_flag_and_keyword_and_nothing_outside_its_file_names_it(tmp_path):
    """On by default with token stats, off with --no-token-norms / token_norms=False or without token
    stats; a bad value is one error; no module of isojax but its own names it (the step, planner, run
    and CLI reach it through the registry's Step)."""
    from isojax.extract import build_parser
    from isojax.run.config import MeasureConfig
    from isojax.stats.measures import step_settings, token_norms

    default = ("token_norms", 1) in step_settings({}, True)
    assert default == token_norms.ON_BY_DEFAULT
    assert ("token_norms", 1) not in step_settings({}, False)
    assert step_settings({"token_norms": False}, True) == step_settings({"token_norms": 0}, True)
    assert ("token_norms", 1) not in step_settings({"token_norms": False}, True)
    assert ("token_norms", 1) in step_settings({"token_norms": True}, True)
    with pytest.raises(ValueError, match="token_norms must be True or False"):
        step_settings({"token_norms": 2}, True)
    from isojax.run.config import cli_options
    ap = build_parser()
    args = ap.parse_args(["--model", "random:pythia-70m", "--out", str(tmp_path / "o"), "--no-token-norms"])
    config = MeasureConfig.build("random:pythia-70m", **cli_options(args))
    assert ("token_norms", 1) not in config.stats.step_settings()
    for path in (REPO / "isojax").rglob("*.py"):
        if path.name != "token_norms.py":
            text = path.read_text(encoding="utf-8")
            assert "token_norms" not in text, path  # (mean_norm is also a layer's metric: finalize)
