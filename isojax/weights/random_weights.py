"""`weights --model random:<preset>`: the tensors the command reads, made as the extract command's
random weights are (isojax.hf.loading.random_params), under GPT-NeoX's Hugging Face names."""

from __future__ import annotations

import numpy as np

from isojax.errors import UserError

EMBED_IN, EMBED_OUT = "gpt_neox.embed_in.weight", "embed_out.weight"
LN_G, LN_B = "gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"

class RandomWeights:
    """`random:<preset>`: the four tensors this command reads, from `loading.random_params` (the
    weights `load_model("random:<preset>")` runs), under their Hugging Face names and layout."""

    format = "random"
    NAMES = (EMBED_IN, EMBED_OUT, LN_G, LN_B)

    def __init__(self, preset_name: str, only=None):
        import jax

        from isojax.hf.family.presets import preset
        from isojax.hf.loading import random_params

        for name in only or ():
            self._check(name)
        cfg = preset(preset_name)
        # jitted and trimmed, XLA skips the blocks' initializers: same values, a fraction of the work
        p = jax.jit(lambda: {k: v for k, v in random_params(cfg).items() if k != "layers"})()
        # flax's embed_out is [D, V]; Hugging Face stores embed_out.weight as [V, D] like embed_in
        self._t = {EMBED_IN: np.asarray(p["embed_in"], np.float32),
                   EMBED_OUT: np.ascontiguousarray(np.asarray(p["embed_out"], np.float32).T),
                   LN_G: np.asarray(p["final_layer_norm"]["scale"], np.float32),
                   LN_B: np.asarray(p["final_layer_norm"]["bias"], np.float32)}

    def _check(self, name: str) -> None:
        if name not in self.NAMES:
            raise UserError(f"random weights hold only {', '.join(self.NAMES)}, not {name!r}")

    def names(self) -> list[str]:
        return sorted(self.NAMES)

    def shape(self, name) -> tuple:
        self._check(name)
        return self._t[name].shape

    def dtype(self, name) -> str:
        return "float32"

    def read(self, name) -> np.ndarray:
        self.shape(name)
        return self._t[name]

    rows = read
