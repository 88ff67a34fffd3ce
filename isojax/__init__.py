"""isojax: exact, fast isotropy measurements of language-model representations in JAX (eleven families).

Notebook API:
    model = isojax.load_model("pythia-70m")          # or a directory, a hub id, "random:pythia-1.4b"
    states = model.hidden_states(token_ids)          # [L+2, T, D]: embed, block_1..block_L, final_ln
    results = isojax.measure("pythia-70m", ["corpus.jsonl"], max_tokens=10**6)
    results.layers, results.intra_sim_SxV, results.save("out/70m"), results.plot("plots/")
    df = isojax.load("out/70m")                      # a run's or a sweep's layers as a pandas DataFrame
"""

import os

# XLA warns on every multi-device compile that GSPMD, which isojax chooses (device/mesh.py), will be
# deprecated: noise the user cannot act on. Set TF_CPP_MIN_LOG_LEVEL to see XLA's warnings.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import importlib

# Loaded on first use: the tokenizer's worker processes import isojax.data alone, without JAX
# (importing JAX in each of 16 workers held back a first run's first tokens by seconds).
_WHERE = {"Results": "isojax.run.measure", "measure": "isojax.run.measure", "ModelConfig": "isojax.model.config",
          "preset": "isojax.hf.family.presets", "preset_names": "isojax.hf.family.presets", "UserError": "isojax.errors",
          "LoadedModel": "isojax.hf.loading", "load_model": "isojax.hf.loading",
          "MeasureConfig": "isojax.run.config", "load": "isojax.run.frames"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'isojax' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__():
    return sorted(list(globals()) + __all__)
