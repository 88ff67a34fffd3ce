"""The packed attention kernel (isojax.kernels.packed_attention), in Pallas' interpret mode on CPU (and
compiled where a GPU is): its rotary equals Hugging Face's bf16 rotary bit for bit, its output
lands within bf16 rounding of float64 attention on packed rows whose sequences cross blocks (also
without rotary, with OLMo's clip and OLMo-2's q/k norms; the families' model states are in
tests/test_families.py), and the model's states with it equal those with plain attention; per
device under a mesh; explicit choices it cannot honour are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_error
from isojax.kernels import packed_attention
from isojax.model.config import ModelConfig
from isojax.numerics import apply_rotary, attention_xla, rotary_tables, segment_mask

gpu = pytest.mark.gpu  # skipped without a GPU (conftest)


def packed_rows(lengths_per_row, t):
    seg, pos = np.zeros((len(lengths_per_row), t), np.int32), np.zeros((len(lengths_per_row), t), np.int32)
    for b, lengths in enumerate(lengths_per_row):
        c = 0
        for i, n in enumerate(lengths):
            seg[b, c:c + n], pos[b, c:c + n] = i + 1, np.arange(n)
            c += n
    return seg, pos


def inputs(b, t, h, k, pct, lengths_per_row, seed=0):
    cfg = ModelConfig(vocab_size=8, hidden_size=h * k, num_layers=1, num_heads=h, intermediate_size=8,
                        rotary_pct=pct, max_position_embeddings=4096)
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(b, t, h, 3, k)) * 2, jnp.bfloat16)
    seg, pos = packed_rows(lengths_per_row, t)
    cos, sin = rotary_tables(jnp.asarray(pos), cfg)
    return qkv, cos, sin, jnp.asarray(seg)


def test_rotation_by_halves_is_hugging_faces_bf16_rotary_bit_for_bit():
    """_rotate_halves (rotary dims >= 64, where the kernel rotates without the [R, R] product) equals
    model.apply_rotary on the rotary dims, for partial and full rotary."""
    for k, r in ((128, 64), (64, 64), (128, 128)):
        qkv, cos, sin, _ = inputs(2, 64, 2, k, r / k, [[64], [30, 34]], seed=k + r)
        x = qkv[..., 1, :]
        want = apply_rotary(x, cos, sin)[..., :r]
        c, s = (a[:, :, None, :].astype(jnp.bfloat16) for a in (cos, sin))
        h = r // 2
        got = packed_attention._rotate_halves(x[..., :h], x[..., h:r], c[..., :h], c[..., h:], s[..., :h], s[..., h:])
        np.testing.assert_array_equal(np.asarray(jnp.concatenate(got, -1), np.float32), np.asarray(want, np.float32))


@pytest.mark.slow
def test_rotation_is_hugging_faces_bf16_rotary_bit_for_bit():
    """The kernel's rotate-half (a signed-permutation product, then HF's three bf16 roundings)
    equals model.apply_rotary on the rotary dims."""
    for k, r in ((64, 16), (128, 32), (32, 32)):
        qkv, cos, sin, _ = inputs(2, 64, 2, k, r / k, [[64], [30, 34]], seed=k)
        x = qkv[..., 0, :]
        want = apply_rotary(x, cos, sin)[..., :r]
        p = jnp.asarray(packed_attention.rotate_half_matrix(r), jnp.bfloat16)
        c, s = (a[:, :, None, :].astype(jnp.bfloat16) for a in (cos, sin))
        got = packed_attention._rotate(x[..., :r], c, s, p)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_segment_starts():
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2]], np.int32)
    want = np.array([[0, 0, 0, 3, 3, 5, 6, 6], [0, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(packed_attention.segment_starts(jnp.asarray(seg))), want)


# (B, T, H, K, rotary pct, blocks, sequences per row): sequences that start and end inside
# blocks and span several, a row of one sequence (nothing skipped), padding at a row's end.
CASES = [
    (2, 128, 2, 64, 0.25, (32, 32), [[5, 40, 70, 13], [100, 3, 9]]),
    (1, 128, 1, 128, 0.25, (64, 32), [[128]]),
    (2, 64, 2, 32, 1.0, (16, 32), [[1, 1, 17, 45], [33, 20]]),
    (1, 256, 2, 64, 0.5, (32, 64), [[3] * 20 + [150, 40]]),
    # rotary dims >= 64: rotated by halves, with (R < K) and without (R = K) the other columns' product
    (1, 128, 2, 128, 0.5, (64, 64), [[60, 68]]),
    (1, 64, 1, 64, 1.0, (32, 32), [[20, 44]]),
]


@pytest.mark.slow
@pytest.mark.parametrize("b,t,h,k,pct,blocks,lengths", CASES)
def test_kernel_within_bf16_rounding_of_float64(b, t, h, k, pct, blocks, lengths):
    """Against float64 attention of the same biased, rotated q and k: the kernel's error is that of bf16
    roundings of the probabilities and the output (one ulp is 2^-8 relative), on CPU and GPU."""
    qkv, cos, sin, seg = inputs(b, t, h, k, pct, lengths, seed=t + k)
    bias = jnp.asarray(np.random.default_rng(k).normal(size=(h, 3, k)), jnp.bfloat16)
    got = np.asarray(packed_attention.attention(qkv, cos, sin, seg, bias, block_q=blocks[0], block_k=blocks[1])
                     .astype(jnp.float32), np.float64)  # compiled on a GPU, interpreted elsewhere
    want = packed_attention.reference(qkv, cos, sin, seg, bias)
    qkv = qkv + bias
    q, kk = (apply_rotary(qkv[..., i, :], cos, sin) for i in (0, 1))
    plain = np.asarray(attention_xla(q, kk, qkv[..., 2, :], segment_mask(seg), None).astype(jnp.float32))
    real = np.asarray(seg) > 0
    scale = np.abs(want[real]).max()
    err, plain_err = np.abs(got - want)[real].max() / scale, np.abs(plain - want)[real].max() / scale
    print(f"kernel {err:.2e}, plain bf16 attention {plain_err:.2e}")
    assert err < 2 ** -7, (err, plain_err)



def grouped_as_per_head(qkv_BxTxNxK, h):
    """[B, T, H + 2G, K] ([q heads | k heads | v heads]) -> GPT-NeoX's [B, T, H, 3, K], each key and
    value head copied to the H / G query heads it serves (Hugging Face's repeat_kv)."""
    g = (qkv_BxTxNxK.shape[2] - h) // 2
    q, k, v = qkv_BxTxNxK[:, :, :h], qkv_BxTxNxK[:, :, h:h + g], qkv_BxTxNxK[:, :, h + g:]
    return jnp.stack([q, jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)], axis=3)


# (H, G, K, rotary pct, sequences per row): multi-query, grouped, and multi-head in the grouped layout
GROUPED = [(4, 2, 32, 0.5, [[20, 30, 14]]), (4, 2, 64, 1.0, [[30, 34]]), pytest.param(4, 1, 32, 1.0, [[64]], marks=pytest.mark.slow),
           pytest.param(2, 2, 16, 1.0, [[7, 50]], marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("h,g,k,pct,lengths", GROUPED)
def test_grouped_kernel_within_bf16_rounding_of_float64(h, g, k, pct, lengths):
    """attention_grouped (G key/value heads for H query heads, read in place) against float64
    attention of the same heads with k and v copied per group (the reference of the per-head kernel)."""
    _, cos, sin, seg = inputs(1, 64, h, k, pct, lengths)
    rng = np.random.default_rng(h * 10 + g)
    qkv = jnp.asarray(rng.normal(size=(1, 64, h + 2 * g, k)) * 2, jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=(h + 2 * g, k)), jnp.bfloat16)
    got = np.asarray(packed_attention.attention_grouped(qkv, cos, sin, seg, bias, num_heads=h, block_q=32, block_k=32)
                     .astype(jnp.float32), np.float64)
    bias_Hx3xK = grouped_as_per_head(bias[None, None], h)[0, 0]
    want = packed_attention.reference(grouped_as_per_head(qkv, h), cos, sin, seg, bias_Hx3xK)
    real = np.asarray(seg) > 0
    assert np.abs(got - want)[real].max() / np.abs(want[real]).max() < 2 ** -7


def family_inputs(h, g, k, pct, qk_norm, seed):
    """Grouped [1, 64, H + 2G, K] projection and bias, rotary tables (None without rotary), packed
    segments, and random q/k norm weights ([H, K], [G, K]) where qk_norm."""
    _, cos, sin, seg = inputs(1, 64, h, k, pct, [[20, 30, 14]])
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(1, 64, h + 2 * g, k)) * 2, jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=(h + 2 * g, k)), jnp.bfloat16)
    weights = tuple(jnp.asarray(1 + 0.3 * rng.normal(size=(n, k)), jnp.bfloat16) for n in (h, g)) if qk_norm else None
    return qkv, bias, (cos, sin) if pct else (None, None), seg, weights


# (H, G, K, rotary pct, clip, q/k norms): learned positions (GPT-2, OPT: no rotary) multi-head and
# grouped; OLMo's clip (at a bound bf16 rounds); OLMo-2's norms over all heads, with and without rotary
FAMILY_CASES = [(2, 2, 16, 0.0, None, False), (4, 2, 16, 0.0, None, False), (2, 1, 32, 0.5, 1.3, False),
                (4, 2, 16, 1.0, None, True), (2, 2, 32, 0.0, 0.9, True), (2, 1, 64, 1.0, 0.9, True)]


@pytest.mark.parametrize("h,g,k,pct,clip,qk_norm", FAMILY_CASES)
def test_kernel_without_rotary_with_clip_and_norms_within_bf16_rounding_of_float64(h, g, k, pct, clip, qk_norm):
    """attention_grouped with no rotary tables, with q, k, v clipped after the bias, with RMSNorms
    over all heads of q and of k before the rotary: within bf16 rounding of float64 attention of
    q, k and v prepared in bf16 as the model's XLA path prepares them (the reference)."""
    qkv, bias, (cos, sin), seg, weights = family_inputs(h, g, k, pct, qk_norm, seed=h * 100 + k)
    got = np.asarray(packed_attention.attention_grouped(qkv, cos, sin, seg, bias, weights, num_heads=h, clip=clip,
                                                        block_q=32, block_k=32).astype(jnp.float32), np.float64)
    per_head = None if weights is None else (weights[0], jnp.repeat(weights[1], h // g, axis=0))
    want = packed_attention.reference(grouped_as_per_head(qkv, h), cos, sin, seg,
                                      grouped_as_per_head(bias[None, None], h)[0, 0], clip, per_head)
    real = np.asarray(seg) > 0
    assert np.abs(got - want)[real].max() / np.abs(want[real]).max() < 2 ** -7


def test_per_head_kernel_without_rotary():
    """GPT-NeoX's layout with no rotary tables (rotary_pct 0) against the float64 reference."""
    qkv, cos, sin, seg = inputs(1, 64, 2, 16, 0.0, [[10, 54]], seed=7)
    got = np.asarray(packed_attention.attention(qkv, None, None, seg, block_q=32, block_k=32).astype(jnp.float32))
    want = packed_attention.reference(qkv, None, None, seg)
    assert np.abs(got - want).max() / np.abs(want).max() < 2 ** -7


def test_probe_takes_the_families_cases():
    """works() runs the kernel without rotary, and the grouped kernel with q/k norms and a clip."""
    assert packed_attention.works(16, 0) is None
    assert packed_attention.works(16, 16, qk_norm=True, clip=True) is None
    assert packed_attention.works(32, 0, qk_norm=False, clip=True) is None


def test_skipped_blocks_hold_nothing_the_kernel_needed():
    """Keys of other sequences set to huge values: any key block the kernel skips or visits from
    another sequence would change the output; it does not."""
    qkv, cos, sin, seg = inputs(1, 128, 1, 64, 0.25, [[20, 20, 20, 60, 8]], seed=5)
    out = packed_attention.attention(qkv, cos, sin, seg, block_q=32, block_k=16)
    poisoned = qkv.at[0, :60, :, 1:].set(1e4)  # k and v of the first three sequences
    out2 = packed_attention.attention(poisoned, cos, sin, seg, block_q=32, block_k=16)
    np.testing.assert_array_equal(np.asarray(out[0, 60:120], np.float32), np.asarray(out2[0, 60:120], np.float32))


def test_shapes_it_does_not_take():
    assert packed_attention.applies(512, 128, 32, jnp.bfloat16)
    assert not packed_attention.applies(512, 80, 20, jnp.bfloat16)  # pythia-2.8b's heads
    assert not packed_attention.applies(512, 64, 16, jnp.float32)
    assert not packed_attention.applies(500, 64, 16, jnp.bfloat16)
    assert not packed_attention.applies(512, 64, 8, jnp.bfloat16)
    assert packed_attention.applies(512, 64, 0, jnp.bfloat16)  # learned positions: no rotary
    assert not packed_attention.applies(512, 8, 0, jnp.bfloat16)
    qkv, cos, sin, seg = inputs(1, 96, 1, 64, 0.25, [[96]])
    with pytest.raises(ValueError, match="does not take"):
        packed_attention.attention(qkv, cos, sin, seg, interpret=True)  # 96 % 64


@pytest.mark.slow
def test_model_states_equal_plain_attention():
    """The whole bf16 model on packed rows: states with the kernel (interpret mode) equal those with
    plain attention within bf16 rounding (plain attention rounds its scores to bf16; the kernel
    keeps them in float32)."""
    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder, collect_states
    from isojax.model.options import ForwardOptions

    cfg = ModelConfig(vocab_size=300, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
                        rotary_pct=0.25, max_position_embeddings=256)
    params = random_params(cfg, "bfloat16", seed=3)
    tokens = np.random.default_rng(3).integers(0, 300, (2, 128)).astype(np.int32)
    seg, pos = packed_rows([[5, 40, 70, 13], [100, 3, 9]], 128)
    buf = jnp.zeros((cfg.num_states, 2, 128, 128), jnp.float32)
    states = {}
    for attention in ("xla", "packed"):
        module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention=attention))
        states[attention] = np.asarray(module.apply({"params": params}, tokens, seg, pos, buf, collect_states))
    real = seg > 0
    errors = [max_rel_error(states["packed"][s][real], states["xla"][s][real]) for s in range(cfg.num_states)]
    assert max(errors) < 2e-2, errors
    assert errors[0] == 0 and max(errors) > 0  # the embedding precedes attention; the rest ran the kernel


SHARDED = r'''
import jax, jax.numpy as jnp, numpy as np
from isojax.kernels import packed_attention
from isojax.device import mesh as parallel
from isojax.hf.loading import random_params
from isojax.model.config import ModelConfig
from isojax.model.decoder import Decoder, collect_states
from isojax.model.options import ForwardOptions
calls = []
kernel = packed_attention.attention
def counted(qkv, *a, **k):
    calls.append(qkv.shape)
    return kernel(qkv, *a, **k)
packed_attention.attention = counted
cfg = ModelConfig(vocab_size=300, hidden_size=128, num_layers=1, num_heads=2, intermediate_size=256,
                    rotary_pct=0.25, max_position_embeddings=256)
params = random_params(cfg, "bfloat16", seed=3)
tokens = np.random.default_rng(3).integers(0, 300, (4, 64)).astype(np.int32)
seg = np.repeat(np.array([[1] * 20 + [2] * 30 + [0] * 14]), 4, 0).astype(np.int32)
pos = np.where(seg == 1, np.arange(64), np.arange(64) - 20) * (seg > 0)
buf = jnp.zeros((cfg.num_states, 4, 64, 128), jnp.float32)
mesh = parallel.make_mesh({"data": 2, "model": 2})
plain = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention="packed"))
sharded = plain.clone(options=ForwardOptions(attention="packed", activation_sharding=parallel.rows(mesh)))
want = plain.apply({"params": params}, tokens, seg, pos, buf, collect_states)
got = jax.jit(sharded.apply, static_argnums=5)({"params": params}, tokens, seg, pos, buf, collect_states)
# sharded and whole programs may order the products differently on another CPU: bf16 rounding, not bits
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2 ** -6, atol=2 ** -6)
print("rows per call", sorted(set(c[0] for c in calls)))
'''


@pytest.mark.slow
def test_sharded_rows_go_to_the_kernel_per_device():
    """Under an activation sharding over 4 devices each device's kernel gets its own row, and the
    states equal the unsharded run's."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows per call [1, 4]" in proc.stdout, proc.stdout  # 4 rows unsharded, 1 per device sharded


def test_explicit_packed_refused_without_a_gpu(tmp_path):
    from isojax.device.kernel_choice import choose_attention
    from isojax.run.measure import measure
    from isojax.hf.family.presets import preset
    from isojax.errors import UserError
    if jax.default_backend() != "gpu":
        with pytest.raises(UserError, match="GPU kernel"):
            measure("random:pythia-70m", data=[str(tmp_path / "none.txt")], dtype="bfloat16", attention="packed")
    with pytest.raises(UserError, match="powers of two"):
        choose_attention("packed", False, preset("pythia-2.8b"), "bfloat16", 512)
    assert choose_attention("packed", True, preset("pythia-2.8b"), "bfloat16", 512)[0] == "cudnn"
    assert choose_attention("packed", True, preset("pythia-2.8b"), "bfloat16", 500)[0] == "xla"


@gpu
def test_kernel_works_on_this_gpu():
    assert packed_attention.works(64, 16) is None
    assert packed_attention.works(128, 32) is None
    # learned positions (GPT-2, OPT), OLMo-2's q/k norms, OLMo's clip: compiled and within rounding here
    assert packed_attention.works(64, 0) is None
    assert packed_attention.works(128, 128, qk_norm=True) is None
    assert packed_attention.works(128, 128, clip=True) is None
