"""isojax: exact, fast isotropy measurements of GPT-NeoX representations in JAX.

Notebook API:
    model = isojax.load_model("pythia-70m")          # or a directory, a hub id, "random:pythia-1.4b"
    states = model.hidden_states(token_ids)          # [L+2, T, D]: embed, block_1..block_L, final_ln
    results = isojax.measure("pythia-70m", ["corpus.jsonl"], max_tokens=10**6)
    results.layers, results.intra_sim_SxV, results.save("out/70m"), results.plot("plots/")
"""

import os

# XLA warns on every multi-device compile that GSPMD, which isojax chooses (parallel.py), will be
# deprecated: noise the user cannot act on. Set TF_CPP_MIN_LOG_LEVEL to see XLA's warnings.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from isojax.api import Results, measure  # noqa: E402
from isojax.config import GPTNeoXConfig, preset, preset_names  # noqa: E402
from isojax.errors import UserError  # noqa: E402
from isojax.loading import LoadedModel, load_model  # noqa: E402

__all__ = ["GPTNeoXConfig", "LoadedModel", "Results", "UserError", "load_model", "measure", "preset", "preset_names"]
