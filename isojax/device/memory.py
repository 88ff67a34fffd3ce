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


def step_bytes(cfg, dtype: str, tokens_per_device: int, model_axis: int, step_measures=()) -> int:
    """The step's temporaries per device, estimated: activations (STEP_BYTES_PER_TOKEN_WIDTH per
    token and width; peaks of 410m, 1.4b and 20b on H100s, bench/RESULTS.md 7c), with split
    parameters three gathered layers, and what each step measure on adds (step_measures:
    StatsOptions.step_measures; its base.Step.step_bytes: the logit lens's buffer, logits and sums)."""
    from isojax.stats.measures import steps
    width = 2 if dtype == "bfloat16" else 4
    layer = layer_params(cfg) * width
    added = sum(steps()[name].step_bytes(cfg, dtype, tokens_per_device, setting, model_axis)
                for name, setting in step_measures)
    return STEP_BYTES_PER_TOKEN_WIDTH * tokens_per_device * cfg.hidden_size + (3 * layer if model_axis > 1 else 0) + added


def memory_per_device(cfg, token_stats: bool, dtype: str, num_groups: int, n: int, model_axis: int,
                      sample_size: int = 0):
    """(accumulator bytes, the sample's of sample_size tokens among them, weight bytes) on each of n devices
    with parameters (and Grams) split model_axis ways."""
    from isojax.device.runner import MAX_GROUP_SPECTRA, per_device_accumulator_bytes
    from isojax.stats.measures.sample_states import sample_bytes
    need = per_device_accumulator_bytes(cfg, n, num_groups=num_groups, token_stats=token_stats, model_axis=model_axis,
                                        group_spectra=num_groups <= MAX_GROUP_SPECTRA)
    need += sample_bytes(cfg.num_states, cfg.hidden_size, sample_size, dtype)
    return need, weight_bytes(cfg, dtype, model_axis)


def weight_bytes(cfg, dtype: str, model_axis: int = 1) -> int:
    """The parameters' bytes on each device, split model_axis ways."""
    return (2 if dtype == "bfloat16" else 4) * cfg.param_count() // model_axis


def check_fits(cfg, token_stats: bool, dtype: str, num_groups: int, mesh, tokens_per_device: int,
               verbose: bool = False, sample_size: int = 0, step_measures=()) -> None:
    """Refuse (a short message) what cannot fit the devices; log the per-device figure."""
    limit = device_memory_bytes() or host_memory_bytes()
    need, weights = memory_per_device(cfg, token_stats, dtype, num_groups, mesh.size, mesh.shape["model"],
                                      sample_size)
    step = step_bytes(cfg, dtype, tokens_per_device, mesh.shape["model"], step_measures)
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


def room_beside(cfg, token_stats: bool, dtype: str, num_groups: int, mesh, tokens_per_device: int,
                sample_size: int = 0, step_measures=()) -> int:
    """Bytes of one device that a run's plan leaves free from its start to its read-out's end (what
    a sweep's next checkpoint may take, loaded ahead: run/load_ahead.py): FIT of the device's memory
    less the accumulators, the weights twice (the sentence probe's random initialization draws a
    second copy) and the larger of the step's temporaries and a read-out's float64 matrices."""
    from isojax.stats.finalize import READOUT_BYTES
    limit = device_memory_bytes() or host_memory_bytes()
    need, weights = memory_per_device(cfg, token_stats, dtype, num_groups, mesh.size, mesh.shape["model"],
                                      sample_size)
    step = step_bytes(cfg, dtype, tokens_per_device, mesh.shape["model"], step_measures)
    return int(FIT * limit - need - 2 * weights - max(step, READOUT_BYTES))


def choose_mesh(cfg, config, dtype: str, corpus, row_len: int):
    """The mesh of config's sizes (both named: the first data x model devices; one named: all
    devices), else all devices on 'data' with the smallest 'model' axis that makes parameters,
    accumulators, the sample and the step fit (run_batch: the default batch shrinks to fit); refuses
    (check_fits) what cannot fit."""
    import jax

    from isojax.device import mesh as parallel
    sizes = dict(config.devices.mesh or {})
    if cfg is not None and not sizes:
        sizes["model"] = run_batch(cfg, config, dtype, corpus, jax.device_count(), row_len)[0] or 1
    mesh = parallel.make_mesh(sizes)
    if cfg is not None:
        rows = run_batch(cfg, config, dtype, corpus, mesh.size, row_len, mesh.shape["model"])[1]
        check_fits(cfg, config.stats.token_stats, dtype, groups(corpus, config.data.sources), mesh,
                   rows * row_len // mesh.size,
                   sample_size=sample_size(cfg, dtype, config.stats.sample_states, defaults_platform() != "cpu"),
                   step_measures=config.stats.step_settings())
    return mesh


def run_batch(cfg, config, dtype: str, corpus, n: int, row_len: int, model_axis: int | None = None,
              say: bool = False) -> tuple[int | None, int]:
    """(model axis, rows per batch) of config's run (a MeasureConfig) on n of this machine's devices:
    fit_batch with the sources and sample counted as the dry run counts them (run/dry_run.py) and the
    default batch shrunk to fit; say: log the shrink (make_plan, where the rows are chosen)."""
    on_accel = defaults_platform() != "cpu"
    limit = device_memory_bytes() or host_memory_bytes()
    m, rows = fit_batch(cfg, config.stats.token_stats, dtype, n, limit, row_len, batch_tokens=config.data.batch_tokens,
                        model_axis=model_axis, on_accel=on_accel, num_groups=groups(corpus, config.data.sources),
                        sample_size=sample_size(cfg, dtype, config.stats.sample_states, on_accel),
                        step_measures=config.stats.step_settings())
    if say and m is not None and not config.data.batch_tokens:
        log_shrink(cfg, batch_rows(n * device_batch_tokens(cfg, on_accel), n, row_len) // n * row_len,
                   rows // n * row_len, limit)
    return m, rows


def known_labels(corpus, sources) -> list[str] | None:
    """The sources a memory plan counts before any record is read: text files' (from their paths),
    else those --source names; None: not known (one counted)."""
    if all(inp.kind in ("txt", "default") for inp in corpus.inputs):
        return corpus.labels()
    return sorted(sources) if sources else None


def groups(corpus, sources) -> int:
    return len(known_labels(corpus, sources) or [None])


def sample_size(cfg, dtype: str, sample_states: int | None, on_accel: bool) -> int:
    """The sample a memory plan counts: sample_states (0: none), else the default sample on accelerators
    (a corpus shorter than it gets fewer: run/plan.py)."""
    return default_sample_size(cfg, dtype) if sample_states is None and on_accel else sample_states or 0


SAMPLE_BYTES = 2e9  # the default sample (batch anisotropy) takes at most this much per device


def default_sample_size(cfg, dtype: str) -> int:
    """16,384 tokens (4 batches of 4096), fewer for models whose states would take more than
    SAMPLE_BYTES per device; a multiple of 4096, at least 4096."""
    from isojax.stats.sample_readout import BATCH
    per_token = cfg.num_states * cfg.hidden_size * (2 if dtype == "bfloat16" else 4)
    return max(BATCH, min(4 * BATCH, int(SAMPLE_BYTES / per_token) // BATCH * BATCH))


def batch_rows(batch_tokens: int, n: int, row_len: int) -> int:
    """Rows per batch of about batch_tokens token slots: whole rows, the same number on each of n devices,
    at least one."""
    return -(-max(1, batch_tokens // row_len) // n) * n


def fit_batch(cfg, token_stats: bool, dtype: str, n: int, limit: int, row_len: int, *, batch_tokens: int | None = None,
              model_axis: int | None = None, on_accel: bool = True, num_groups: int = 1,
              sample_size: int = 0, step_measures=()) -> tuple[int | None, int]:
    """(model axis, rows per batch) that make parameters, accumulators (num_groups, sample_size) and the
    step fit n devices of `limit` bytes: model_axis (--mesh), else the smallest that fits. batch_tokens
    is kept as given; without it, the default tokens per device (device_batch_tokens) are halved, down to
    one row each, until a model axis fits. The model axis is None where nothing fits (rows: the fewest tried)."""
    axes = [model_axis] if model_axis else [m for m in range(1, n + 1) if n % m == 0]
    fits = lambda m, rows: sum(memory_per_device(cfg, token_stats, dtype, num_groups, n, m, sample_size)) + step_bytes(
        cfg, dtype, rows // n * row_len, m, step_measures) <= FIT * limit
    if batch_tokens:
        tried = [batch_rows(batch_tokens, n, row_len)]
    else:
        per_device = device_batch_tokens(cfg, on_accel)
        tried = list(dict.fromkeys(batch_rows(n * (per_device >> k), n, row_len)
                                   for k in range(max(1, per_device.bit_length()))))
    return next(((m, rows) for rows in tried for m in axes if fits(m, rows)), (None, tried[-1]))


def log_shrink(cfg, default: int, tokens_per_device: int, limit: int) -> None:
    """The one line a run (or dry run) logs where the default batch (`default` tokens per device, in
    whole rows) was shrunk to fit."""
    if tokens_per_device < default:
        log(f"the default batch ({default:,} tokens per device) does not fit {cfg.name or 'the model'} on devices of "
            f"{limit / 2**30:.1f} GiB: {tokens_per_device:,} tokens per device (--batch-tokens sets the batch)")


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


def host_available_bytes() -> int:
    """Host memory available to new allocations now (MemAvailable), else a quarter of the host's."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return host_memory_bytes() // 4
