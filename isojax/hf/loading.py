"""`load_model`: a checkpoint of any supported family (GPT-NeoX, GPT-2, OPT, Falcon, the Llama
family; README "Model families") -> config, parameters on device, tokenizer.

Accepted names:
  random:<preset>          random weights of a preset's shapes (marked `weights="random"`)
  DIR with isojax.json      an Orbax checkpoint written by `python -m converters` (the fast path)
  DIR with config.json      a Hugging Face checkpoint directory, read straight onto the devices
  preset or hub id          the same, from huggingface_hub's cache (downloaded once)

Weights are copied to the devices in their stored dtype, straight from views of the memory-mapped
safetensors files (`.bin` read with weights_only=True), one tensor while the next is read, and
stacked per layer, transposed and cast there. The checksum that identifies a checkpoint
(manifest, resume) is a sha256 of the weight files' names, sizes, headers and 16 evenly spaced
64 KiB samples of each: a full hash of pythia-1.4b took 15 s.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from isojax.hf.families import read_hf_tensors, tensors_to_params
from isojax.hf.orbax_io import is_converted, load_converted
from isojax.model.config import ModelConfig, base_preset, hub_id, preset, shape_only
from isojax.errors import UserError
from isojax.model.ops import DTYPES
from isojax.model.decoder import model_class
from isojax.model.gpt_neox import collect_states, single_row
from isojax.model.options import ForwardOptions
from isojax.hf.tokenizer import load_tokenizer



def cache_root() -> Path:
    return Path(os.environ.get("ISOJAX_CACHE", Path.home() / ".cache" / "isojax"))


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    weights: str                      # "pretrained" | "random"
    source: dict                      # name, revision, path, checksum (+ tokenizer once loaded)
    dtype: str = "float32"
    attention_impl: str = "xla"
    mlp_impl: str = "xla"              # ForwardOptions.mlp_kernel
    norm_impl: str = "xla"             # ForwardOptions.norm_kernel
    tokenizer_dir: Path | None = None  # where tokenizer.json is looked for; None: the hub repo's
    hub_repo: str | None = None
    hub_revision: str | None = None  # the revision whose tokenizer.json is fetched when tokenizer_dir has none

    @functools.cached_property
    def tokenizer(self):
        """The tokenizers.Tokenizer, loaded on first use (states from token ids need none)."""
        tok, self.source["tokenizer"] = load_tokenizer(self.tokenizer_dir, self.config, hub_repo=self.hub_repo,
                                                           hub_revision=self.hub_revision)
        return tok

    @property
    def module(self):
        return build_module(self.config, self.dtype, self.attention_impl, self.mlp_impl, self.norm_impl)

    def hidden_states_packed(self, tokens_BxT, segment_ids_BxT, positions_BxT) -> np.ndarray:
        """All S = L+2 states of packed rows: float32 numpy [S, B, T, D]. Segment ids: 0 for
        padding, and each sequence's id one contiguous run of its row (what the packed attention
        kernel assumes, and what isojax's packing makes)."""
        b, t = np.shape(tokens_BxT)
        for row in np.asarray(segment_ids_BxT):
            runs = row[np.r_[True, row[1:] != row[:-1]]]
            if len(set(runs[runs != 0].tolist())) != np.count_nonzero(runs):
                raise UserError("segment ids: each sequence must be one contiguous run of its row")
        buf = jnp.zeros((self.config.num_states, b, t, self.config.hidden_size), jnp.float32)
        out = _forward_states(self.module, self.params, jnp.asarray(tokens_BxT), jnp.asarray(segment_ids_BxT),
                              jnp.asarray(positions_BxT), buf)
        return np.asarray(out)

    def hidden_states(self, token_ids) -> np.ndarray:
        """States of one sequence, [S, T, D] float32. Longer than the context: consecutive windows."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise UserError("hidden_states takes a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise UserError(f"token ids must lie in [0, {self.config.vocab_size})")
        ctx = self.config.max_position_embeddings
        parts = [self.hidden_states_packed(*single_row(ids[i:i + ctx]))[:, 0] for i in range(0, len(ids), ctx)]
        return np.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("module",))
def _forward_states(module, params, tokens, seg, pos, buf):
    return module.apply({"params": params}, tokens, seg, pos, buf, collect_states)


def build_module(cfg: ModelConfig, dtype: str, attention: str = "xla", mlp: str = "xla", norm: str = "xla"):
    """The model's module computing in `dtype` with these kernels (ForwardOptions)."""
    dt = DTYPES[dtype]
    options = ForwardOptions(attention=attention, mlp_kernel=mlp, norm_kernel=norm)
    return model_class(cfg)(cfg, dtype=dt, param_dtype=dt, options=options)


def _init_params(cfg: ModelConfig, dtype: str):
    """key -> the parameter tree of the config's shapes (normal(0.02), LayerNorms at 1/0) in `dtype`."""
    module = model_class(cfg)(cfg)
    tokens, seg, pos = single_row(np.zeros(4, np.int32))
    return lambda key: jax.tree.map(lambda p: p.astype(DTYPES[dtype]),
                                    module.init(key, tokens, seg, pos, None, lambda obs, s, x: obs)["params"])


def random_params(cfg: ModelConfig, dtype: str = "float32", seed: int = 0, mesh=None) -> dict:
    """Random weights of the config's shapes, initialized on device in float32 and then cast, so
    every dtype of `random:<preset>` holds the same weights. With a mesh they are created where
    parallel.param_shardings puts them."""
    make, key = _init_params(cfg, dtype), jax.random.PRNGKey(seed)
    shardings = None
    if mesh is not None:
        from isojax.device.mesh import param_shardings
        shardings = param_shardings(jax.eval_shape(make, key), mesh)
    return jax.jit(make, out_shardings=shardings)(key)


def abstract_params(cfg: ModelConfig, dtype: str, mesh) -> dict:
    """The parameters any checkpoint of this config loads as, on the mesh, as ShapeDtypeStructs
    (what the step compiles for before the weights arrive)."""
    from isojax.device.mesh import param_shardings
    shapes = jax.eval_shape(_init_params(cfg, dtype), jax.ShapeDtypeStruct((2,), np.uint32))  # a PRNGKey's
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        param_shardings(shapes, mesh))


def place(params, dtype: str, mesh=None, build=None) -> dict:
    """Parameters (numpy in any float dtype, or jax) copied as they are to the default device,
    turned into the parameter tree there by `build` (e.g. Hugging Face tensors stacked and
    transposed), cast to `dtype` and put where parallel.param_shardings puts them on the mesh."""
    build = build or (lambda t: t)
    finish = lambda t: jax.tree.map(lambda a: a.astype(DTYPES[dtype]), build(t))
    shardings = None
    if mesh is not None:
        from isojax.device.mesh import param_shardings
        shardings = param_shardings(jax.eval_shape(finish, params), mesh)
    return jax.jit(finish, out_shardings=shardings)(jax.device_put(params))


def load_model(name_or_path: str, revision: str | None = None, dtype: str = "float32",
               attention_impl: str = "xla", mesh=None) -> LoadedModel:
    """Load a checkpoint of any supported family; see module docstring for the accepted names. With a mesh
    the parameters are placed on it (replicated, or split over its "model" axis)."""
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    name = str(name_or_path)
    if name.startswith("random:"):
        cfg = preset(name.split(":", 1)[1])
        params = random_params(cfg, dtype, mesh=mesh)
        source = {"name": name, "revision": None, "path": None, "checksum": "random-seed-0"}
        return LoadedModel(cfg, params, "random", source, dtype, attention_impl, hub_repo=hub_id(cfg.name))
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")):
        if not path.is_dir():
            raise UserError(f"{path}: not a checkpoint directory")
        if revision is not None:
            raise UserError("--revision applies to hub models, not to a local directory")
        return _load_dir(path, name, None, dtype, attention_impl, mesh)
    repo = hub_id(name) if base_preset(name) else name
    if shape_only(name):
        raise UserError(f"{name} is a preset of shapes with no hub model behind it: random:{name} runs it "
                        "with random weights")
    if "/" not in repo:
        from isojax.model.config import preset_names
        raise UserError(f"unknown model {name!r}: not a directory, a hub id (org/name), or a preset "
                        f"({', '.join(preset_names())}, their -deduped variants, random:<preset>)")
    from isojax.hf.files import resolve_model
    loaded = _load_dir(resolve_model(repo, revision), repo, revision, dtype, attention_impl, mesh)
    loaded.hub_repo, loaded.hub_revision = repo, revision  # a snapshot without tokenizer.json: the revision's
    return loaded


def _load_dir(path: Path, name: str, revision, dtype: str, attention_impl: str, mesh=None) -> LoadedModel:
    if is_converted(path):
        cfg, params, meta = load_converted(path, DTYPES[dtype])
        params = place(params, dtype, mesh) if mesh is not None else params
        source = {"name": meta.get("source", {}).get("name") or name,
                  "revision": meta.get("source", {}).get("revision", revision),
                  "path": str(path), "checksum": meta["checksum"]}
    else:
        cfg, tensors, checksum = read_hf_tensors(path, put=jax.device_put)  # each copied as it is read
        params = place(tensors, dtype, mesh, build=lambda t: tensors_to_params(t, cfg, jnp))
        del tensors
        source = {"name": name, "revision": revision, "path": str(path), "checksum": checksum}
    return LoadedModel(cfg, params, "pretrained", source, dtype, attention_impl, tokenizer_dir=path)
