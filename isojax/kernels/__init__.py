"""Fused kernels, one per file, importing only JAX and isojax.numerics: the MLP's first product with GELU
(mlp, Mosaic GPU), both LayerNorms of a block (norm, Pallas), attention over packed rows
(packed_attention, Pallas); which one runs where is decided in isojax.device.kernel_choice."""
