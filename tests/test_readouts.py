"""The accumulators' read-outs that run/ uses (no field access from run/), a LoadedModel that
measure() leaves as it was, and the CLI's free-space check, which reads the sample the run's plan
keeps (one decision: run/plan.py run_sample)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from conftest import build_hf_checkpoint


def test_layer_count_and_means_against_float64_numpy():
    """Accumulators.layer_count and .means over two groups: numpy's count and float64 mean of the
    valid states fed (small integers and halves: every float32 sum exact, so the means agree to
    float64's rounding)."""
    from isojax.stats import accumulators as stats
    rng = np.random.default_rng(0)
    s, d, n = 3, 8, 300
    acc = stats.init_accumulators(s, d, num_groups=2)
    fed = []
    for group in (0, 1, 0):
        x = (rng.integers(-40, 60, (s, n, d)) / 2).astype(np.float32)
        valid = rng.random(n) < 0.8
        acc = stats.update(acc, x, np.zeros(n, np.int32), valid, group=group)
        fed.append(x[:, valid].astype(np.float64))
    acc = acc.replace(count_lo_GxS=np.asarray(acc.count_lo_GxS), count_hi_GxS=np.asarray(acc.count_hi_GxS))
    everything = np.concatenate(fed, axis=1)
    assert acc.layer_count().tolist() == [everything.shape[1]] * s
    assert acc.gram_slots() == 2
    np.testing.assert_allclose(acc.means(), everything.mean(1), rtol=0, atol=1e-12)


def test_runner_gives_the_merged_grams_shape_and_device_for_compile_ahead(tmp_path):
    """Runner.gram_shape and .readout_device: the shape and device of the second moments that
    merged_layers hands finalize (per-source Grams: H = 2), which finalize.compile_ahead takes; the
    Grams and the sample's states are committed with that device's SingleDeviceSharding, the one the
    read-outs are compiled ahead for (jit compiles again for any other: on a mesh of one device they
    had come back with a NamedSharding, and a cached 410m run's first finalize compiled every read-out
    twice)."""
    from jax.sharding import SingleDeviceSharding

    from isojax.device import mesh as parallel
    from isojax.hf.loading import load_model
    from isojax.run.measure import make_runner
    from isojax.stats import finalize

    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, tokenizer=False)
    mesh = parallel.make_mesh({"data": 1, "model": 1})
    loaded = load_model(tmp_path / "ckpt", mesh=mesh)
    runner = make_runner(loaded, mesh, token_stats=False, num_groups=2, sample_size=16)
    gram = runner.merged_layers().m2_HxSxDxD.hl
    assert runner.gram_shape() == gram.shape[:-1] == (2, 3, 32, 32)
    assert {runner.readout_device()} == gram.devices()
    on = SingleDeviceSharding(runner.readout_device())
    assert gram.sharding == on and runner.sample()[1](0).sharding == on
    finalize.compile_ahead(runner.gram_shape(), 2, 0, runner.readout_device())


def _corpus(path, words: int, seed: int):
    rng = np.random.default_rng(seed)
    vocab = ["the", "model", "state", "token", "layer", "corpus", "geometry", "cosine", "mean", "sample"]
    lines = [" ".join(rng.choice(vocab, 24)) + "." for _ in range(words // 24)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("defaults", ["cpu", "gpu"])
def test_free_space_check_counts_the_runs_sample_and_measure_leaves_the_model(tmp_path, monkeypatch, defaults):
    """With ISOJAX_DEFAULTS=cpu (no default sample) and =gpu (the default sample, cut to max_tokens):
    the free-space check refuses exactly where the disk holds less than output_bytes of the sample
    the run kept. measure() of a LoadedModel (bfloat16, centered) leaves its params and every
    other field as they were."""
    import isojax.extract as extract
    from isojax.errors import UserError
    from isojax.hf.loading import load_model
    from isojax.run.config import MeasureConfig
    from isojax.run.measure import measure
    from isojax.run.results import output_bytes

    monkeypatch.setenv("ISOJAX_DEFAULTS", defaults)
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    data = [str(_corpus(tmp_path / "words.txt", 12000, seed=1))]
    options = dict(seq_len=128, batch_tokens=1024, max_tokens=4096, centered=True)
    loaded = load_model(tmp_path / "ckpt", dtype="float32")
    loaded.tokenizer  # loaded on first use, it adds where it came from to loaded.source
    fields = lambda: {f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded) if f.name != "params"}
    params, before = loaded.params, copy.deepcopy(fields())
    results = measure(loaded, data, dtype="bfloat16", **options)
    assert loaded.params is params
    assert fields() == before  # measure never changes the LoadedModel it is given
    assert results.metrics["dtype"] == "bfloat16"
    assert results.manifest["corpus_options"] == {"unit": "sentence", "sources": None, "max_tokens": 4096,
                                                  "max_tokens_per_source": None}  # what collect names (48.11)
    assert all(layer["centered_inter_sim"] is not None for layer in results.layers)
    assert results.manifest["kernels"] == {"attention": "xla", "mlp": "xla", "norm": "xla"}  # CPU
    assert results.manifest["kernel_reasons"]["attention"] == "auto: xla for this backend and dtype"
    assert "LayerNorm-pair kernel does not apply" in results.manifest["kernel_reasons"]["norm"]

    sample = results.manifest["settings"]["sample_states"]
    assert sample == (4096 if defaults == "gpu" else 0)  # the default sample, cut to max_tokens
    config = MeasureConfig.build(str(tmp_path / "ckpt"), data, dtype="bfloat16", **options)
    need = output_bytes(loaded.config, token_stats=True, save_token_sums=False, sample_states=sample)
    for free, refused in ((need, False), (need - 1, True)):
        monkeypatch.setattr(extract.shutil, "disk_usage", lambda _, free=free: type("Usage", (), {"free": free}))
        if refused:
            with pytest.raises(UserError, match="free"):
                extract.check_free_space(tmp_path / "out", config)
        else:
            extract.check_free_space(tmp_path / "out", config)
