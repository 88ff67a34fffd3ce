"""Which kernel runs where, decided in one place before any weights load (check_*) and once the
rows per device are known (choose_*, each a (kernel, reason) pair; run/plan.py makes the run's one
KernelChoice of them): the fused MLPs (isojax.kernels.mlp), the LayerNorm pair (norm) and attention
over packed rows (packed_attention), each where it applies and its probe (`works`) passes here,
else XLA's path. An explicit choice that cannot run is a UserError. A probe's outcome is kept
(CheckRecord) per card, driver, versions, kernel source and arguments, so a machine pays it once."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from isojax import numerics
from isojax.atomic import write_atomic
from isojax.errors import UserError
from isojax.log import log
from isojax.model.config import ACTIVATIONS
from isojax.model.options import KernelChoice

RECHECK = "ISOJAX_RECHECK_KERNELS"  # set (not 0): every probe runs again, and its record is rewritten


@functools.cache
def environment() -> dict:
    """What besides the kernel's source and arguments can change a probe's outcome: the card, the
    NVIDIA driver (its /proc line, where the host has one), the backend's platform_version (CUDA's
    on GPUs) and the versions of jax, jaxlib, their plugins and the NVIDIA libraries installed."""
    import jax
    device = jax.devices()[0]
    try:
        driver = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        driver = None
    packages = sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in importlib.metadata.distributions()
                       if (d.metadata["Name"] or "").lower().startswith(("jax", "nvidia-"))})
    return dict(device_kind=device.device_kind, platform_version=device.client.platform_version, driver=driver,
                packages=packages)


def source_hash(*files) -> str:
    return hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()


class CheckRecord:
    """Kernel probes' outcomes kept in `folder` (None: none kept), one JSON file per key: the
    kernel, its arguments, the bytes of its module and of isojax/numerics.py, and environment(). A record
    that cannot be read or does not hold its key is ignored (the probe runs and rewrites it); one
    that cannot be written is skipped. `used`: the kernels whose recorded outcome was taken."""

    def __init__(self, folder):
        self.folder = None if folder is None else Path(folder)
        self.used = []

    def outcome(self, kernel, args: dict, run: bool = True) -> str | None:
        """kernel.works(**args): None where the kernel works here, else why not. From the record
        where it holds it; else run and recorded, or with run=False assumed to work (None)."""
        if self.folder is None:
            return kernel.works(**args) if run else None
        name = kernel.__name__.rpartition(".")[2]
        key = dict(kernel=kernel.__name__, args=args, source=source_hash(kernel.__file__, numerics.__file__),
                   **environment())
        path = self.folder / f"{name}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"
        if os.environ.get(RECHECK, "0") in ("", "0"):
            try:
                record = json.loads(path.read_text())
                why = record["why"]
                if record["key"] == key and record["passed"] is (why is None) and isinstance(why, (str, type(None))):
                    if run:
                        self.used.append(name)
                    return why
            except (OSError, ValueError, KeyError, TypeError):
                pass
        if not run:
            return None
        why = kernel.works(**args)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(dict(key=key, passed=why is None, why=why), indent=1, sort_keys=True))
        except OSError:
            pass
        return why


NO_RECORD = CheckRecord(None)


def check_mlp_kernel(mlp_kernel: str, dtype: str, record: CheckRecord = NO_RECORD) -> None:
    """Refuse what choose_mlp_kernel cannot honour, before any weights load (an explicit mosaic's
    probe through `record`, as the plan's own)."""
    if mlp_kernel not in ("auto", "xla", "mosaic"):
        raise UserError(f"mlp_kernel must be auto, xla or mosaic, not {mlp_kernel!r}")
    if mlp_kernel == "mosaic" and dtype != "bfloat16":
        raise UserError("mlp kernel mosaic needs bfloat16")
    if mlp_kernel == "mosaic":
        from isojax.kernels import mlp as kernels
        if (why := record.outcome(kernels, {})) is not None:
            raise UserError(f"mlp kernel mosaic does not run here: {why}")


def choose_mlp_kernel(mlp_kernel: str, cfg, dtype: str, device_rows: int, check: bool = True,
                      record: CheckRecord = NO_RECORD) -> tuple[str, str]:
    """(kernel, why). auto: the GELU MLP's Mosaic kernel (isojax.kernels.mlp; fused_mlp(cfg) says which
    kernel a model's MLP takes) where it applies (bfloat16, Hopper GPUs, a device's rows and the
    model's widths tile) and works, else XLA's path; the gated kernel only when asked for (mosaic),
    since it was no faster than XLA's path in the step; mosaic where it does not apply: an error. check=False: what it chooses if the kernel
    works, without trying it or saying anything (run/plan.py compiles the step for that while the
    check runs), or as `record` holds it."""
    from isojax.kernels import mlp as kernels
    if mlp_kernel == "xla":
        return "xla", "asked for"
    d, f, fused = cfg.hidden_size, cfg.intermediate_size, fused_mlp(cfg)
    shape = f"{cfg.hidden_act}{', gated' if cfg.gated_mlp else ''}{'' if cfg.mlp_bias else ', no bias'}"
    gated = fused == "swiglu"
    fits = fused is not None and kernels.applies(device_rows, d, f, numerics.DTYPES[dtype], gated)
    if mlp_kernel == "mosaic" and not fits:
        raise UserError(f"mlp kernel mosaic does not apply to {device_rows} rows per device of [{d}] x [{d}, {f}] "
                        f"({shape})")
    if fused is None:
        why = f"the fused MLP kernels do not apply to this {cfg.family} MLP ({shape}, {device_rows} rows per " \
              "device): XLA's path"
        if check:
            log(why)
        return "xla", why
    if not fits:
        return "xla", f"the fused MLP kernel does not apply to {device_rows} rows per device of [{d}] x [{d}, {f}] " \
                      f"in {dtype} here: XLA's path"
    if gated and mlp_kernel == "auto":
        return "xla", "the gated MLP kernel applies but was no faster than XLA's path in the step (bench/RESULTS.md " \
                      "14): XLA's path (--mlp-kernel mosaic runs it)"
    if (failed := record.outcome(kernels, dict(gated=True) if gated else {}, run=check)) is not None:
        why = f"the fused MLP kernel does not run here ({failed}): XLA's path instead"
        if check:
            log(why)
        return "xla", why
    return "mosaic", "applies and works here"


def fused_mlp(cfg) -> str | None:
    """Which fused MLP kernel serves the model: "gelu" (up-projection with bias, then the exact GELU:
    dense_gelu), "swiglu" (SiLU-gated, no biases: dense_swiglu) or None."""
    if cfg.hidden_act in ACTIVATIONS and not ACTIVATIONS[cfg.hidden_act] and not cfg.gated_mlp and cfg.mlp_bias:
        return "gelu"
    if cfg.gated_mlp and cfg.hidden_act == "silu" and not cfg.mlp_bias:
        return "swiglu"
    return None


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


def choose_norm_kernel(norm_kernel: str, cfg, dtype: str, device_rows: int, check: bool = True,
                       record: CheckRecord = NO_RECORD) -> tuple[str, str]:
    """(kernel, why). auto: one Pallas kernel for a parallel-residual block's two LayerNorms
    (isojax.kernels.norm) where it applies (bfloat16 on a GPU, a power-of-two width) and works, else
    XLA's; pallas where it does not apply: an error. check=False: as choose_mlp_kernel's."""
    import jax

    from isojax.kernels import norm as kernel
    if norm_kernel == "pallas" and not layer_norm_pair(cfg):
        raise UserError("norm kernel pallas fuses a parallel-residual block's two LayerNorms; this model "
                        "has sequential residuals or other norms")
    if norm_kernel == "xla":
        return "xla", "asked for"
    if not layer_norm_pair(cfg):
        why = f"the LayerNorm-pair kernel does not apply to this {cfg.family} block: XLA's norms"
        if cfg.family != "gpt_neox" and check:  # GPT-NeoX's sequential blocks are told apart by their config already
            log(why)
        return "xla", why
    d = cfg.hidden_size
    fits = jax.default_backend() == "gpu" and kernel.applies(d, numerics.DTYPES[dtype]) \
        and device_rows % kernel.rows_per_block(d) == 0
    if norm_kernel == "pallas" and not fits:
        raise UserError(f"norm kernel pallas does not apply to {device_rows} rows per device of width {d}")
    if not fits:
        return "xla", f"the LayerNorm-pair kernel does not apply to {device_rows} rows per device of width {d} " \
                      f"in {dtype} on {jax.default_backend()}: XLA's norms"
    if (failed := record.outcome(kernel, dict(d=d), run=check)) is not None:
        why = f"the LayerNorm kernel does not run here ({failed}): XLA's LayerNorms instead"
        if check:
            if norm_kernel == "pallas":
                raise UserError(f"norm kernel pallas does not run here: {failed}")
            log(why)
        return "xla", why
    return "pallas", "applies and works here"


def choose_attention(attention: str, auto: bool, cfg, dtype: str, row_len: int, check: bool = True,
                     record: CheckRecord = NO_RECORD) -> tuple[str, str]:
    """(kernel, why): the attention kernel for these rows. packed (isojax.kernels.packed_attention)
    where it applies (a head dim that is a power of two >= 16, rotary dims 0 (learned positions)
    or a power of two >= 16, rows of a multiple of 64; any number of key/value heads, q/k norms,
    clip_qkv) and works here for these shapes, norms and clip, else, under auto, cuDNN; cuDNN and
    Pallas's TPU kernel need rows of a multiple of 64 and 128, else, under auto, plain XLA. An
    explicit choice that cannot run is an error. check=False: as choose_mlp_kernel's."""
    from isojax.kernels import packed_attention
    reason = f"auto: {attention} for this backend and dtype" if auto else "asked for"
    if attention == "packed":
        if not packed_attention.applies(row_len, cfg.head_dim, cfg.rotary_dims, numerics.DTYPES[dtype]):
            why = (f"needs a head dim that is a power of two >= 16, rotary dims 0 or powers of two >= 16 (here "
                   f"{cfg.head_dim} and {cfg.rotary_dims}) and rows of a multiple of 64 tokens (seq_len {row_len})")
        else:
            args = dict(head_dim=cfg.head_dim, rotary_dims=cfg.rotary_dims, qk_norm=cfg.qk_norm,
                        clip=cfg.clip_qkv is not None)
            why = record.outcome(packed_attention, args, run=check)
        if why is None:
            return "packed", "applies and works here"
        if not auto:
            raise UserError(f"attention packed {why}")
        reason = f"packed attention does not run here ({why}): cuDNN's instead"
        if check:
            log(reason)
        attention = "cudnn"
    multiple = {"cudnn": 64, "pallas": 128}.get(attention, 1)
    if row_len % multiple:
        if not auto:
            raise UserError(f"attention {attention} needs rows of a multiple of {multiple} tokens (seq_len {row_len})")
        return "xla", f"{reason}; {attention} needs rows of a multiple of {multiple} tokens (seq_len {row_len}): XLA's"
    return attention, reason


def kernel_choice(attention: tuple[str, str], mlp: tuple[str, str], norm: tuple[str, str]) -> KernelChoice:
    """The run's one KernelChoice of choose_attention's, choose_mlp_kernel's and choose_norm_kernel's
    (kernel, why) pairs."""
    return KernelChoice(attention[0], mlp[0], norm[0],
                        reasons=(("attention", attention[1]), ("mlp", mlp[1]), ("norm", norm[1])))
