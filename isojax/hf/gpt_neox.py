"""Hugging Face GPT-NeoX tensors -> isojax parameter tree (layer weights stacked on axis 0).

torch `nn.Linear` stores weight [out, in]; Flax `Dense` stores kernel [in, out]. The fused
`query_key_value` keeps Hugging Face's column order (per head: q, k, v), which the model's
reshape to [.., H, 3, K] relies on. Every expected tensor must be present with the expected
shape; anything else is refused with a message naming the tensor.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from isojax.model.config import ModelConfig
from isojax.errors import UserError

LAYER_LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Hugging Face tensor name -> shape for a GPTNeoXForCausalLM checkpoint."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    linear_out_in = {"attention.query_key_value": (3 * d, d), "attention.dense": (d, d),
                     "mlp.dense_h_to_4h": (f, d), "mlp.dense_4h_to_h": (d, f)}
    shapes = {"gpt_neox.embed_in.weight": (v, d), "embed_out.weight": (v, d),
              "gpt_neox.final_layer_norm.weight": (d,), "gpt_neox.final_layer_norm.bias": (d,)}
    for i in range(cfg.num_layers):
        p = f"gpt_neox.layers.{i}."
        for name, (o, n) in linear_out_in.items():
            shapes[p + name + ".weight"] = (o, n)
            shapes[p + name + ".bias"] = (o,)
        for name in LAYER_NORMS:
            shapes[p + name + ".weight"] = (d,)
            shapes[p + name + ".bias"] = (d,)
    return shapes


def hf_tensors(read: Callable[[str], np.ndarray], names: list[str], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every tensor a GPT-NeoX of this config needs, as stored (checked for presence and shape)."""
    shapes = expected_shapes(cfg)
    have = set(names)
    if "embed_out.weight" not in have and "lm_head.weight" in have:  # the in-memory name in transformers 5
        read = (lambda r: lambda n: r("lm_head.weight" if n == "embed_out.weight" else n))(read)
        have = (have - {"lm_head.weight"}) | {"embed_out.weight"}
    # Buffers some exporters keep (rotary inv_freq, attention masks) carry no weights.
    extra = sorted(n for n in have - set(shapes)
                   if not n.endswith((".inv_freq", ".masked_bias", ".attention.bias")))
    missing = [n for n in shapes if n not in have]
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensor(s) of a GPT-NeoX with {cfg.num_layers} "
                        f"layers, e.g. {missing[0]} (truncated or mismatched checkpoint?)")
    if extra:
        raise UserError(f"checkpoint has tensor(s) this GPT-NeoX config does not expect, e.g. {extra[0]} "
                        "(config and weights mismatched?)")
    tensors = {}
    for name, shape in shapes.items():
        tensors[name] = arr = read(name)
        if tuple(arr.shape) != shape:
            raise UserError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {shape}")
    return tensors


def tensors_to_params(tensors: dict, cfg: ModelConfig, xp=np) -> dict:
    """Hugging Face tensors -> the parameter tree (layers stacked, kernels [in, out]), with
    `xp` = numpy on the host or jax.numpy (inside jit: the stacking and transposes run on the
    device, where they cost nothing next to the host's strided copies)."""

    def stacked(suffix, transpose=False):
        arrs = [tensors[f"gpt_neox.layers.{i}.{suffix}"] for i in range(cfg.num_layers)]
        return xp.stack([a.T if transpose else a for a in arrs])

    attention, block = {}, {}
    for name in LAYER_LINEARS:
        group, leaf = name.split(".")
        dest = attention if group == "attention" else block
        dest[leaf] = {"kernel": stacked(name + ".weight", transpose=True), "bias": stacked(name + ".bias")}
    block["attention"] = attention
    for name in LAYER_NORMS:
        block[name] = {"scale": stacked(name + ".weight"), "bias": stacked(name + ".bias")}
    return {
        "embed_in": tensors["gpt_neox.embed_in.weight"],
        "embed_out": xp.ascontiguousarray(tensors["embed_out.weight"].T) if xp is np else tensors["embed_out.weight"].T,
        "final_layer_norm": {"scale": tensors["gpt_neox.final_layer_norm.weight"],
                             "bias": tensors["gpt_neox.final_layer_norm.bias"]},
        "layers": {"block": block},
    }


def files_checksum(files, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """sha256 of each file's name and size, its first 1 MiB (a safetensors header and more) and
    `samples` evenly spaced blocks: any two checkpoints of one model differ in all of these, and a
    full hash of pythia-1.4b's weights took 15 s."""
    h = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for k in range(samples):
                fh.seek(size * k // samples)
                h.update(fh.read(sample_bytes))
    return "sha256:" + h.hexdigest()[:32]
