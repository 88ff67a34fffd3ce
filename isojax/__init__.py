"""isojax: exact, fast isotropy measurements of GPT-NeoX representations in JAX.

Notebook API:
    model = isojax.load_model("pythia-70m")          # or a directory, a hub id, "random:pythia-1.4b"
    states = model.hidden_states(token_ids)          # [L+2, T, D]: embed, block_1..block_L, final_ln
"""

from isojax.config import GPTNeoXConfig, preset, preset_names
from isojax.errors import UserError
from isojax.loading import LoadedModel, load_model

__all__ = ["GPTNeoXConfig", "LoadedModel", "UserError", "load_model", "preset", "preset_names"]
