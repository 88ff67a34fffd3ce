"""device.memory's step estimate: the parameters of the gathered layers of a split model, against
a real parameter tree."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from isojax.hf.family import from_hf_dict


def test_layer_params_count_a_gated_layer():
    """device.memory's per-layer parameters (three gathered layers of a split model) are the layer
    stack's own: a small SwiGLU model with grouped key/values, against its random parameter tree."""
    from isojax.device.memory import layer_params, step_bytes
    from isojax.hf.loading import random_params
    cfg = from_hf_dict(dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=224,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    params = random_params(cfg)
    per_layer = sum(x.size for x in jax.tree.leaves(params["layers"])) / cfg.num_layers
    assert per_layer == pytest.approx(layer_params(cfg), abs=cfg.hidden_size / cfg.num_layers + 1)
    assert per_layer > 12 * cfg.hidden_size ** 2  # 3 x 64 x 224 + 3 x 64^2 (Mistral's ratios): 13.5 d^2
    split, whole = step_bytes(cfg, "bfloat16", 4096, 2), step_bytes(cfg, "bfloat16", 4096, 1)
    assert split - whole == 3 * 2 * layer_params(cfg)
    assert sum(np.size(x) for x in jax.tree.leaves(params)) == cfg.param_count()
