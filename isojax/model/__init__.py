"""The decoder model: its configuration (config), the forward's options (options), the Flax trunk
(decoder), its layers (layers) and the numerics shared with the kernels (ops)."""
