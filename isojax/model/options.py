"""Trace-time settings of the forward: one frozen, hashable object handed to the model (the
statistics' own are isojax.stats.options.StatsOptions), and the run's kernels, chosen once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The forward's kernels, chosen once (isojax.device.kernel_choice, by the step's plan) and handed
    whole to the model builder (isojax.hf.loading.build_module): ForwardOptions' attention,
    mlp_kernel and norm_kernel. reasons: (kernel, why) pairs, what the plan said of each choice;
    not part of the choice's identity."""

    attention: str = "xla"
    mlp: str = "xla"
    norm: str = "xla"
    reasons: tuple = dataclasses.field(default=(), compare=False)

    def forward_options(self) -> ForwardOptions:
        return ForwardOptions(attention=self.attention, mlp_kernel=self.mlp, norm_kernel=self.norm)


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Trace-time settings of the forward (GPT-NeoX states do not depend on them beyond the
    tolerances README "bfloat16" documents)."""

    # "xla" (plain attention, the exact reference), "cudnn" (jax.nn.dot_product_attention's
    # cuDNN kernel, bf16/fp16 only), "pallas" (Pallas flash attention for TPUs, with segment ids;
    # rows a multiple of 128), "packed" (isojax.kernels.packed_attention: a Pallas kernel for GPUs that
    # reads the fused projection, rotates q and k itself and skips the key blocks outside each
    # query block's sequences) or "auto" (jax picks)
    attention: str = "xla"
    # Exact GELU of bf16 activations in float32 with a cheap rational erf (isojax.numerics.gelu); False:
    # jax's erf (bench/breakdown.py measures the difference)
    fast_gelu: bool = True
    # Tell cuDNN that the (already causal) mask is causal, so it skips the blocks above the
    # diagonal
    cudnn_causal: bool = True
    # The MLP's first product with bias and GELU, or a gated MLP's two with SiLU and their product:
    # "xla" (cuBLAS, then elementwise passes) or "mosaic" (one Hopper kernel with the rest in its
    # epilogue, isojax.kernels.mlp; where it does not apply, XLA's)
    mlp_kernel: str = "xla"
    # A parallel-residual block's two LayerNorms: "xla" (two kernels) or "pallas" (one Triton
    # kernel reading the state once, isojax.kernels.norm; where it does not apply, XLA's)
    norm_kernel: str = "xla"
    # The GPU the kernels lower for ("sm_90": Hopper, "sm_80": Ampere), for extract --dry-run's export
    # to a GPU target, on any machine: the Pallas kernels as the GPU compiles them (not in Pallas'
    # interpret mode), the Hopper MLP kernel where the target is one; "": as this machine
    gpu_arch: str = ""
    # Sharding the activations [B, T, D] keep between blocks (rows over every device, so that
    # XLA gathers sharded weights rather than splitting activations); None on one device
    activation_sharding: Any = None

    def __post_init__(self):
        if self.attention not in ("xla", "cudnn", "pallas", "packed", "auto"):
            raise ValueError(f"attention must be xla, cudnn, pallas, packed or auto, not {self.attention!r}")
        if self.mlp_kernel not in ("xla", "mosaic"):
            raise ValueError(f"mlp_kernel must be xla or mosaic, not {self.mlp_kernel!r}")
        if self.norm_kernel not in ("xla", "pallas"):
            raise ValueError(f"norm_kernel must be xla or pallas, not {self.norm_kernel!r}")
        if self.gpu_arch not in ("", "sm_80", "sm_90"):
            raise ValueError(f"gpu_arch must be '', sm_80 or sm_90, not {self.gpu_arch!r}")

    def interpret(self) -> bool | None:
        """The Pallas kernels' interpret argument: False when lowering for gpu_arch, else None (the
        kernel's own rule: interpreted off a GPU)."""
        return False if self.gpu_arch else None

    def hopper(self) -> bool | None:
        """Whether the Hopper MLP kernel's GPU is the one lowered for; None: as this machine."""
        return self.gpu_arch == "sm_90" if self.gpu_arch else None

    def devices(self) -> int:
        return 1 if self.activation_sharding is None else self.activation_sharding.mesh.size

    def per_device(self, fn, sharded, replicated):
        """fn(*sharded, *replicated) on each device's rows (shard_map over the activation
        sharding; the leading axis of every `sharded` array is the rows'); a kernel XLA cannot
        partition would otherwise be gathered onto every device."""
        if self.activation_sharding is None:
            return fn(*sharded, *replicated)
        P = jax.sharding.PartitionSpec
        spec = self.activation_sharding.spec
        row_spec = lambda x: P(spec[0], *([None] * (x.ndim - 1)))
        return jax.shard_map(fn, mesh=self.activation_sharding.mesh,
                             in_specs=tuple(map(row_spec, sharded)) + (P(),) * len(replicated),
                             out_specs=spec if len(spec) else P(), check_vma=False)(*sharded, *replicated)

    def constrain(self, x):
        if self.activation_sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)
