"""`load_model`: a checkpoint of any supported family (GPT-NeoX, GPT-2, OPT, Falcon, the Llama
family; README "Model families") -> config, parameters on device, tokenizer.

Accepted names:
  random:<preset>          random weights of a preset's shapes (marked `weights="random"`)
  DIR with isojax.json      an Orbax checkpoint written by `python -m isojax.convert` (the fast path)
  DIR with config.json      a Hugging Face checkpoint directory, read straight onto the devices
  DIR and a revision        DIR/REVISION, DIR standing in for a hub repository (one folder per revision)
  preset or hub id          the same, from huggingface_hub's cache (downloaded once)

A checkpoint's weights are marked "trained", or "initialization (step 0)" where its revision or
folder names step 0 (isojax.steps.checkpoint_weights). Every tensor is checked for NaN and
infinite values once it is on the device (one reduction per tensor), before anything is measured.

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

from isojax.hf.checkpoint import read_hf_tensors
from isojax.hf.family import tensors_to_params
from isojax.hf.family.presets import base_preset, hub_id, preset, shape_only
from isojax.hf.orbax_io import is_converted, load_converted
from isojax.model.config import ModelConfig
from isojax.errors import UserError
from isojax.numerics import DTYPES
from isojax.model.decoder import collect_states, model_class, single_row
from isojax.model.options import KernelChoice
from isojax.hf.tokenizer import Bos, load_tokenizer, tokenizer_bos
from isojax.steps import checkpoint_weights, local_revision



def cache_root() -> Path:
    """isojax's own cache (token ids, compiled steps): ISOJAX_CACHE, else ~/.cache/isojax; created
    here, and refused in one line where it cannot be used (a file, no permission)."""
    given = os.environ.get("ISOJAX_CACHE")
    root = Path(given).expanduser() if given else Path.home() / ".cache" / "isojax"
    where = f"ISOJAX_CACHE={given}" if given else f"isojax's cache {root}"
    fix = "set ISOJAX_CACHE to a directory you can write"
    if root.exists() and not root.is_dir():
        raise UserError(f"{where} is not a directory: {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{where}: cannot create it ({e.strerror}): {fix}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"{where} is not writable: {fix}")
    return root


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    weights: str                      # isojax.steps: "random" | "initialization (step 0)" | "trained"
    source: dict                      # name, revision, path, checksum (+ tokenizer once loaded)
    dtype: str = "float32"
    tokenizer_dir: Path | None = None  # where tokenizer.json is looked for; None: the hub repo's
    hub_repo: str | None = None
    hub_revision: str | None = None  # the revision whose tokenizer.json is fetched when tokenizer_dir has none

    @functools.cached_property
    def tokenizer(self):
        """The tokenizers.Tokenizer, loaded on first use (states from token ids need none)."""
        tok, self.source["tokenizer"] = load_tokenizer(self.tokenizer_dir, self.config, hub_repo=self.hub_repo,
                                                           hub_revision=self.hub_revision)
        return tok

    @functools.cached_property
    def bos(self) -> Bos:
        """The tokenizer's BOS token, and whether Hugging Face adds it by default (hf.tokenizer.tokenizer_bos)."""
        return tokenizer_bos(self.tokenizer, self.tokenizer_dir, self.source["tokenizer"])

    def hidden_states_packed(self, tokens_BxT, segment_ids_BxT, positions_BxT,
                             kernels: KernelChoice = KernelChoice()) -> np.ndarray:
        """All S = L+2 states of packed rows: float32 numpy [S, B, T, D], computed with `kernels`.
        Segment ids: 0 for padding, and each sequence's id one contiguous run of its row (what the
        packed attention kernel assumes, and what isojax's packing makes)."""
        b, t = np.shape(tokens_BxT)
        for row in np.asarray(segment_ids_BxT):
            runs = row[np.r_[True, row[1:] != row[:-1]]]
            if len(set(runs[runs != 0].tolist())) != np.count_nonzero(runs):
                raise UserError("segment ids: each sequence must be one contiguous run of its row")
        buf = jnp.zeros((self.config.num_states, b, t, self.config.hidden_size), jnp.float32)
        out = _forward_states(build_module(self.config, self.dtype, kernels), self.params, jnp.asarray(tokens_BxT),
                              jnp.asarray(segment_ids_BxT), jnp.asarray(positions_BxT), buf)
        return np.asarray(out)

    def hidden_states(self, token_ids, kernels: KernelChoice = KernelChoice()) -> np.ndarray:
        """States of one sequence, [S, T, D] float32. Longer than the context: consecutive windows."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise UserError("hidden_states takes a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise UserError(f"token ids must lie in [0, {self.config.vocab_size})")
        ctx = self.config.max_position_embeddings
        parts = [self.hidden_states_packed(*single_row(ids[i:i + ctx]), kernels)[:, 0] for i in range(0, len(ids), ctx)]
        return np.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("module",))
def _forward_states(module, params, tokens, seg, pos, buf):
    return module.apply({"params": params}, tokens, seg, pos, buf, collect_states)


def build_module(cfg: ModelConfig, dtype: str, kernels: KernelChoice = KernelChoice()):
    """The model's module computing in `dtype` with these kernels."""
    dt = DTYPES[dtype]
    return model_class(cfg)(cfg, dtype=dt, param_dtype=dt, options=kernels.forward_options())


def _init_params(cfg: ModelConfig, dtype: str):
    """key -> the parameter tree of the config's shapes (embeddings normal(0.02), weight matrices
    lecun_normal, biases 0, norms at a gain of 1) in `dtype`."""
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


INIT_STD = 0.02  # Hugging Face's initializer_range of Pythia, Llama, OPT, ... (the configs' default)


def from_config_params(cfg: ModelConfig, dtype: str = "float32", seed: int = 0, mesh=None) -> dict:
    """Weights as Hugging Face's `from_config` initializes a model (its `_init_weights` for GPT-NeoX,
    Llama, OPT, ...): every weight matrix and embedding normal(0, INIT_STD), biases 0, norms at a gain
    of 1; drawn by jax's PRNG from `seed` (the same distribution as torch's draw, not its values).
    random_params' weight matrices are lecun_normal instead (flax's default)."""
    make = _init_params(cfg, "float32")

    def draw(key):
        leaves, tree = jax.tree_util.tree_flatten_with_path(make(key))
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        leaves = [INIT_STD * jax.random.normal(k, x.shape, jnp.float32) if getattr(path[-1], "key", None) == "kernel" else x
                  for (path, x), k in zip(leaves, keys)]
        return jax.tree.map(lambda p: p.astype(DTYPES[dtype]), tree.unflatten(leaves))

    shardings = None
    if mesh is not None:
        from isojax.device.mesh import param_shardings
        shardings = param_shardings(jax.eval_shape(draw, jax.random.PRNGKey(seed)), mesh)
    return jax.jit(draw, out_shardings=shardings)(jax.random.PRNGKey(seed))


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
               mesh=None, read: HostCheckpoint | None = None) -> LoadedModel:
    """Load a checkpoint of any supported family; see module docstring for the accepted names. With a mesh
    the parameters are placed on it (replicated, or split over its "model" axis). read: its Hugging
    Face folder's tensors, read into host memory before (read_to_host; a sweep's next checkpoint,
    run/load_ahead.py), placed as the files' would be."""
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    name = str(name_or_path)
    if name.startswith("random:"):
        cfg = preset(name.split(":", 1)[1])
        params = random_params(cfg, dtype, mesh=mesh)
        source = {"name": name, "revision": None, "path": None, "checksum": "random-seed-0"}
        return LoadedModel(cfg, params, "random", source, dtype, hub_repo=hub_id(cfg.name))
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")):
        if not path.is_dir():
            raise UserError(f"{path}: not a checkpoint directory")
        return _load_dir(local_revision(path, revision), name, revision, dtype, mesh, read)
    repo = hub_id(name) if base_preset(name) else name
    if shape_only(name):
        raise UserError(f"{name} is a preset of shapes with no hub model behind it: random:{name} runs it "
                        "with random weights")
    if "/" not in repo:
        from isojax.hf.family.presets import preset_names
        raise UserError(f"unknown model {name!r}: not a directory, a hub id (org/name), or a preset "
                        f"({', '.join(preset_names())}, their -deduped variants, random:<preset>)")
    from isojax.hf.files import resolve_model
    loaded = _load_dir(read.path if read is not None else resolve_model(repo, revision), repo, revision, dtype,
                       mesh, read)
    loaded.hub_repo, loaded.hub_revision = repo, revision  # a snapshot without tokenizer.json: the revision's
    return loaded


def _load_dir(path: Path, name: str, revision, dtype: str, mesh=None, read: HostCheckpoint | None = None) -> LoadedModel:
    """A checkpoint folder; name and revision: as given (a stand-in repository's folder and revision)."""
    if read is not None and read.path != path:
        raise ValueError(f"tensors read from {read.path}, not {path}")
    if is_converted(path):
        cfg, params, meta = load_converted(path, DTYPES[dtype])
        check_finite(dict(zip(*_named_leaves(params))), path)
        params = place(params, dtype, mesh) if mesh is not None else params
        stored = meta.get("source", {})
        named = stored.get("name") if revision is None else None  # a stand-in repository's revision: its name
        source = {"name": named or name, "revision": revision if revision is not None else stored.get("revision"),
                  "path": str(path), "checksum": meta["checksum"]}
        weights = checkpoint_weights(source["revision"], source["name"], path)
    else:
        if read is None:
            cfg, tensors, checksum = read_hf_tensors(path, put=jax.device_put)  # each copied as it is read
        else:  # the same tensors, in the same order, from host memory
            cfg, checksum = read.cfg, read.checksum
            tensors = {n: jax.device_put(t) for n, t in read.tensors.items()}
        check_finite(tensors, path)
        params = place(tensors, dtype, mesh, build=lambda t: tensors_to_params(t, cfg, jnp))
        del tensors
        source = {"name": name, "revision": revision, "path": str(path), "checksum": checksum}
        weights = checkpoint_weights(revision, path)
    return LoadedModel(cfg, params, weights, source, dtype, tokenizer_dir=path)


@dataclasses.dataclass
class HostCheckpoint:
    """A Hugging Face checkpoint folder read into host memory: its config, its tensors as stored
    (copies, not views of the files) and its checksum, as read_hf_tensors gives them."""
    path: Path
    cfg: ModelConfig
    tensors: dict
    checksum: str


def read_to_host(path: Path) -> HostCheckpoint:
    """The checkpoint folder's tensors copied out of its memory-mapped files, for load_model(read=...)."""
    cfg, tensors, checksum = read_hf_tensors(path, put=np.array)
    return HostCheckpoint(path, cfg, tensors, checksum)


@jax.jit
def _all_finite(x):
    return jnp.isfinite(x).all()


def _named_leaves(params: dict) -> tuple[list[str], list]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [".".join(str(getattr(k, "key", k)) for k in p) for p, _ in leaves], [x for _, x in leaves]


def check_finite(tensors: dict, where) -> None:
    """Refuse weights holding NaN or infinite values, naming the first such tensor: one fused
    all-finite reduction per floating tensor where it lies (compiled once per shape), the flags
    fetched together."""
    names = [n for n, t in tensors.items() if jnp.issubdtype(t.dtype, jnp.floating)]
    flags = jax.device_get([_all_finite(tensors[n]) for n in names])
    bad = [n for n, ok in zip(names, flags) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more tensor{'s' * (len(bad) > 2)})" if len(bad) > 1 else ""
        raise UserError(f"tensor {bad[0]} in {where} holds NaN or infinite values{more}: the checkpoint is damaged "
                        "or diverged")
