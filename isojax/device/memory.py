"""Device-memory planning: the default batch per device, the step's estimated temporaries, what the
accumulators and weights take per device, and the mesh that makes them fit (ISOJAX_DEFAULTS picks
the platform whose defaults a run takes)."""

from __future__ import annotations

import os

from isojax.errors import UserError
from isojax.log import log


def defaults_platform() -> str:
    """The platform whose defaults a run takes (dtype, the default sample, the default batch, the
    embedded corpus's CPU cap): the backend's, unless ISOJAX_DEFAULTS names another. The lifecycle
    tests set ISOJAX_DEFAULTS=gpu to run on CPU the configuration a GPU run uses (bfloat16, the
    default sample); kernels are still chosen by the real backend, so XLA's paths stand in for the
    GPU kernels there."""
    import jax
    name = os.environ.get("ISOJAX_DEFAULTS") or jax.default_backend()
    if name not in ("cpu", "gpu", "tpu"):
        raise UserError(f"ISOJAX_DEFAULTS must be cpu, gpu or tpu, not {name!r}")
    return name


STEP_BYTES_PER_TOKEN_WIDTH = 48  # a step's temporaries per token and unit of width (measured 26-45)
FIT = 0.95  # of a device's memory for accumulators, weights and the step's estimated temporaries


def device_batch_tokens(cfg, on_accel: bool = True) -> int:
    """The default token slots per device and step. Small models are bound by per-kernel
    overheads: larger batches (bench/RESULTS.md). Per device, so that each device keeps its
    batch as devices are added."""
    return (262144 if cfg.hidden_size <= 1024 else 65536) if on_accel else 8192


def layer_params(cfg) -> int:
    """Parameters of one block, from ModelConfig's own count (every family: grouped or multi-query
    key/values, gated MLPs' three matrices, biases, norms). 12 d^2, the figure this replaced, is
    GPT-NeoX's 4 d^2 + 2 x d x 4d; a SwiGLU block of Mistral-7B's widths is 13 d^2, ~8% more."""
    return -(-cfg.non_embedding_params() // cfg.num_layers)  # the final norm's few parameters rounded in


def step_bytes(cfg, dtype: str, tokens_per_device: int, model_axis: int) -> int:
    """The step's temporaries per device, estimated: activations (STEP_BYTES_PER_TOKEN_WIDTH per
    token and width; peaks of 410m, 1.4b and 20b on H100s, bench/RESULTS.md 7c) and, with split
    parameters, three gathered layers."""
    layer = layer_params(cfg) * (2 if dtype == "bfloat16" else 4)
    return STEP_BYTES_PER_TOKEN_WIDTH * tokens_per_device * cfg.hidden_size + (3 * layer if model_axis > 1 else 0)


def memory_per_device(cfg, token_stats: bool, dtype: str, num_groups: int, n: int, model_axis: int,
                      sample_size: int = 0):
    """(accumulator bytes, weight bytes) on each of n devices with parameters (and Grams) split
    model_axis ways."""
    import jax.numpy as jnp

    from isojax.device.runner import MAX_GROUP_SPECTRA, per_device_accumulator_bytes
    need = per_device_accumulator_bytes(cfg, n, num_groups=num_groups, token_stats=token_stats, model_axis=model_axis,
                                        group_spectra=num_groups <= MAX_GROUP_SPECTRA, sample_size=sample_size,
                                        sample_dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    return need, (2 if dtype == "bfloat16" else 4) * cfg.param_count() // model_axis


def check_fits(cfg, token_stats: bool, dtype: str, num_groups: int, mesh, tokens_per_device: int,
               verbose: bool = False, sample_size: int = 0) -> None:
    """Refuse (a short message) what cannot fit the devices; log the per-device figure."""
    limit = device_memory_bytes() or host_memory_bytes()
    need, weights = memory_per_device(cfg, token_stats, dtype, num_groups, mesh.size, mesh.shape["model"],
                                      sample_size)
    step = step_bytes(cfg, dtype, tokens_per_device, mesh.shape["model"])
    if verbose:
        log(f"accumulators need {need / 1e9:.2f} GB per device, weights {weights / 1e9:.2f} GB, the step ~"
            f"{step / 1e9:.1f} GB (device memory {limit / 1e9:.1f} GB; mesh data={mesh.shape['data']},"
            f"model={mesh.shape['model']})")
    if need + weights + step > FIT * limit:
        raise UserError(f"accumulators ({need / 1e9:.1f} GB), weights ({weights / 1e9:.1f} GB) and the step (~"
                        f"{step / 1e9:.1f} GB at {tokens_per_device:,} tokens per device) do not fit the device's "
                        f"{limit / 1e9:.1f} GB on {mesh.size} device(s); use more devices, a larger 'model' axis "
                        "(--mesh), fewer --batch-tokens, --no-token-stats (per-token IntraSim needs (L+2) x V x D x 8 "
                        "bytes, split over the devices) or a smaller model")


def choose_mesh(cfg, token_stats: bool, dtype: str, sizes: dict | None = None, batch_tokens: int | None = None):
    """The mesh of `sizes` (both named: the first data x model devices; one named: all devices),
    else all devices on 'data' with the smallest 'model' axis that makes parameters,
    accumulators and the step (batch_tokens, or the default batch) fit."""
    import jax

    from isojax.device import mesh as parallel
    sizes = dict(sizes or {})
    n = jax.device_count()
    on_accel = defaults_platform() != "cpu"
    per_device = lambda k: -(-batch_tokens // k) if batch_tokens else device_batch_tokens(cfg, on_accel)
    if cfg is not None and not sizes:
        sizes["model"] = smallest_model_axis(cfg, token_stats, dtype, n, per_device(n),
                                             device_memory_bytes() or host_memory_bytes()) or 1
    mesh = parallel.make_mesh(sizes)
    if cfg is not None:
        check_fits(cfg, token_stats, dtype, 1, mesh, per_device(mesh.size))
    return mesh


def smallest_model_axis(cfg, token_stats: bool, dtype: str, n: int, tokens_per_device: int, limit: int,
                        num_groups: int = 1, sample_size: int = 0) -> int | None:
    """The smallest 'model' axis (dividing n) that makes parameters, accumulators and the step fit n
    devices of `limit` bytes each; None where none does."""
    fits = lambda m: sum(memory_per_device(cfg, token_stats, dtype, num_groups, n, m, sample_size)) + step_bytes(
        cfg, dtype, tokens_per_device, m) <= FIT * limit
    return next((m for m in range(1, n + 1) if n % m == 0 and fits(m)), None)


def device_memory_bytes() -> int | None:
    """Memory of one local device (None where the backend does not say, e.g. CPU)."""
    import jax
    try:
        stats_ = jax.local_devices()[0].memory_stats()
        return int(stats_["bytes_limit"]) if stats_ and "bytes_limit" in stats_ else None
    except Exception:
        return None


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
