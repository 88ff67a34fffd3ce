"""The GPT-NeoX model: configuration and presets (config), the forward's options (options), the Flax
modules (gpt_neox) and the numerics shared with the kernels (ops)."""
