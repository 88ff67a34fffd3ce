"""The streamed measures of issue 37 (massive activations, InterSim by position band) and
--skip-positions, against float64 numpy: on the accumulators directly (any batching, merged
halves, ties), and end to end on Hugging Face float64 states of random GPT-NeoX, Llama and Falcon
checkpoints over real text, on 1 and 2 CPU devices; a checkpoint resumed keeps them."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import ACCELERATOR_ENV, TOKENIZER_JSON, build_hf_checkpoint
from isojax.stats import accumulators as stats
from isojax.stats import measures
from isojax.stats.measures import massive_activations as massive
from isojax.stats.measures import position_bands as bands
from isojax.stats.options import StatsOptions
from test_extract import reference_metrics

REPO = Path(__file__).resolve().parents[1]
BANDS = ((0, 1), (1, 16), (16, 128), (128, None))
ROW = 160  # --seq-len: longer documents become windows, each starting at position 0


def _streamed_reference(x_SxNxD, ids_N, pos_N) -> list[dict]:
    """float64: massive_* (argmax of |x|; no ties in these data) and inter_sim_by_position."""
    out = []
    for x in np.asarray(x_SxNxD, np.float64):
        a = np.abs(x)
        row, dim = np.unravel_index(np.argmax(a), a.shape)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        bands = []
        for lo, hi in BANDS:
            sel = (pos_N >= lo) & (pos_N < (hi or np.inf))
            n, s = int(sel.sum()), u[sel].sum(0)
            bands.append({"lo": lo, "hi": hi, "tokens": n, "inter_sim": (s @ s - n) / (n * n - n) if n > 1 else None})
        out.append({"massive_max": a.max(), "massive_dim": int(dim), "massive_token": int(ids_N[row]),
                    "massive_position": int(pos_N[row]), "inter_sim_by_position": bands})
    return out


def _assert_streamed(got: dict, want: dict, tol: float, what) -> None:
    for key in ("massive_dim", "massive_token", "massive_position"):
        assert got[key] == want[key], (what, key, got[key], want[key])
    assert abs(got["massive_max"] - want["massive_max"]) <= tol * want["massive_max"], (what, got["massive_max"])
    for g, w in zip(got["inter_sim_by_position"], want["inter_sim_by_position"], strict=True):
        assert (g["lo"], g["hi"], g["tokens"]) == (w["lo"], w["hi"], w["tokens"]), (what, g, w)
        assert (g["inter_sim"] is None) == (w["inter_sim"] is None), (what, g, w)
        if w["inter_sim"] is not None:
            assert abs(g["inter_sim"] - w["inter_sim"]) <= tol, (what, g, w)


def _packed(rng, lengths, n):
    """positions and sequence indices of sequences of `lengths` laid end to end, cut at n."""
    pos = np.concatenate([np.arange(k) for k in lengths])[:n].astype(np.int32)
    seq = np.repeat(np.arange(len(lengths)), lengths)[:n].astype(np.int32)
    return pos, seq


def _init(s, d, vocab_size):
    """Accumulators with the streamed measures' sums in their layer part (as device/runner.py makes them)."""
    layer_steps, _ = measures.init_sums(STREAMED_ON, 1, s, vocab_size, d)
    return stats.init_accumulators(s, d).replace(layer_steps=layer_steps)


def _feed(acc, x, pos, seq, valid, batch, opts):
    """The accumulators after x's states in batches of `batch` rows, the streamed measures observed."""
    update = jax.jit(functools.partial(stats.update, opts=opts, observe=measures.observer(STREAMED_ON)))
    for start in range(0, x.shape[1], batch):
        sl = slice(start, start + batch)
        acc = update(acc, x[:, sl], (seq[sl] * 7 + pos[sl]) % 50, valid[sl], positions_N=pos[sl], sequences_N=seq[sl])
    return acc


def _read(layer_steps) -> list[dict]:
    """massive_* and inter_sim_by_position per state, of accumulators' layer_steps merged (one device's: merged)."""
    sums = [jax.tree.map(lambda x: np.asarray(x)[None], part) for part in layer_steps]
    return [{**m, **b} for m, b in zip(massive.readout(massive.merged(sums[0])), bands.readout(bands.merged(sums[1])))]


@pytest.mark.parametrize("skip", [0, 3])
def test_accumulators_match_float64_whatever_the_batching(skip):
    """massive_* and the position bands equal float64 numpy over one batch, many, and two halves
    merged (massive_* bit for bit); equal maxima go to the earliest token whatever the order it
    arrives in; skipped and padding positions count nowhere."""
    rng = np.random.default_rng(skip)
    s, n, d = 3, 2400, 16
    lengths = rng.integers(1, 300, 40)
    pos, seq = _packed(rng, lengths, n)
    valid = rng.random(n) < 0.95
    x = rng.normal(size=(s, n, d)).astype(np.float32)
    x[:, ~valid] = 1e6  # padding never counts, whatever it holds
    x[:, pos < skip] = -1e5  # nor do skipped positions
    kept = valid & (pos >= skip)
    late, early = np.flatnonzero(kept)[[-5, 700]]  # a tie: the earlier token (sequence, position) wins
    x[1, late, 2] = x[1, early, 9] = -50.0
    x[2, early, 4] = x[2, early, 1] = 60.0  # a tie within a token: the lowest dim
    want = _streamed_reference(x[:, kept], (seq * 7 + pos)[kept] % 50, pos[kept])
    assert (want[1]["massive_position"], want[1]["massive_dim"]) == (pos[early], 9) and want[2]["massive_dim"] == 1
    opts = StatsOptions(skip_positions=skip)
    init = lambda: _init(s, d, 50)
    runs = {batch: _feed(init(), x, pos, seq, valid, batch, opts) for batch in (240, 800, n)}
    half = n // 2
    halves = [_feed(init(), x[:, sl], pos[sl], seq[sl], valid[sl], 400, opts)
              for sl in (slice(half, n), slice(0, half))]
    runs["merged"] = jax.jit(stats.merge)(*halves)
    first = None
    for name, acc in runs.items():
        got = _read(jax.device_get(acc.layer_steps))
        for s_, (g, w) in enumerate(zip(got, want)):
            _assert_streamed(g, w, 1e-6, (name, s_))
        massive = [(g["massive_max"], g["massive_dim"], g["massive_position"]) for g in got]
        assert first is None or massive == first, name
        first = massive


def _documents(path: Path, n_docs: int, seed: int) -> None:
    """Moby-Dick cut into documents of 2 to 120 words (a few make two windows of ROW tokens)."""
    words = (REPO / "tests" / "data" / "moby-dick.txt").read_text().split()
    rng, at = np.random.default_rng(seed), 0
    with open(path, "w") as f:
        for i in range(n_docs):
            k = int(rng.integers(2, 120)) if i % 8 != 3 else int(rng.integers(150, 200))
            f.write(json.dumps({"text": " ".join(words[at:at + k])}) + "\n")
            at += k


def _build(directory: Path, family: str):
    from test_families import SHAPES, build
    if family == "gpt_neox":
        return build_hf_checkpoint(directory, vocab_size=50304, hidden_size=64, num_layers=2, num_heads=4)
    return build(directory, family, tokenizer=True, **dict(SHAPES[family][0], vocab_size=50304))


def _measure_in_subprocess(tmp: Path, runs: list[dict], accelerator: bool = False, row: int = ROW,
                           read: str = "r.metrics") -> list:
    """`read` (an expression of the Results r; default its metrics) of isojax.measure for each run's
    keywords, in one process of 2 CPU devices (rows of `row` tokens, 4 a batch)."""
    script = textwrap.dedent(f"""
        import json, sys
        import isojax
        runs = (isojax.measure({str(tmp / "ckpt")!r}, [{str(tmp / "docs.jsonl")!r}], unit="document", seq_len={row},
                               batch_tokens=4 * {row}, progress=False, **kw) for kw in {runs!r})
        out = [{read} for r in runs]
        json.dump(out, sys.stdout)
    """)
    env = {**os.environ, "ISOJAX_CACHE": str(tmp / "cache"), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", **(ACCELERATOR_ENV if accelerator else {})}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # 115 s for llama on 2 shared cores: four runs
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "falcon"])
def test_measures_match_float64_hugging_face_states(tmp_path, family):
    """On 1 and 2 devices, massive_*, inter_sim_by_position and the spectral measures (isoscore,
    isoscore_star, alpha_req, rogue_dims, feature_kurtosis) equal those of Hugging Face's float64
    states; with skip_positions 1 every measure (InterSim, IntraSim, anisotropy, massive_*, the
    bands) equals the reference without each sequence's first token."""
    from test_families import hf_states
    from test_spectral_measures import check as check_spectral
    from test_spectral_measures import reference as spectral_reference
    from tokenizers import Tokenizer

    model = _build(tmp_path / "ckpt", family).double()
    _documents(tmp_path / "docs.jsonl", 24, seed=1)
    tok = Tokenizer.from_file(str(tmp_path / "ckpt" / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in (tmp_path / "docs.jsonl").read_text().splitlines()]
    ids = [np.array(tok.encode(t, add_special_tokens=False).ids) for t in texts]
    windows = [i[k:k + ROW] for i in ids for k in range(0, len(i), ROW)]
    assert max(map(len, ids)) > ROW  # some documents make two windows
    states = [hf_states(model, w) for w in windows]
    mesh1, mesh2 = {"data": 1, "model": 1}, {"data": 2, "model": 1}
    runs = [dict(mesh=m, skip_positions=k) for k in (0, 1) for m in (mesh1, mesh2)]
    got = _measure_in_subprocess(tmp_path, runs)
    for run, metrics in zip(runs, got):
        k = run["skip_positions"]
        kept = [(st[:, k:], w[k:]) for st, w in zip(states, windows) if len(w) > k]
        x = np.concatenate([st for st, _ in kept], axis=1)
        ids_kept = np.concatenate([w for _, w in kept])
        pos = np.concatenate([np.arange(k, k + len(w)) for _, w in kept])
        want = _streamed_reference(x, ids_kept, pos)
        base = reference_metrics([st for st, _ in kept], [w for _, w in kept])
        assert metrics["tokens"] == sum(map(len, ids))
        for s, (layer, w, b) in enumerate(zip(metrics["layers"], want, base, strict=True)):
            what = (run, layer["name"])
            assert layer["count"] == len(ids_kept), what
            _assert_streamed(layer, w, 1e-6, what)
            for key in ("inter_sim", "intra_sim", "anisotropy"):
                assert abs(layer[key] - b[key]) <= 1e-6, (what, key, layer[key], b[key])
            # the spectral measures (IsoScore against the isoscore package, the others float64 numpy)
            check_spectral(layer, spectral_reference(x[s]), what=what)  # final_ln too: the spectral floor
    for one, two in ((got[0], got[1]), (got[2], got[3])):  # 1 and 2 devices: massive_* bit for bit
        for a, b in zip(one["layers"], two["layers"]):
            assert {k: a[k] for k in a if k.startswith("massive")} == {k: b[k] for k in b if k.startswith("massive")}


@pytest.mark.slow  # 70 s on 2 shared cores
def test_accelerator_configuration_merges_alike_on_1_and_2_devices(tmp_path):
    """bfloat16 with the default sample (a GPU run's configuration): 1 and 2 devices give the same
    massive_* and position bands, skipping 2 positions."""
    _build(tmp_path / "ckpt", "gpt_neox")
    _documents(tmp_path / "docs.jsonl", 24, seed=2)
    runs = [dict(mesh={"data": n, "model": 1}, skip_positions=2) for n in (1, 2)]
    one, two = _measure_in_subprocess(tmp_path, runs, accelerator=True)
    assert one["dtype"] == "bfloat16"
    for a, b in zip(one["layers"], two["layers"], strict=True):
        assert a["inter_sim_by_position"][0] == {"lo": 0, "hi": 1, "tokens": 0, "inter_sim": None}
        assert {k: a[k] for k in a if k.startswith("massive")} == {k: b[k] for k in b if k.startswith("massive")}
        for x, y in zip(a["inter_sim_by_position"][1:], b["inter_sim_by_position"][1:]):
            assert x["tokens"] == y["tokens"] and abs(x["inter_sim"] - y["inter_sim"]) <= 1e-6, (a["name"], x, y)


# StatsOptions.step_measures by default without token stats (measures.step_settings)
STREAMED_ON = (("massive_activations", 1), ("position_bands", 1))


def _runner_batches(tmp_path):
    """(a LoadedModel of a random 1-layer checkpoint, its mesh, 4 batches of packed rows)."""
    from isojax.device import mesh as parallel
    from isojax.hf.loading import load_model

    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, tokenizer=False)
    mesh = parallel.make_mesh({"data": 1, "model": 1})
    loaded = load_model(tmp_path / "ckpt", dtype="float32", mesh=mesh)
    rng = np.random.default_rng(0)
    batches = []
    for b in range(4):
        lengths = [int(k) for k in rng.integers(1, 40, 8)]
        pos, seq = _packed(rng, lengths, 4 * 64)
        seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:4 * 64]
        seg = np.pad(seg, (0, 4 * 64 - len(seg)))  # padding at the end
        tokens = rng.integers(0, 512, 4 * 64) * (seg > 0)
        batches.append([np.pad(a, (0, 4 * 64 - len(a))).reshape(4, 64).astype(np.int32)
                        for a in (tokens, seg, pos, seq + 100 * b)])
    return loaded, mesh, batches


def checkpoint_by_older_code(tmp_path, commit: str, batches, runner_args: str, older_layout: str) -> None:
    """tmp_path/checkpoint: step 2, written after the first 2 of `batches` by `commit`'s isojax (git archive, run
    in a subprocess) with make_runner(the model at tmp_path/ckpt, mesh, <runner_args>: keyword arguments' source);
    older_layout: an expression of `runner` asserting that the accumulators have the older layout."""
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(["git", "archive", commit, "isojax"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    np.savez(tmp_path / "batches.npz", *[a for batch in batches[:2] for a in batch])
    script = textwrap.dedent(f"""
        import numpy as np
        from isojax.device import checkpoints as checkpointing
        from isojax.device import mesh as parallel
        from isojax.hf.loading import load_model
        from isojax.run.measure import make_runner
        mesh = parallel.make_mesh({{"data": 1, "model": 1}})
        runner = make_runner(load_model({str(tmp_path / "ckpt")!r}, dtype="float32", mesh=mesh), mesh, {runner_args})
        assert {older_layout}  # the older layout
        arrays = np.load({str(tmp_path / "batches.npz")!r})
        batches = [arrays[f"arr_{{i}}"] for i in range(len(arrays.files))]
        for k in range(0, len(batches), 4):
            runner.step(*batches[k:k + 3], 0, batches[k + 3])
        ckpt = checkpointing.Checkpointer({str(tmp_path / "checkpoint")!r})
        ckpt.save(2, runner.acc, {{"settings": {{"skip_positions": 1}}, "cursor": 2, "done": {{"tokens": 0}}}})
        ckpt.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(old), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_resumed_checkpoint_keeps_the_streamed_fields(tmp_path):
    """A checkpoint written after two batches and resumed (loop.resume) ends with the accumulators
    of one uninterrupted pass: massive_* and the position bands bit for bit."""
    from isojax.device import checkpoints as checkpointing
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner

    loaded, mesh, batches = _runner_batches(tmp_path)
    runner = lambda: make_runner(loaded, mesh, token_stats=False, num_groups=1, skip_positions=1,
                                 step_measures=STREAMED_ON)

    def feed(r, part):
        for tokens, seg, pos, seq in part:
            r.step(tokens, seg, pos, 0, seq)
        return r

    whole = feed(runner(), batches)
    settings = {"skip_positions": 1, "step_measures": dict(STREAMED_ON)}  # as run.measure records them
    ckpt = checkpointing.Checkpointer(tmp_path / "checkpoint")
    ckpt.save(2, feed(runner(), batches[:2]).acc, {"settings": settings, "cursor": 2, "done": {"tokens": 0}})
    ckpt.close()
    resumed = runner()
    cursor, _ = resume(resumed, tmp_path / "checkpoint", settings, {})
    assert cursor == 2
    feed(resumed, batches[2:])
    a = whole.merged_layers()
    sums = whole.step_sums(a)
    for name, of_name in sums.items():
        for key, x in of_name.items():
            np.testing.assert_array_equal(x, resumed.step_sums()[name][key], err_msg=(name, key))
    got = [{**m, **b} for m, b in zip(massive.readout(sums["massive_activations"]),
                                      bands.readout(sums["position_bands"]))]
    assert got[0]["inter_sim_by_position"][0]["tokens"] == 0 and got[0]["massive_position"] >= 1
    assert sum(band["tokens"] for band in got[0]["inter_sim_by_position"]) == int(a.count_lo_GxS[0, 0])


def test_a_checkpoint_of_the_older_layout_is_refused_or_resumes_exactly(tmp_path):
    """A checkpoint written by isojax before massive activations and the position bands became step measures
    (issue 46; the code of ef52073, its accumulators holding massive_max_GxS, band_unit_sum_BxSxD, ...) is
    refused in one UserError saying so where they are on (the default); with them off it resumes, its
    sums bit for bit those of one uninterrupted pass."""
    from isojax.errors import UserError
    from isojax.run.loop import resume
    from isojax.run.measure import make_runner

    loaded, mesh, batches = _runner_batches(tmp_path)
    checkpoint_by_older_code(tmp_path, "ef52073", batches, "token_stats=False, num_groups=1, skip_positions=1",
                             'hasattr(runner.acc, "massive_max_GxS")')
    on = make_runner(loaded, mesh, token_stats=False, num_groups=1, skip_positions=1, step_measures=STREAMED_ON)
    with pytest.raises(UserError, match="the checkpoint was written by an older isojax, before massive_activations, "
                                        "position_bands became step measures .* start over with --overwrite"):
        resume(on, tmp_path / "checkpoint", {"skip_positions": 1, "step_measures": dict(STREAMED_ON)}, {})
    off = lambda: make_runner(loaded, mesh, token_stats=False, num_groups=1, skip_positions=1)
    resumed, whole = off(), off()
    assert resume(resumed, tmp_path / "checkpoint", {"skip_positions": 1}, {})[0] == 2
    for r, part in ((resumed, batches[2:]), (whole, batches)):
        for tokens, seg, pos, seq in part:
            r.step(tokens, seg, pos, 0, seq)
    a, b = whole.merged_layers(), resumed.merged_layers()
    for field in ("count_lo_GxS", "sum_GxSxD", "unit_sum_GxSxD", "norm_sum_GxS"):
        for x, y in zip(jax.tree.leaves(getattr(a, field)), jax.tree.leaves(getattr(b, field))):
            np.testing.assert_array_equal(x, y, err_msg=field)


def test_skip_positions_beyond_every_sequence_is_refused(tmp_path, monkeypatch):
    """The longest sequence is named, from a finished cache and from one still tokenizing, before
    any measuring; a shorter skip passes; a negative --skip-positions is an argparse error."""
    from isojax.data import load_corpus, stream_tokens, tokenize_corpus
    from isojax.errors import UserError
    from tokenizers import Tokenizer
    from isojax.run.measure import check_skip_positions
    from test_extract import run_cli

    _documents(tmp_path / "docs.jsonl", 24, seed=3)
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    corpus = load_corpus([tmp_path / "docs.jsonl"], unit="document")
    stream = stream_tokens(corpus, tok, cache_dir=tmp_path / "cache", max_len=ROW)
    longest = int(np.diff(tokenize_corpus(corpus, tok, cache_dir=tmp_path / "other", max_len=ROW).offsets).max())
    assert longest == ROW  # a document longer than the row: windows of ROW tokens
    check_skip_positions(stream, ROW - 1)
    cache = stream.result()
    for tokens in (stream, cache):
        with pytest.raises(UserError, match=f"the longest sequence is {ROW} tokens long"):
            check_skip_positions(tokens, ROW)
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    proc = run_cli("--model", tmp_path / "ckpt", "--data", tmp_path / "docs.jsonl", "--unit", "document", "--seq-len",
                   "32", "--skip-positions", "32", "--out", tmp_path / "out", env={"ISOJAX_CACHE": str(tmp_path / "c")})
    assert proc.returncode == 2 and "error: skip_positions 32 leaves out every token: the longest sequence is 32" \
        in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.json").exists()
    proc = run_cli("--skip-positions", "-1", "--out", tmp_path / "out")
    assert proc.returncode == 2 and "expected a non-negative integer" in proc.stderr, proc.stderr[-2000:]
