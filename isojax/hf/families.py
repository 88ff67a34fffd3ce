"""Hugging Face checkpoints of every supported family: `read_hf_tensors` (config, tensors,
checksum) and `tensors_to_params`. GPT-2's, OPT's, Falcon's and the Llama family's tensors become
isojax.model.decoder's parameter tree (layer weights stacked on axis 0) here; GPT-NeoX's are
isojax.hf.gpt_neox's.

Each family's layout lists, per parameter of the tree, the Hugging Face tensors it is made of
and how: torch `nn.Linear` weights [out, in] are transposed to Flax kernels [in, out]; GPT-2's
`Conv1D` weights are [in, out] already; q, k and v go into one projection ordered [q heads | k
heads | v heads] (isojax.model.decoder), from three tensors (Llama, OPT) or from a fused one
(GPT-2's is that order; Falcon's is per head (q, k, v) without multi_query, [q heads | k | v] with
it, and per key/value group (q.., k, v) in its new architecture). Every expected tensor must be
present with the expected shape, and nothing else may be: a mismatch is refused by name.
Checkpoints saved from the bare model (GPT-2's `h.0...`, OPT's `decoder...`) lack the prefix
the LM-head class adds; both spellings are read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable

import numpy as np

from isojax.errors import UserError
from isojax.hf import gpt_neox
from isojax.model.config import ModelConfig, read_hf_config

Combine = Callable  # (list of tensors, xp) -> the parameter


@dataclasses.dataclass
class Layout:
    prefix: str                              # the LM-head class's prefix of the trunk's names
    layers: str                              # the layer list under the prefix ("model.layers.")
    shapes: dict[str, tuple]                 # every tensor, by its full name -> shape
    params: list[tuple[tuple, list[str], Combine]]  # tree path, source tensors, how to combine them
    ignored: str = r"$^"                     # buffers some exporters keep (a regex of whole names)


def linear(arrs, xp):
    return arrs[0].T


def as_is(arrs, xp):
    return arrs[0]


def qkv_kernel(arrs, xp):
    """[q; k; v] weights [out, in] -> one kernel [in, (H + 2G) K]."""
    return xp.concatenate([a.T for a in arrs], axis=1)


def qkv_bias(arrs, xp):
    return xp.concatenate(arrs, axis=0)


def _falcon_reorder(cfg: ModelConfig):
    """Falcon's fused rows [N K, in] (or bias [N K]) -> [q heads | k heads | v heads] rows. Falcon
    groups them per key/value head: [G, H / G + 2, K], a group's queries then its k and its v
    (new_decoder_architecture); without it the same layout holds with G = H (per head q, k, v)
    and with G = 1 (multi_query: [q heads | k | v])."""
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim

    def reorder(a, xp):
        rest = a.shape[1:]
        a = a.reshape(g, h // g + 2, k, *rest)
        return xp.concatenate([x.reshape(-1, *rest) for x in (a[:, :-2], a[:, -2], a[:, -1])], axis=0)

    return reorder


def _llama_like(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, d)}
    params = [(("embed_in",), ["model.embed_tokens.weight"], as_is)]
    layer = {"self_attn.q_proj.weight": (h * k, d), "self_attn.k_proj.weight": (g * k, d),
             "self_attn.v_proj.weight": (g * k, d), "self_attn.o_proj.weight": (d, h * k),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    params += [(("attention", "qkv", "kernel"), [f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_kernel),
               (("attention", "dense", "kernel"), ["self_attn.o_proj.weight"], linear)]
    params += [(("mlp", x, "kernel"), [f"mlp.{x}_proj.weight"], linear) for x in ("gate", "up", "down")]
    if cfg.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (h * k,), "self_attn.k_proj.bias": (g * k,),
                      "self_attn.v_proj.bias": (g * k,)})
        params.append((("attention", "qkv", "bias"), [f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_bias))
    if cfg.out_bias:
        layer["self_attn.o_proj.bias"] = (d,)
        params.append((("attention", "dense", "bias"), ["self_attn.o_proj.bias"], as_is))
    if cfg.mlp_bias:
        layer.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
        params += [(("mlp", x, "bias"), [f"mlp.{x}_proj.bias"], as_is) for x in ("gate", "up", "down")]
    norms = {"olmo": [], "olmo2": ["post_attention_layernorm", "post_feedforward_layernorm"]}.get(
        cfg.family, ["input_layernorm", "post_attention_layernorm"])
    for name in norms:
        layer[f"{name}.weight"] = (d,)
        params.append(((name, "scale"), [f"{name}.weight"], as_is))
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (h * k,), "self_attn.k_norm.weight": (g * k,)})
        params += [(("attention", f"{x}_norm", "scale"), [f"self_attn.{x}_norm.weight"], as_is) for x in "qk"]
    if cfg.norm != "layer_no_affine":
        shapes["model.norm.weight"] = (d,)
        params.append((("final_layer_norm", "scale"), ["model.norm.weight"], as_is))
    return _finish(cfg, Layout("model.", "model.layers.", shapes, params), layer)


def _gpt2(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (cfg.position_table_rows(), d),
              "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    params = [(("embed_in",), ["transformer.wte.weight"], as_is),
              (("position_embeddings",), ["transformer.wpe.weight"], as_is),
              (("final_layer_norm", "scale"), ["transformer.ln_f.weight"], as_is),
              (("final_layer_norm", "bias"), ["transformer.ln_f.bias"], as_is)]
    # Conv1D: weight [in, out]; c_attn's columns are [q heads | k heads | v heads] already
    layer = {"attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,), "attn.c_proj.weight": (d, d),
             "attn.c_proj.bias": (d,), "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,),
             "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,)}
    for ours, theirs in (("attention.qkv", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
                         ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
        params += [((*ours.split("."), leaf), [f"{theirs}.{hf}"], as_is) for leaf, hf in (("kernel", "weight"),
                                                                                           ("bias", "bias"))]
    for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        layer.update({f"{theirs}.weight": (d,), f"{theirs}.bias": (d,)})
        params += [((ours, "scale"), [f"{theirs}.weight"], as_is), ((ours, "bias"), [f"{theirs}.bias"], as_is)]
    # the causal-mask buffers older GPT-2 checkpoints keep
    return _finish(cfg, Layout("transformer.", "transformer.h.", shapes, params,
                               ignored=r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"), layer)


def _opt(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    top = "model.decoder."
    shapes = {top + "embed_tokens.weight": (v, d), top + "embed_positions.weight": (cfg.position_table_rows(), d)}
    params = [(("embed_in",), [top + "embed_tokens.weight"], as_is),
              (("position_embeddings",), [top + "embed_positions.weight"], as_is)]
    layer = {f"self_attn.{x}_proj.weight": (d, d) for x in ("q", "k", "v", "out")}
    layer.update({"fc1.weight": (f, d), "fc2.weight": (d, f)})
    params += [(("attention", "qkv", "kernel"), [f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_kernel),
               (("attention", "dense", "kernel"), ["self_attn.out_proj.weight"], linear),
               (("mlp", "up", "kernel"), ["fc1.weight"], linear), (("mlp", "down", "kernel"), ["fc2.weight"], linear)]
    if cfg.qkv_bias:  # enable_bias: every linear
        layer.update({f"self_attn.{x}_proj.bias": (d,) for x in ("q", "k", "v", "out")})
        layer.update({"fc1.bias": (f,), "fc2.bias": (d,)})
        params += [(("attention", "qkv", "bias"), [f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_bias),
                   (("attention", "dense", "bias"), ["self_attn.out_proj.bias"], as_is),
                   (("mlp", "up", "bias"), ["fc1.bias"], as_is), (("mlp", "down", "bias"), ["fc2.bias"], as_is)]
    if cfg.norm == "layer":  # layer_norm_elementwise_affine
        for ours, theirs in (("input_layernorm", "self_attn_layer_norm"), ("post_attention_layernorm",
                                                                           "final_layer_norm")):
            layer.update({f"{theirs}.weight": (d,), f"{theirs}.bias": (d,)})
            params += [((ours, "scale"), [f"{theirs}.weight"], as_is), ((ours, "bias"), [f"{theirs}.bias"], as_is)]
        shapes.update({top + "final_layer_norm.weight": (d,), top + "final_layer_norm.bias": (d,)})
        params += [(("final_layer_norm", "scale"), [top + "final_layer_norm.weight"], as_is),
                   (("final_layer_norm", "bias"), [top + "final_layer_norm.bias"], as_is)]
    return _finish(cfg, Layout("model.", top + "layers.", shapes, params), layer)


def _falcon(cfg: ModelConfig) -> Layout:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n = (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes = {"transformer.word_embeddings.weight": (v, d), "transformer.ln_f.weight": (d,),
              "transformer.ln_f.bias": (d,)}
    params = [(("embed_in",), ["transformer.word_embeddings.weight"], as_is),
              (("final_layer_norm", "scale"), ["transformer.ln_f.weight"], as_is),
              (("final_layer_norm", "bias"), ["transformer.ln_f.bias"], as_is)]
    reorder = _falcon_reorder(cfg)
    qkv = "self_attention.query_key_value"
    layer = {f"{qkv}.weight": (n, d), "self_attention.dense.weight": (d, d), "mlp.dense_h_to_4h.weight": (f, d),
             "mlp.dense_4h_to_h.weight": (d, f)}
    params += [(("attention", "qkv", "kernel"), [f"{qkv}.weight"], lambda a, xp: reorder(a[0], xp).T),
               (("attention", "dense", "kernel"), ["self_attention.dense.weight"], linear),
               (("mlp", "up", "kernel"), ["mlp.dense_h_to_4h.weight"], linear),
               (("mlp", "down", "kernel"), ["mlp.dense_4h_to_h.weight"], linear)]
    if cfg.qkv_bias:  # Falcon's `bias`: every linear
        layer.update({f"{qkv}.bias": (n,), "self_attention.dense.bias": (d,), "mlp.dense_h_to_4h.bias": (f,),
                      "mlp.dense_4h_to_h.bias": (d,)})
        params += [(("attention", "qkv", "bias"), [f"{qkv}.bias"], lambda a, xp: reorder(a[0], xp)),
                   (("attention", "dense", "bias"), ["self_attention.dense.bias"], as_is),
                   (("mlp", "up", "bias"), ["mlp.dense_h_to_4h.bias"], as_is),
                   (("mlp", "down", "bias"), ["mlp.dense_4h_to_h.bias"], as_is)]
    if cfg.shared_input_norm:
        norms = [("input_layernorm", "input_layernorm")]
    elif cfg.use_parallel_residual:
        norms = [("input_layernorm", "ln_attn"), ("post_attention_layernorm", "ln_mlp")]
    else:
        norms = [("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm")]
    for ours, theirs in norms:
        layer.update({f"{theirs}.weight": (d,), f"{theirs}.bias": (d,)})
        params += [((ours, "scale"), [f"{theirs}.weight"], as_is), ((ours, "bias"), [f"{theirs}.bias"], as_is)]
    return _finish(cfg, Layout("transformer.", "transformer.h.", shapes, params), layer)


def _finish(cfg: ModelConfig, layout: Layout, layer: dict) -> Layout:
    """Add the per-layer tensors (`layer`: suffix -> shape) and the unembedding unless tied."""
    for i in range(cfg.num_layers):
        layout.shapes.update({f"{layout.layers}{i}.{suffix}": shape for suffix, shape in layer.items()})
    if not cfg.tie_word_embeddings:
        layout.shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        layout.params.append((("embed_out",), ["lm_head.weight"], linear))
    return layout


LAYOUTS = {"llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "olmo": _llama_like,
           "olmo2": _llama_like, "gpt2": _gpt2, "opt": _opt, "falcon": _falcon}


def hf_tensors(read: Callable[[str], np.ndarray], names: list[str], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every tensor this config needs, under the LM-head class's names, as stored (checked for
    presence and shape; anything else in the checkpoint is refused)."""
    layout = LAYOUTS[cfg.family](cfg)
    stored = {}  # our spelling -> the checkpoint's
    for name in names:
        full = name if name.startswith((layout.prefix, "lm_head.")) else layout.prefix + name
        stored[full] = name
    if cfg.tie_word_embeddings:  # some exporters write the tied copy too; it carries nothing new
        stored.pop("lm_head.weight", None)
    extra = sorted(n for n in set(stored) - set(layout.shapes)
                   if not n.endswith(".inv_freq") and not re.fullmatch(layout.ignored, n))
    missing = [n for n in layout.shapes if n not in stored]
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensor(s) of a {cfg.family} with {cfg.num_layers} "
                        f"layers, e.g. {missing[0]} (truncated or mismatched checkpoint?)")
    if extra:
        raise UserError(f"checkpoint has tensor(s) this {cfg.family} config does not expect, e.g. {extra[0]} "
                        "(config and weights mismatched?)")
    tensors = {}
    for name, shape in layout.shapes.items():
        tensors[name] = arr = read(stored[name])
        if tuple(arr.shape) != shape:
            raise UserError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {shape}")
    return tensors


def tensors_to_params(tensors: dict, cfg: ModelConfig, xp=np) -> dict:
    """Hugging Face tensors -> the parameter tree (layers stacked), with `xp` numpy or jax.numpy
    (as isojax.hf.gpt_neox.tensors_to_params)."""
    if cfg.family == "gpt_neox":
        return gpt_neox.tensors_to_params(tensors, cfg, xp)
    layout = LAYOUTS[cfg.family](cfg)
    tree: dict = {}
    for path, sources, combine in layout.params:
        if sources[0] not in tensors:  # a layer's: sources are suffixes of each layer's names
            value = xp.stack([combine([tensors[f"{layout.layers}{i}.{s}"] for s in sources], xp)
                              for i in range(cfg.num_layers)])
            path = ("layers", "block", *path)
        else:
            value = combine([tensors[s] for s in sources], xp)
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = xp.ascontiguousarray(value) if xp is np else value
    return tree


def read_hf_tensors(path: Path, put: Callable | None = None):
    """Hugging Face checkpoint dir of any supported family -> (config, its tensors as stored
    (bfloat16 read as float32), checksum of the weight files). put: applied to each tensor as
    stored (bfloat16 too), a view of the memory-mapped file (CheckpointReader.mapped), e.g.
    jax.device_put: no copy in host memory."""
    from isojax.hf.files import CheckpointReader
    cfg = read_hf_config(path, name=path.name)
    reader = CheckpointReader(path)
    read = reader.read if put is None else (lambda name: put(reader.mapped(name)))
    tensors = (gpt_neox.hf_tensors if cfg.family == "gpt_neox" else hf_tensors)(read, reader.names(), cfg)
    return cfg, tensors, gpt_neox.files_checksum(reader.files())
