"""The step's plan, made while the weights load: kernels, batch rows, sources, sample size, and the
step compiled from their shapes (device/ahead.py). Everything it needs is known before the
weights arrive (the model's config, mesh, dtype, corpus and token stream), so measure() starts it
on a thread first; its errors (a UserError included) are raised where measure() takes the plan."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from isojax.errors import UserError
from isojax.log import log

CPU_DEFAULT_MAX_TOKENS = 16_384  # the offline demo on 2 CPU cores: well under 30 s end to end


@dataclasses.dataclass
class StepPlan:
    cfg: object  # the ModelConfig it was made for
    kernels: object  # the KernelChoice (model/options.py) the step runs and the model is built with
    rows: int  # rows per batch, a multiple of the device count
    labels: list[str]  # the corpus's sources
    max_tokens: int | None
    sample_states: int
    executable: object  # the compiled step (jax.stages.Compiled)
    signature: tuple  # its arguments' shapes (device/runner.py signature)
    seconds: dict  # kernels (until the checks end), tokens (waiting for the sample's), compile, total; measure() adds waited


def run_max_tokens(config, on_accel: bool) -> int | None:
    """config's max_tokens; with none given, CPU_DEFAULT_MAX_TOKENS for the embedded default corpus on CPU."""
    if config.data.max_tokens is None and config.data.data is None and not on_accel:
        return CPU_DEFAULT_MAX_TOKENS
    return config.data.max_tokens


def run_dtype(config, on_accel: bool) -> str:
    """config's dtype, else bfloat16 on accelerators and float32 on CPU."""
    return config.model.dtype or ("bfloat16" if on_accel else "float32")


def run_sample(cfg, config, on_accel: bool, seen=None) -> int:
    """The sample config's run of a model of cfg's shapes keeps: sample_states, else on accelerators
    the default sample (device/memory.py sample_size); at most the tokens the run sees: max_tokens
    (run_max_tokens) and seen(wanted), the corpus's tokens, at least the `wanted` sample's where it
    has them (make_plan; a first run waits for them). seen None: the corpus is not read yet (the
    CLI's free-space check). Refuses sample_states above those tokens or too small for intrinsic_k."""
    from isojax.device.memory import sample_size
    sample_states, intrinsic_k = config.stats.sample_states, config.stats.intrinsic_k
    wanted = sample_size(cfg, run_dtype(config, on_accel), sample_states, on_accel)
    max_tokens = run_max_tokens(config, on_accel)
    available = min(n for n in (max_tokens, seen(wanted) if seen else None, float("inf")) if n is not None)
    if sample_states is None:  # on accelerators: the batch anisotropy costs ~0.1 s; on 2 CPU cores, seconds
        return min(wanted, available)
    if sample_states > available:
        raise UserError(f"sample_states {sample_states:,} is more than the {available:,} tokens this run sees")
    if sample_states and sample_states <= intrinsic_k + 1:
        raise UserError(f"sample_states {sample_states:,} is too small for {intrinsic_k} neighbours per point")
    return sample_states


def step_module(module, mesh):
    """The module as the step runs it: activations split by rows over every device."""
    from isojax.device import mesh as parallel
    if mesh.size == 1:
        return module
    return module.clone(options=dataclasses.replace(module.options, activation_sharding=parallel.rows(mesh)))


def make_plan(cfg, config, *, dtype: str, attention: str, auto_attention: bool, mesh, row_len: int, corpus,
              tokens) -> StepPlan:
    """The plan of config's run of a model of cfg's shapes (measure() for what the arguments are);
    tokens: the token cache or stream, or a Future of it (taken once the kernels' checks have begun)."""
    from isojax.data import TokenStream
    from isojax.device import ahead
    from isojax.device.memory import defaults_platform, run_batch
    from isojax.device.runner import Layout
    from isojax.hf.loading import abstract_params, build_module, cache_root
    from isojax.device.kernel_choice import (RECHECK, CheckRecord, choose_attention, choose_mlp_kernel,
                                             choose_norm_kernel, kernel_choice)
    from isojax.stats.options import StatsOptions

    start, seconds = time.time(), {}
    on_accel = defaults_platform() != "cpu"
    n_dev = mesh.size
    rows = run_batch(cfg, config, dtype, corpus, n_dev, row_len, mesh.shape["model"], say=True)[1]  # choose_mesh's
    device_rows = rows // n_dev * row_len
    record = CheckRecord(cache_root() / "kernel_checks")
    choose = lambda check: (lambda: choose_attention(attention, auto_attention, cfg, dtype, row_len, check, record),
                            lambda: choose_mlp_kernel(config.kernels.mlp, cfg, dtype, device_rows, check, record),
                            lambda: choose_norm_kernel(config.kernels.norm, cfg, dtype, device_rows, check, record))
    # Each kernel's check compiles and runs it (seconds), unless this machine's record holds its
    # outcome: the three at once, beside the step's compile for the kernels they are expected to
    # choose (as recorded, else passing; compiled again where a check chooses otherwise).
    pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="isojax-check")
    checks = [pool.submit(f) for f in choose(True)]
    pool.shutdown(wait=False)
    try:
        expected = kernel_choice(*(f() for f in choose(False)))
    except UserError:  # an explicit kernel that cannot run: its check says so
        expected = None
    t = time.time()
    if isinstance(tokens, concurrent.futures.Future):  # the token cache opening beside: the checks run meanwhile
        tokens = tokens.result()
    streamed = isinstance(tokens, TokenStream)
    labels = corpus.labels() if streamed else tokens.source_names
    labels = labels or (tokens.result() if streamed else tokens).source_names  # none: the build ends with its error
    max_tokens = run_max_tokens(config, on_accel)
    if max_tokens is not None and config.data.max_tokens is None:
        log(f"embedded default corpus on CPU: the first {max_tokens:,} tokens (--max-tokens to change)")
    sample_states = run_sample(cfg, config, on_accel,
                               lambda wanted: tokens.tokens_at_least(wanted) if streamed else tokens.n_tokens)
    seconds["tokens"] = time.time() - t

    def compiled(kernels):
        module = step_module(build_module(cfg, dtype, kernels), mesh)
        layout = Layout(module, mesh, token_stats=config.stats.token_stats, num_groups=len(labels),
                        sample_size=sample_states, options=StatsOptions(skip_positions=config.stats.skip_positions,
                                                                    step_measures=config.stats.step_settings()))
        return ahead.compile_step(layout, abstract_params(cfg, dtype, mesh), rows, row_len)

    t = time.time()
    try:
        step = compiled(expected) if expected is not None else None
    except Exception:  # noqa: BLE001 -- e.g. a kernel that does not run here: its check says so below
        step = None
    chosen = kernel_choice(*(check.result() for check in checks))
    seconds["kernels"] = time.time() - start
    if record.used:
        log(f"kernel checks: recorded outcomes used for {', '.join(sorted(record.used))} ({RECHECK}=1 runs them again)")
    if chosen != expected or step is None:
        log(f"kernel checks chose {chosen.attention}/{chosen.mlp}/{chosen.norm}: compiling the step for them")
        step = compiled(chosen)
    executable, signature = step
    seconds["compile"] = time.time() - t
    seconds["total"] = time.time() - start
    return StepPlan(cfg, chosen, rows, labels, max_tokens, sample_states, executable, signature, seconds)


def plan_in_background(*args, timings=None, **kwargs) -> concurrent.futures.Future:
    """make_plan on a daemon thread (one blocked on the token stream or in a compile never holds
    the process at exit); its result, or its error, comes from the Future. timings (run/timings.py):
    gets the plan's span in its timeline ("plan (beside)")."""
    from isojax.run.timings import in_background

    def plan():
        if timings is None:
            return make_plan(*args, **kwargs)
        with timings.beside("plan"):
            return make_plan(*args, **kwargs)

    return in_background(plan, daemon=True, name="isojax-plan")
