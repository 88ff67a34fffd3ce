"""isojax.kernels.norm: a parallel-residual block's two LayerNorms in one Pallas kernel (interpret
mode on CPU; compiled on a GPU by the GPU-only test), against float64 and against model.LayerNorm."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.kernels import norm as norm_kernel
from isojax.model.layers import Norm

gpu = pytest.mark.gpu  # skipped without a GPU (conftest)


def inputs(n, d, seed, offset=3.0):
    keys = jax.random.split(jax.random.key(seed), 5)
    # rows with a large mean against their spread: a one-pass variance would lose digits here
    x = (offset + jax.random.normal(keys[0], (n, d), jnp.float32) * (1 + jnp.arange(n)[:, None] % 4)).astype(jnp.bfloat16)
    return x, [jax.random.normal(k, (d,), jnp.float32).astype(jnp.bfloat16) for k in keys[1:]]


def xla_layer_norm(x, scale, bias, eps):
    return Norm("layer", eps, jnp.bfloat16, jnp.bfloat16).apply({"params": {"scale": scale, "bias": bias}}, x)


@pytest.mark.parametrize("n,d,offset", [(64, 128, 0.0), pytest.param(32, 512, 3.0, marks=pytest.mark.slow),
                                         pytest.param(16, 1024, 40.0, marks=pytest.mark.slow)])
def test_pair_within_one_rounding_of_float64_and_of_xla(n, d, offset):
    x, (s1, b1, s2, b2) = inputs(n, d, seed=d, offset=offset)
    y1, y2 = norm_kernel.layer_norm_pair(x, s1, b1, s2, b2, eps=1e-5)
    for y, scale, bias in ((y1, s1, b1), (y2, s2, b2)):
        want = norm_kernel.reference(x, scale, bias, 1e-5)
        assert norm_kernel.rounding_excess(y, want) <= 0
        xla = np.asarray(xla_layer_norm(x, scale, bias, 1e-5), np.float64)
        got = np.asarray(y, np.float64)
        assert np.mean(got != xla) < 0.01  # the same operations; sums in another order
        ulp = np.abs(xla) * 2.0 ** -7 + 1e-6
        assert np.all(np.abs(got - xla) <= ulp)


def test_rounding_excess_catches_a_wrong_layer_norm():
    x, (s1, b1, s2, b2) = inputs(32, 512, seed=1)
    want = norm_kernel.reference(x, s1, b1, 1e-5)
    y1, y2 = norm_kernel.layer_norm_pair(x, s1, b1, s2, b2, eps=1e-5)
    assert norm_kernel.rounding_excess(y1, want) <= 0
    assert norm_kernel.rounding_excess(y2, want) > 0  # the other parameters
    wrong_eps = norm_kernel.reference(x, s1, b1, 1.0)
    assert norm_kernel.rounding_excess(y1, wrong_eps) > 0


def test_shapes_it_does_not_take():
    assert norm_kernel.applies(1024, jnp.bfloat16)
    assert not norm_kernel.applies(2560, jnp.bfloat16)  # pythia-2.8b: not a power of two
    assert not norm_kernel.applies(1024, jnp.float32)
    x, params = inputs(12, 1024, seed=2)
    with pytest.raises(ValueError, match="blocks of 8"):
        norm_kernel.layer_norm_pair(x, *params, eps=1e-5)


MODEL = r'''
import sys
import jax, jax.numpy as jnp, numpy as np
from isojax.kernels import norm as norm_kernel
from isojax.device import mesh as parallel
from isojax.model.config import ModelConfig
from isojax.hf.loading import random_params
from isojax.model.decoder import Decoder, collect_states
from isojax.model.options import ForwardOptions
calls = []
kernel = norm_kernel.layer_norm_pair
def counted(x, *a, **k):
    calls.append(x.shape)
    return kernel(x, *a, **k)
norm_kernel.layer_norm_pair = counted
parallel_residual = sys.argv[1] == "parallel"
cfg = ModelConfig(vocab_size=300, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
                    rotary_pct=0.25, max_position_embeddings=256, use_parallel_residual=parallel_residual)
params = random_params(cfg, "bfloat16", seed=3)
# LayerNorms with different parameters, so that swapping them would show
leaves, tree = jax.tree_util.tree_flatten_with_path(params)
key = jax.random.key(0)
params = jax.tree_util.tree_unflatten(tree, [
    (v + 0.5 * jax.random.normal(jax.random.fold_in(key, i), v.shape)).astype(v.dtype)
    if "layernorm" in jax.tree_util.keystr(p) else v for i, (p, v) in enumerate(leaves)])
tokens = np.random.default_rng(3).integers(0, 300, (4, 64)).astype(np.int32)
seg = np.ones((4, 64), np.int32)
pos = np.broadcast_to(np.arange(64), (4, 64)).astype(np.int32)
buf = jnp.zeros((cfg.num_states, 4, 64, 128), jnp.float32)
run = lambda options: np.asarray(jax.jit(Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=options).apply,
                                         static_argnums=5)({"params": params}, tokens, seg, pos, buf, collect_states))
xla = run(ForwardOptions())
fused = run(ForwardOptions(norm_kernel="pallas"))
mesh = parallel.make_mesh({"data": 4, "model": 1})
sharded = run(ForwardOptions(norm_kernel="pallas", activation_sharding=parallel.rows(mesh)))
err = max(float(np.max(np.abs(fused[s] - xla[s]) / (np.abs(xla[s]).max() + 1e-6))) for s in range(cfg.num_states))
print("error", err, "equal sharded", bool(np.array_equal(sharded, fused)), "rows per call", sorted(set(c[0] for c in calls)))
'''


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["parallel", "sequential"])
def test_model_states_with_the_kernel(residual):
    """The bf16 model with norm_kernel pallas (interpret mode): states within bf16 rounding of XLA's
    LayerNorms (each LayerNorm's parameters reach its own branch), per device under a 4-device
    sharding; a sequential-residual model never calls the kernel."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", MODEL, residual], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    err = float(words[words.index("error") + 1])
    assert "equal sharded True" in proc.stdout, proc.stdout
    if residual == "parallel":
        assert err < 2e-2, proc.stdout  # on CPU the sums run in XLA's order: often 0
        assert "rows per call [64, 256]" in proc.stdout, proc.stdout  # 256 rows unsharded, 64 per device
    else:
        assert err == 0 and "rows per call []" in proc.stdout, proc.stdout


def test_chosen_on_gpus_only(tmp_path):
    from isojax.device.kernel_choice import check_norm_kernel, choose_norm_kernel
    from isojax.hf.family.presets import preset
    from isojax.errors import UserError
    with pytest.raises(UserError, match="norm_kernel must be"):
        check_norm_kernel("triton", "bfloat16")
    with pytest.raises(UserError, match="bfloat16"):
        check_norm_kernel("pallas", "float32")
    with pytest.raises(UserError, match="does not apply"):
        choose_norm_kernel("pallas", preset("pythia-2.8b"), "bfloat16", 65536)
    assert choose_norm_kernel("auto", preset("pythia-2.8b"), "bfloat16", 65536)[0] == "xla"
    sequential = dataclasses.replace(preset("pythia-410m"), use_parallel_residual=False)
    with pytest.raises(UserError, match="sequential residuals"):
        choose_norm_kernel("pallas", sequential, "bfloat16", 65536)
    assert choose_norm_kernel("auto", sequential, "bfloat16", 65536)[0] == "xla"
    assert choose_norm_kernel("xla", preset("pythia-410m"), "bfloat16", 65536)[0] == "xla"
    if jax.default_backend() != "gpu":
        with pytest.raises(UserError, match="GPU kernel"):
            check_norm_kernel("pallas", "bfloat16")
        assert choose_norm_kernel("auto", preset("pythia-410m"), "bfloat16", 65536)[0] == "xla"
    else:
        assert choose_norm_kernel("auto", preset("pythia-410m"), "bfloat16", 65536)[0] == "pallas"


@gpu
def test_kernel_works_on_this_gpu():
    for d in (512, 1024, 2048):
        assert norm_kernel.works(d) is None, d
