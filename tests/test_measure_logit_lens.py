"""The logit lens per layer (stats/measures/logit_lens.py) end to end against float64 references
from Hugging Face PyTorch: the hidden states of random checkpoints through the HF model's own final
norm and lm_head (GPT-NeoX: untied; GPT-2: tied to the embedding; Phi: the lm_head's bias), on every
token and with --logit-lens-every 3 on the tokens (sequence + position) % 3 == 0, on 1 and 2 CPU
devices and in bf16; off, the fields are null and the other metrics unchanged; bad flag values are
refused with one error line; a checkpoint resumes only into a run of its own setting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import need
from test_extract import run_cli
from test_streamed_measures import _build, _measure_in_subprocess

REPO = Path(__file__).resolve().parents[1]
ROW = 64
KEYS = ("logit_lens_kl", "logit_lens_entropy", "logit_lens_top1_agreement", "logit_lens_xent")


def _lens(k: int) -> tuple:
    """StatsOptions.step_measures with the logit lens on every k-th token (0: none on)."""
    return (("logit_lens", k),) if k else ()


def _documents(path: Path, n_docs: int, seed: int) -> None:
    """Moby-Dick cut into documents of 3 to 40 words (one window each at ROW tokens), of the sources
    "A" (even documents) and "B" (odd ones)."""
    words = (REPO / "tests" / "data" / "moby-dick.txt").read_text().split()
    rng, at = np.random.default_rng(seed), 0
    with open(path, "w") as f:
        for i in range(n_docs):
            k = int(rng.integers(3, 40))
            f.write(json.dumps({"text": " ".join(words[at:at + k]), "meta": {"pile_set_name": "AB"[i % 2]}}) + "\n")
            at += k


def _built(tmp: Path, family: str):
    """The random checkpoint of test_streamed_measures._build with its unembedding (tied: the
    embedding too) times 30, saved again: peaked next-token distributions (random weights give
    nearly uniform ones over 50k tokens, whose KL and top-1 would test little)."""
    torch = need("torch")
    model = _build(tmp / "ckpt", family)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    model.save_pretrained(tmp / "ckpt")
    return model


def _measure(tmp: Path, runs: list[dict], accelerator: bool = False) -> list[dict]:
    """metrics.json's document of isojax.measure for each run's keywords, in one process of 2 CPU devices."""
    return _measure_in_subprocess(tmp, runs, accelerator, row=ROW)


def _reference(model, tmp: Path, every: int, source: int | None = None) -> list[dict]:
    """Per state, the four means in float64 from Hugging Face: states (test_families.hf_states),
    the model's final norm and lm_head in float64, on the tokens of sequence i, position p with
    (i + p) % every == 0 (the documents in order: sequence i is document i); of one source's
    documents (0: "A", 1: "B") or all."""
    torch = need("torch")
    from test_families import hf_states
    from tokenizers import Tokenizer
    model = model.double()
    trunk = model.base_model
    norm = next(getattr(trunk, n) for n in ("final_layer_norm", "ln_f", "final_layernorm", "norm") if hasattr(trunk, n))
    lm_head = model.get_output_embeddings()
    tok = Tokenizer.from_file(str(tmp / "ckpt" / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in (tmp / "docs.jsonl").read_text().splitlines()]
    kl, ent, top1, xent, n, n_next = 0.0, 0.0, 0.0, 0.0, 0, 0
    for i, text in enumerate(texts):
        ids = np.array(tok.encode(text, add_special_tokens=False).ids)
        assert 0 < len(ids) <= ROW
        if source is not None and i % 2 != source:
            continue
        x = hf_states(model, ids)  # [S, T, D]
        sel = np.flatnonzero((i + np.arange(len(ids))) % every == 0)
        with torch.no_grad():
            xs = torch.as_tensor(x[:, sel])
            h = torch.cat([norm(xs[:-1]), xs[-1:]])  # final_ln: the model's output, no second norm
            lp = torch.log_softmax(lm_head(h), dim=-1).numpy()  # [S, M, V] float64
        final = lp[-1]
        kl = kl + (np.exp(final) * (final - lp)).sum(-1).sum(-1)
        ent = ent - (np.exp(lp) * lp).sum(-1).sum(-1)
        top1 = top1 + (lp.argmax(-1) == final.argmax(-1)).sum(-1)
        has_next = sel < len(ids) - 1
        xent = xent - lp[:, has_next, ids[sel[has_next] + 1]].sum(-1)
        n, n_next = n + len(sel), n_next + int(has_next.sum())
    return [dict(zip(KEYS, v)) for v in zip(kl / n, ent / n, top1 / n, xent / n_next)], n


def _check(layers, want, tol, top1_slack, what):
    for s, (layer, w) in enumerate(zip(layers, want, strict=True)):
        for key in ("logit_lens_kl", "logit_lens_entropy", "logit_lens_xent"):
            assert abs(layer[key] - w[key]) <= tol * max(0.1, abs(w[key])), (what, s, key, layer[key], w[key])
        assert abs(layer["logit_lens_top1_agreement"] - w["logit_lens_top1_agreement"]) <= top1_slack, (what, s)
    assert layers[-1]["logit_lens_kl"] == 0.0 and layers[-1]["logit_lens_top1_agreement"] == 1.0


@pytest.mark.parametrize("family", ["gpt_neox", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2: ~45 s
def test_logit_lens_equals_float64_hugging_face_on_1_and_2_devices(tmp_path, family):
    """Every token and every 3rd, 1 and 2 devices (GPT-NeoX) against the float64 reference; off: null
    fields and the other metrics as with it on."""
    model = _built(tmp_path, family)
    _documents(tmp_path / "docs.jsonl", 10, seed=1)
    one, two = {"data": 1, "model": 1}, {"data": 2, "model": 1}
    runs = [dict(mesh=one, logit_lens_every=1), dict(mesh=two, logit_lens_every=3)]
    runs += [dict(mesh=one)] if family == "gpt_neox" else []
    got = _measure(tmp_path, runs)
    for run, metrics in zip(runs[:2], got):
        k = run["logit_lens_every"]
        want, n = _reference(model, tmp_path, k)
        assert metrics["logit_lens"]["every"] == k and metrics["logit_lens"]["tokens"] == n, (run, metrics["logit_lens"])
        assert metrics["logit_lens"]["fraction"] == pytest.approx(n / metrics["tokens"])
        _check(metrics["layers"], want, 1e-5, 0.0, run)
        for g, name in enumerate("AB"):  # each source's own
            _check(metrics["sources"][name]["layers"], _reference(model, tmp_path, k, g)[0], 1e-5, 0.0, (run, name))
    if family == "gpt_neox":  # off: null, no record, the rest of the metrics as with it on
        off = got[2]
        assert "logit_lens" not in off and all(layer[k] is None for layer in off["layers"] for k in KEYS)
        assert all(layer.get(k) is None for layer in off["sources"]["A"]["layers"] for k in KEYS)
        for a, b in zip(off["layers"], got[0]["layers"], strict=True):
            assert {k: v for k, v in a.items() if k not in KEYS} == {k: v for k, v in b.items() if k not in KEYS}


@pytest.mark.slow  # ~40 s on 2 shared cores
def test_logit_lens_in_bf16_with_an_unembedding_bias(tmp_path):
    """Phi (the lm_head's bias) in float32, its parameters split over a "model" axis of 2, against the
    reference, and the accelerator configuration
    (bf16, the default sample) on 1 and 2 devices within bf16's error of it, the same tokens."""
    model = _built(tmp_path, "phi")
    _documents(tmp_path / "docs.jsonl", 8, seed=2)
    want1, n1 = _reference(model, tmp_path, 1)
    want3, n3 = _reference(model, tmp_path, 3)
    f32 = _measure(tmp_path, [dict(mesh={"data": 1, "model": 2}, logit_lens_every=1)])[0]  # params split over "model"
    _check(f32["layers"], want1, 1e-5, 0.0, "phi float32")
    runs = [dict(mesh={"data": n, "model": 1}, logit_lens_every=3) for n in (1, 2)]
    one, two = _measure(tmp_path, runs, accelerator=True)
    assert one["dtype"] == "bfloat16"
    for metrics in (one, two):
        assert metrics["logit_lens"]["tokens"] == n3
        _check(metrics["layers"], want3, 3e-2, 0.05, "phi bf16")  # bf16 states: measured <= 1e-2 relative
    for a, b in zip(one["layers"], two["layers"]):  # 1 and 2 devices: the same tokens, the same bf16 states
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["name"], k)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "x"])
def test_bad_logit_lens_every_is_one_error_line(tmp_path, value):
    proc = run_cli("--model", "random:pythia-70m", "--data", tmp_path / "none.txt", "--out", tmp_path / "out",
                   "--logit-lens-every", value)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: argument --logit-lens-every: "
                                                                            "expected a positive integer"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_logit_lens_every_through_the_api_refuses_bad_values():
    import isojax
    from isojax.errors import UserError
    for bad in (-1, 1.5, True):
        with pytest.raises(UserError, match="logit_lens_every"):
            isojax.measure("random:pythia-70m", ["x"], logit_lens_every=bad)


def test_a_checkpoint_resumes_only_into_its_own_logit_lens_setting(tmp_path):
    """Written with the lens: resumed with it, the sums are those of one pass, bit for bit; a run
    without it (and one of another K) is refused with the setting named. Written without it: a run
    without it resumes as before (no key added to the settings)."""
    import jax

    from isojax.device import checkpoints as checkpointing
    from isojax.device import mesh as parallel
    from isojax.errors import UserError
    from isojax.hf.loading import load_model
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner
    from conftest import build_hf_checkpoint

    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, tokenizer=False)
    mesh = parallel.make_mesh({"data": 1, "model": 1})
    loaded = load_model(tmp_path / "ckpt", dtype="float32", mesh=mesh)
    rng = np.random.default_rng(0)
    batches = []
    for b in range(3):
        seg = np.repeat(np.arange(1, 5), 16).reshape(2, 32).astype(np.int32)
        pos = np.tile(np.arange(16), 4).reshape(2, 32).astype(np.int32)
        batches.append((rng.integers(0, 512, (2, 32)).astype(np.int32), seg, pos, (seg - 1 + 4 * b).astype(np.int32)))
    runner = lambda k: make_runner(loaded, mesh, token_stats=False, num_groups=1, step_measures=_lens(k))

    def feed(r, part):
        for tokens, seg, pos, seq in part:
            r.step(tokens, seg, pos, 0, seq)
        return r

    whole = feed(runner(2), batches)
    ckpt = checkpointing.Checkpointer(tmp_path / "with")
    ckpt.save(1, feed(runner(2), batches[:1]).acc, {"settings": {"step_measures": {"logit_lens": 2}}, "cursor": 1,
                                                    "done": {"tokens": 0}})
    ckpt.close()
    resumed = runner(2)
    assert resume(resumed, tmp_path / "with", {"step_measures": {"logit_lens": 2}}, {})[0] == 1
    feed(resumed, batches[1:])
    for x, y in zip(jax.tree.leaves(whole.acc.step), jax.tree.leaves(resumed.acc.step), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(whole.step_sums()["logit_lens"]["tokens"].sum()) == 3 * 64 // 2
    for settings, k in (({}, 0), ({"step_measures": {"logit_lens": 3}}, 3)):
        with pytest.raises(UserError, match=f"step_measures: step measures logit_lens=2 there, {k and 'logit_lens=3' or 'none'} here"):
            resume(runner(k), tmp_path / "with", settings, {})
    ckpt = checkpointing.Checkpointer(tmp_path / "without")
    ckpt.save(1, feed(runner(0), batches[:1]).acc, {"settings": {}, "cursor": 1, "done": {"tokens": 0}})
    ckpt.close()
    plain = runner(0)
    assert plain.acc.step == () and resume(plain, tmp_path / "without", {}, {})[0] == 1
    with pytest.raises(UserError, match="step_measures"):
        resume(runner(1), tmp_path / "without", {"step_measures": {"logit_lens": 1}}, {})


def test_the_planner_counts_what_the_logit_lens_adds_to_the_step():
    """device/memory.py step_bytes with the lens on adds logit_lens.step_bytes: at least the step's
    temporary bytes that the compiled lens adds (XLA's memory analysis, CPU), at most twice them."""
    from isojax.device import mesh as parallel
    from isojax.device.ahead import compile_step
    from isojax.device.memory import step_bytes
    from isojax.device.runner import Layout
    from isojax.hf.loading import abstract_params
    from isojax.model.config import ModelConfig
    from isojax.model.decoder import Decoder
    from isojax.stats.measures import logit_lens
    from isojax.stats.options import StatsOptions

    mesh = parallel.make_mesh({"data": 1, "model": 1})
    cfg = ModelConfig(vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    temp = {}
    for k in (0, 1):
        layout = Layout(Decoder(cfg), mesh, token_stats=False, num_groups=1, options=StatsOptions(step_measures=_lens(k)))
        temp[k] = compile_step(layout, abstract_params(cfg, "float32", mesh), 4, 64)[0].memory_analysis().temp_size_in_bytes
    added = step_bytes(cfg, "float32", 256, 1, _lens(1)) - step_bytes(cfg, "float32", 256, 1)
    assert added == logit_lens.step_bytes(cfg, "float32", 256, 1)
    assert temp[1] - temp[0] <= added <= 2 * (temp[1] - temp[0]), (temp, added)


def test_a_sweep_reads_ahead_only_into_the_room_the_lens_leaves():
    """device/memory.py room_beside (a sweep's next checkpoint read onto the devices beside this one)
    leaves out the lens's step bytes too: with the lens on, the room shrinks by what the step grows
    beyond the read-out's matrices."""
    from isojax.device import mesh as parallel
    from isojax.device.memory import room_beside, step_bytes
    from isojax.model.config import ModelConfig
    from isojax.stats.finalize import READOUT_BYTES

    mesh = parallel.make_mesh({"data": 1, "model": 1})
    cfg = ModelConfig(vocab_size=50304, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096)
    tokens = 65536
    off, on = (room_beside(cfg, True, "bfloat16", 1, mesh, tokens, 0, _lens(k)) for k in (0, 1))
    grown = max(step_bytes(cfg, "bfloat16", tokens, 1, _lens(1)), READOUT_BYTES) - max(step_bytes(cfg, "bfloat16", tokens, 1),
                                                                                READOUT_BYTES)
    assert grown > 1 << 30 and off - on == grown
