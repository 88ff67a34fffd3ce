"""Flax GPT-NeoX vs Hugging Face PyTorch: all L+2 hidden states, packed rows, preset shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build_hf_checkpoint, hf_states, max_rel_error
from isojax import load_model
from isojax.hf.family import from_hf_dict
from isojax.hf.family.presets import preset, preset_names
from isojax.errors import UserError
from isojax.model.decoder import param_shapes

# (hidden, heads, layers, rotary_pct, parallel residual, activation): head dims 64, 80, 128, 256;
# pythia-2.8b's 80-dim heads have 20 rotary dims.
SHAPES = [
    (128, 2, 2, 0.25, True, "gelu"),
    (160, 2, 2, 0.25, False, "gelu"),
    (256, 2, 3, 0.5, True, "gelu_new"),
    (256, 1, 2, 1.0, False, "gelu"),
]


@pytest.mark.parametrize("hidden,heads,layers,pct,parallel,act", SHAPES)
def test_states_match_hugging_face(tmp_path, hidden, heads, layers, pct, parallel, act):
    model = build_hf_checkpoint(tmp_path, seed=hidden + layers, vocab_size=700, hidden_size=hidden,
                                num_heads=heads, num_layers=layers, rotary_pct=pct, parallel=parallel,
                                hidden_act=act)
    ours = load_model(tmp_path)
    assert ours.config.head_dim == hidden // heads
    ids = np.random.default_rng(hidden).integers(0, 700, size=61)
    got = ours.hidden_states(ids)
    ref = hf_states(model, ids)
    assert got.shape == (layers + 2, 61, hidden)
    for s, name in enumerate(ours.config.state_names):
        assert max_rel_error(got[s], ref[s]) < 1e-5, name
    # The raw last block differs from the final LayerNorm (the state Hugging Face drops).
    assert max_rel_error(got[-2], ref[-1]) > 1e-2


def test_packed_rows_equal_separate_sequences(tiny_checkpoint):
    path, _ = tiny_checkpoint
    ours = load_model(path)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 512, size=n) for n in (7, 1, 19, 12)]
    t = 48
    tokens, seg, pos = (np.zeros((2, t), np.int32) for _ in range(3))
    placement, row, col = [], 0, 0
    for i, s in enumerate(seqs):
        if col + len(s) > t:
            row, col = row + 1, 0
        tokens[row, col:col + len(s)] = s
        seg[row, col:col + len(s)] = i + 1
        pos[row, col:col + len(s)] = np.arange(len(s))
        placement.append((row, col))
        col += len(s)
    packed = ours.hidden_states_packed(tokens, seg, pos)
    for s, (row, col) in zip(seqs, placement):
        alone = ours.hidden_states(s)
        np.testing.assert_allclose(packed[:, row, col:col + len(s)], alone, rtol=0, atol=2e-5)


def test_packed_rows_refuse_a_sequence_in_two_runs(tiny_checkpoint):
    path, _ = tiny_checkpoint
    ours = load_model(path)
    tokens = np.ones((1, 8), np.int32)
    with pytest.raises(UserError, match="contiguous run"):
        ours.hidden_states_packed(tokens, np.array([[1, 1, 2, 2, 1, 1, 0, 0]]), np.zeros((1, 8), np.int32))


@pytest.mark.slow
def test_bfloat16_states_within_documented_tolerance(tiny_checkpoint):
    """bf16 compute (bf16 weights, float32 LayerNorm statistics and softmax): per-vector relative
    error against float32 under 3e-2 (README: 'bfloat16'); typical values are ~1e-2."""
    path, model = tiny_checkpoint
    ids = np.random.default_rng(2).integers(0, 512, size=40)
    got = load_model(path, dtype="bfloat16").hidden_states(ids)
    ref = hf_states(model, ids)
    errors = [max_rel_error(got[s], ref[s]) for s in range(len(ref))]
    assert max(errors) < 3e-2, errors
    assert max(errors) > 1e-5  # it really ran in bfloat16


# Published total parameter counts (Pythia paper, Table 1 / model cards).
PUBLISHED_PARAMS = {
    "pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632, "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016, "pythia-12b": 11_846_072_320, "gpt-neox-20b": 20_554_567_680,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts(name):
    assert name in preset_names()
    shapes = param_shapes(preset(name))  # jax.eval_shape: nothing allocated
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == PUBLISHED_PARAMS[name]


def test_config_allowlist_refuses_unknown_attributes():
    good = {"model_type": "gpt_neox", "vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "rotary_pct": 0.25, "use_cache": True}
    assert from_hf_dict(good).rotary_dims == 4
    for bad in ({"rope_scaling": {"type": "linear", "factor": 2.0}}, {"attention_bias": False},
                {"some_new_feature": 1}, {"model_type": "llama"}, {"hidden_act": "silu"}, {"rotary_pct": 0.1},
                {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}):
        with pytest.raises(UserError):
            from_hf_dict({**good, **bad})


def test_unknown_model_lists_presets():
    with pytest.raises(UserError, match="pythia-1.4b"):
        load_model("no-such-model")


@pytest.mark.slow
def test_fast_gelu_of_bfloat16_against_the_float64_gelu():
    """bf16 forwards use model.fast_erf (within 5e-7 of erf). The bf16 GELU it gives is the
    float64 GELU rounded to bf16 (as PyTorch's bf16 GELU, computed in float32) up to 2e-6
    absolute: for u >= 0 it is the same value except at rare rounding ties; for u < 0 the
    0.5 (1 + erf) cancellation can move a small |GELU| by one bf16 ulp. jax.nn.gelu in bf16
    arithmetic, the path it replaces, is off by an ulp five times as often."""
    import math

    import jax.numpy as jnp

    from isojax.numerics import fast_erf, gelu

    erf = np.vectorize(math.erf)
    x = np.linspace(-8.0, 8.0, 400_001)
    assert np.abs(np.asarray(fast_erf(jnp.asarray(x, jnp.float32)), np.float64) - erf(x)).max() < 5e-7

    u = np.random.default_rng(0).normal(0, 3, 1_000_000).astype(jnp.bfloat16)
    u64 = u.astype(np.float64)
    exact = u64 * 0.5 * (1 + erf(u64 / math.sqrt(2)))
    want = exact.astype(jnp.bfloat16).astype(np.float64)
    got = np.asarray(gelu(jnp.asarray(u), approximate=False))
    assert got.dtype == jnp.bfloat16
    got = got.astype(np.float64)
    half_ulp = np.abs(exact) * 2.0 ** -8  # bf16: 8 significant bits
    assert (np.abs(got - exact) <= half_ulp * 1.01 + 2e-6).all()
    pos = u64 >= 0
    assert (got[pos] != want[pos]).mean() < 1e-3
    plain = np.asarray(jax.nn.gelu(jnp.asarray(u), approximate=False)).astype(np.float64)
    assert (got != want).mean() < 0.25 * (plain != want).mean()  # measured: 7.7% vs 41%


@pytest.mark.slow
def test_pallas_tpu_attention_with_segment_ids_in_interpret_mode():
    """The TPU path (Pallas flash attention with segment ids) gives the states of the plain XLA
    attention on packed rows, run in Pallas' TPU interpret mode on the CPU."""
    from jax.experimental.pallas import tpu as pltpu

    from isojax.model.config import ModelConfig
    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder, collect_states
    from isojax.model.options import ForwardOptions

    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                        rotary_pct=0.25, max_position_embeddings=256)
    params = random_params(cfg, seed=3)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 300, (2, 128)).astype(np.int32)
    seg = np.repeat(np.arange(1, 5), 32)[None].repeat(2, 0).astype(np.int32)
    seg[1, 100:] = 0  # padding at the end of the second row
    pos = np.tile(np.arange(32), 4)[None].repeat(2, 0).astype(np.int32)
    buf = jnp.zeros((cfg.num_states, 2, 128, 64))
    states = {}
    for attention in ("xla", "pallas"):
        module = Decoder(cfg, options=ForwardOptions(attention=attention))
        with pltpu.force_tpu_interpret_mode():
            states[attention] = np.asarray(module.apply({"params": params}, tokens, seg, pos, buf, collect_states))
    real = seg > 0
    assert max_rel_error(states["pallas"][:, real], states["xla"][:, real]) < 1e-5
