"""What a run opens before its first step: the model's config (early, where cheap), its tokenizer,
the weights placed on the mesh, and the corpus's token cache or the stream building it."""

from __future__ import annotations

import copy
from pathlib import Path

from isojax.errors import UserError
from isojax.log import log

DEFAULT_MODEL = "pythia-70m"


def peek_config(name: str):
    """The model's config without loading weights, where that is cheap (presets, local dirs)."""
    from isojax.hf.family import read_hf_config
    from isojax.hf.family.presets import base_preset, preset
    if name.startswith("random:") or base_preset(name):
        return preset(name.removeprefix("random:"))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return read_hf_config(path)
    return None


def load(model, revision, dtype: str, mesh, ahead=None):
    """The model's weights in `dtype` on `mesh`. A LoadedModel given is left as it is: the run
    gets a copy of it (the tokenizer it loaded kept), its params placed anew. ahead: a sweep's
    LoadAhead (run/load_ahead.py), which may hold them read already."""
    from isojax import faults
    from isojax.hf.loading import LoadedModel, load_model, place
    faults.reached("weights_read")
    if isinstance(model, LoadedModel):
        ours = copy.copy(model)
        ours.params, ours.source = place(model.params, dtype, mesh), dict(model.source)
        ours.dtype = dtype
        return ours
    if model is not None:
        read = ahead.take(model, revision, dtype, mesh) if ahead is not None else None
        if isinstance(read, LoadedModel):
            return read
        return load_model(model, revision=revision, dtype=dtype, mesh=mesh, read=read)
    try:
        return load_model(DEFAULT_MODEL, revision=revision, dtype=dtype, mesh=mesh)
    except UserError as e:  # offline and not cached: the demo runs on random weights, saying why
        from isojax.hf.network import hub_reachable
        if hub_reachable():  # the hub answered: its refusal (unknown revision, an error) is the user's to see
            raise
        log(f"could not load {DEFAULT_MODEL} ({e})")
        log("*" * 72)
        log(f"WARNING: RANDOM WEIGHTS of {DEFAULT_MODEL}'s shapes: the results describe an untrained model")
        log("*" * 72)
        return load_model(f"random:{DEFAULT_MODEL}", dtype=dtype, mesh=mesh)


def tokenizer_without_weights(model, cfg):
    """(tokenizer, description, hf.tokenizer.Bos) where it is found without loading the weights
    (random presets, local checkpoint directories, a LoadedModel), so that tokenizing starts while
    they load; else None."""
    from isojax.hf.family.presets import hub_id
    from isojax.hf.loading import LoadedModel
    from isojax.hf.tokenizer import load_tokenizer, tokenizer_bos
    if isinstance(model, LoadedModel):
        return model.tokenizer, model.source["tokenizer"], model.bos
    if model is None or cfg is None:
        return None
    path = None if model.startswith("random:") else Path(model).expanduser()
    if path is not None and not path.is_dir():
        return None
    tok, desc = load_tokenizer(path, cfg, hub_repo=hub_id(cfg.name) if path is None else None)
    return tok, desc, tokenizer_bos(tok, path, desc)


def row_length(cfg, unit: str, seq_len) -> int:
    row_len = seq_len or (512 if unit == "sentence" else cfg.max_position_embeddings)
    if row_len > cfg.max_position_embeddings:
        raise UserError(f"seq_len must be in [1, {cfg.max_position_embeddings}] (the model's context)")
    return row_len


def open_tokens(corpus, tokenizer, row_len: int, progress: bool, bos: int | None = None):
    """The corpus's token cache, or a TokenStream building it (a first run) that the devices
    follow; bos: an id put before each unit (None: none). A hub dataset is tokenized first: knowing its sources up front (Corpus.labels)
    would cost a second download. In a multi-process run each process reads only its share
    (data/shares.py), where the corpus allows (Corpus.shareable)."""
    import jax

    from isojax.data import stream_tokens, tokenize_corpus
    from isojax.data.shares import HostShare
    from isojax.hf.loading import cache_root
    where = dict(cache_dir=cache_root() / "tokens", max_len=row_len, bos=bos)
    if jax.process_count() > 1 and corpus.shareable():
        return HostShare(corpus, tokenizer, progress=progress, **where)
    if any(inp.kind == "hub" for inp in corpus.inputs):
        return tokenize_corpus(corpus, tokenizer, progress=progress, **where)
    return stream_tokens(corpus, tokenizer, **where)
