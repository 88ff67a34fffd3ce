"""isojax: exact, fast isotropy measurements of GPT-NeoX representations in JAX.

Notebook API:
    model = isojax.load_model("pythia-70m")          # or a directory, a hub id, "random:pythia-1.4b"
    states = model.hidden_states(token_ids)          # [L+2, T, D]: embed, block_1..block_L, final_ln
    results = isojax.measure("pythia-70m", ["corpus.jsonl"], max_tokens=10**6)
    results.layers, results.intra_sim_SxV, results.save("out/70m"), results.plot("plots/")
"""

from isojax.api import Results, measure
from isojax.config import GPTNeoXConfig, preset, preset_names
from isojax.errors import UserError
from isojax.loading import LoadedModel, load_model

__all__ = ["GPTNeoXConfig", "LoadedModel", "Results", "UserError", "load_model", "measure", "preset", "preset_names"]
