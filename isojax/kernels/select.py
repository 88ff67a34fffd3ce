"""Which kernel runs where, decided in one place before any weights load (check_*) and once the
rows per device are known (choose_*): the fused MLP (mlp), the LayerNorm pair (norm) and attention
over packed rows (packed_attention), each where it applies and its probe (`works`) passes here,
else XLA's path. An explicit choice that cannot run is a UserError."""

from __future__ import annotations

from isojax.errors import UserError
from isojax.log import log
from isojax.model.config import ACTIVATIONS
from isojax.model.ops import DTYPES


def check_mlp_kernel(mlp_kernel: str, dtype: str) -> None:
    """Refuse what choose_mlp_kernel cannot honour, before any weights load."""
    if mlp_kernel not in ("auto", "xla", "mosaic"):
        raise UserError(f"mlp_kernel must be auto, xla or mosaic, not {mlp_kernel!r}")
    if mlp_kernel == "mosaic" and dtype != "bfloat16":
        raise UserError("mlp kernel mosaic needs bfloat16")
    if mlp_kernel == "mosaic":
        from isojax.kernels import mlp as kernels
        if (why := kernels.works()) is not None:
            raise UserError(f"mlp kernel mosaic does not run here: {why}")


def choose_mlp_kernel(mlp_kernel: str, cfg, dtype: str, device_rows: int, check: bool = True) -> str:
    """auto: the Mosaic kernel (isojax.kernels.mlp) where it applies (bfloat16, Hopper GPUs, a
    device's rows and the model's widths tile) and works, else XLA's path; mosaic where it does not
    apply: an error. check=False: what it chooses if the kernel works, without trying it or saying
    anything (run/plan.py compiles the step for that while the check runs)."""
    from isojax.kernels import mlp as kernels
    if mlp_kernel == "xla":
        return "xla"
    fits = kernels.applies(device_rows, cfg.hidden_size, cfg.intermediate_size, DTYPES[dtype]) \
        and exact_gelu_with_bias(cfg)
    if mlp_kernel == "mosaic" and not fits:
        raise UserError(f"mlp kernel mosaic does not apply to {device_rows} rows per device of "
                        f"[{cfg.hidden_size}] x [{cfg.hidden_size}, {cfg.intermediate_size}] ({cfg.hidden_act}"
                        f"{', gated' if cfg.gated_mlp else ''}{'' if cfg.mlp_bias else ', no bias'})")
    if not exact_gelu_with_bias(cfg) and check:
        log(f"the fused MLP kernel does not apply to this {cfg.family} MLP ({cfg.hidden_act}"
            f"{', gated' if cfg.gated_mlp else ''}{'' if cfg.mlp_bias else ', no bias'}, {device_rows} rows per "
            "device): XLA's path")
    if fits and check and (why := kernels.works()) is not None:
        log(f"the fused MLP kernel does not run here ({why}): XLA's path instead")
        return "xla"
    return "mosaic" if fits else "xla"


def exact_gelu_with_bias(cfg) -> bool:
    """Whether the model's MLP is the fused kernel's: up-projection with bias, then the exact GELU."""
    return cfg.hidden_act in ACTIVATIONS and not ACTIVATIONS[cfg.hidden_act] and not cfg.gated_mlp and cfg.mlp_bias


def layer_norm_pair(cfg) -> bool:
    """Whether each block reads two LayerNorms (scale and bias) of one state, the norm kernel's case."""
    return (cfg.use_parallel_residual and not cfg.shared_input_norm and not cfg.post_sublayer_norms
            and cfg.norm == "layer")


def check_norm_kernel(norm_kernel: str, dtype: str) -> None:
    """Refuse what choose_norm_kernel cannot honour, before any weights load."""
    import jax
    if norm_kernel not in ("auto", "xla", "pallas"):
        raise UserError(f"norm_kernel must be auto, xla or pallas, not {norm_kernel!r}")
    if norm_kernel == "pallas" and (dtype != "bfloat16" or jax.default_backend() != "gpu"):
        raise UserError("norm kernel pallas is a GPU kernel for bfloat16 runs")


def choose_norm_kernel(norm_kernel: str, cfg, dtype: str, device_rows: int, check: bool = True) -> str:
    """auto: one Pallas kernel for a parallel-residual block's two LayerNorms (isojax.kernels.norm)
    where it applies (bfloat16 on a GPU, a power-of-two width) and works, else XLA's; pallas where
    it does not apply: an error. check=False: as choose_mlp_kernel's."""
    import jax

    from isojax.kernels import norm as kernel
    if norm_kernel == "pallas" and not layer_norm_pair(cfg):
        raise UserError("norm kernel pallas fuses a parallel-residual block's two LayerNorms; this model "
                        "has sequential residuals or other norms")
    if norm_kernel == "xla":
        return "xla"
    if not layer_norm_pair(cfg):
        if cfg.family != "gpt_neox" and check:  # GPT-NeoX's sequential blocks are told apart by their config already
            log(f"the LayerNorm-pair kernel does not apply to this {cfg.family} block: XLA's norms")
        return "xla"
    d = cfg.hidden_size
    fits = jax.default_backend() == "gpu" and kernel.applies(d, DTYPES[dtype]) \
        and device_rows % kernel.rows_per_block(d) == 0
    if norm_kernel == "pallas" and not fits:
        raise UserError(f"norm kernel pallas does not apply to {device_rows} rows per device of width {d}")
    why = kernel.works(d) if fits and check else None
    if why is not None:
        if norm_kernel == "pallas":
            raise UserError(f"norm kernel pallas does not run here: {why}")
        log(f"the LayerNorm kernel does not run here ({why}): XLA's LayerNorms instead")
    return "pallas" if fits and why is None else "xla"


def choose_attention(attention: str, auto: bool, cfg, dtype: str, row_len: int, check: bool = True) -> str:
    """The attention kernel for these rows. packed (isojax.kernels.packed_attention) where it applies
    (rotary positions without q/k norms or clipping, powers-of-two head and rotary dims, rows of a
    multiple of 64; any number of key/value heads) and works here, else, under
    auto, cuDNN; cuDNN and Pallas's TPU kernel need rows of a multiple of 64 and 128, else, under
    auto, plain XLA. An explicit choice that cannot run is an error. check=False: as
    choose_mlp_kernel's."""
    from isojax.kernels import packed_attention
    why = None
    if attention == "packed":
        if cfg.learned_positions or cfg.qk_norm or cfg.clip_qkv is not None:
            why = ("is for rotary attention without q/k norms or clipping (this "
                   f"{cfg.family} has {'learned positions' if cfg.learned_positions else 'q/k norms or clip_qkv'})")
        elif not packed_attention.applies(row_len, cfg.head_dim, cfg.rotary_dims, DTYPES[dtype]):
            why = (f"needs head and rotary dims that are powers of two >= 16 (here {cfg.head_dim} and "
                   f"{cfg.rotary_dims}) and rows of a multiple of 64 tokens (seq_len {row_len})")
        elif check:
            why = packed_attention.works(cfg.head_dim, cfg.rotary_dims)
        if why is None:
            return "packed"
        if not auto:
            raise UserError(f"attention packed {why}")
        if check:
            log(f"packed attention does not run here ({why}): cuDNN's instead")
        attention = "cudnn"
    multiple = {"cudnn": 64, "pallas": 128}.get(attention, 1)
    if row_len % multiple:
        if not auto:
            raise UserError(f"attention {attention} needs rows of a multiple of {multiple} tokens (seq_len {row_len})")
        return "xla"
    return attention
