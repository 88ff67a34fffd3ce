"""Hardware a run can be planned for without it (extract --dry-run --target KIND): each kind's
platform, memory per chip and the slice sizes it comes in.

Names follow the vendors'. Google names v4 and v5p slices by TensorCores, two per chip (v4-8 and
v5p-8 are 4 chips; v5p-64 is 32), and v5e and v6e slices by chips (v5e-8 is 8 chips; Cloud
calls v5e slices v5litepod-N). A JAX device is a chip on all four (v4 and v5p run their two
TensorCores as one "megacore" device). GPUs are counted one by one.

Hosts: TPU v4 and v5p 4 chips a host, v5e and v6e 8 (cloud.google.com/tpu/docs/v5e, /v6e: v5e 2x4 is
8 chips on 1 host, 4x4 16 chips on 2), GPUs counted as hosts of 8.

Memory per chip (device memory JAX can use; GPUs at extract's XLA_PYTHON_CLIENT_MEM_FRACTION):
  TPU v4   32 GiB HBM2     cloud.google.com/tpu/docs/v4
  TPU v5e  16 GiB HBM2     cloud.google.com/tpu/docs/v5e
  TPU v5p  95 GiB HBM2e    cloud.google.com/tpu/docs/v5p
  TPU v6e  32 GiB HBM      cloud.google.com/tpu/docs/v6e
  H100     80 GiB HBM3     nvidia.com/en-us/data-center/h100 (SXM)
  H200    141 GB  HBM3e    nvidia.com/en-us/data-center/h200
  A100     40 or 80 GiB    nvidia.com/en-us/data-center/a100
"""

from __future__ import annotations

import dataclasses
import re

from isojax.errors import UserError

GiB = 1 << 30
GPU_MEMORY_FRACTION = 0.90  # extract's XLA_PYTHON_CLIENT_MEM_FRACTION


@dataclasses.dataclass(frozen=True)
class Kind:
    platform: str  # "tpu" or "gpu"
    chip_memory: int  # bytes per chip
    per_chip: int  # the name's count per chip: 2 TensorCores (v4, v5p), else 1
    sizes: tuple[int, ...]  # the counts a slice of this kind comes in, as the name counts them
    chips_per_host: int  # a host's chips (one isojax process each host): v4, v5p 4; v5e, v6e 8 (fewer: one host); GPUs 8


_PODS = tuple(2 ** k for k in range(3, 13))  # v4-8 ... v4-4096, v5p-8 ... v5p-4096 (TensorCores)
_LITE = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e and v6e slices (chips)
_GPUS = tuple(2 ** k for k in range(0, 11))  # 1 ... 1024 GPUs (one to 128 hosts of 8)

KINDS = {
    "tpu-v4": Kind("tpu", 32 * GiB, 2, _PODS, 4),
    "tpu-v5e": Kind("tpu", 16 * GiB, 1, _LITE, 8),
    "tpu-v5p": Kind("tpu", 95 * GiB, 2, _PODS, 4),
    "tpu-v6e": Kind("tpu", 32 * GiB, 1, _LITE, 8),
    "gpu-h100": Kind("gpu", int(GPU_MEMORY_FRACTION * 80 * GiB), 1, _GPUS, 8),
    "gpu-h200": Kind("gpu", int(GPU_MEMORY_FRACTION * 141e9), 1, _GPUS, 8),
    "gpu-a100-40g": Kind("gpu", int(GPU_MEMORY_FRACTION * 40 * GiB), 1, _GPUS, 8),
    "gpu-a100-80g": Kind("gpu", int(GPU_MEMORY_FRACTION * 80 * GiB), 1, _GPUS, 8),
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. tpu-v5p-64
    kind: str  # e.g. tpu-v5p
    platform: str
    chips: int  # JAX devices
    chip_memory: int

    @property
    def hosts(self) -> int:
        """The slice's hosts (VMs), one isojax process each: v4 and v5p 4 chips a host (v5p-32: 16 chips
        on 4 hosts), v5e and v6e 8 (slices of 8 chips or fewer: one host; v5e-16: 2), GPUs 8 a host."""
        return -(-self.chips // KINDS[self.kind].chips_per_host)

    def slice(self, count: int) -> Target:
        """The slice of this kind of `count` (as the name counts)."""
        return parse(f"{self.kind}-{count}")


def parse(name: str) -> Target:
    """tpu-v5p-64 -> its Target; an unknown kind or size: a UserError naming the kinds."""
    match = re.fullmatch(r"(.+)-(\d+)", name or "")
    kind = KINDS.get(match.group(1)) if match else None
    if kind is None:
        raise UserError(f"unknown --target {name!r}; kinds: {', '.join(k + '-N' for k in KINDS)} "
                        "(N: chips; TensorCores for tpu-v4 and tpu-v5p, two per chip)")
    count = int(match.group(2))
    if count not in kind.sizes:
        raise UserError(f"--target {name}: {match.group(1)} comes in sizes {', '.join(map(str, kind.sizes))}")
    return Target(name, match.group(1), kind.platform, count // kind.per_chip, kind.chip_memory)


def slices(target: Target) -> list[Target]:
    """The slices of target's kind, from the smallest up (to find the smallest that fits)."""
    return [target.slice(count) for count in KINDS[target.kind].sizes]
