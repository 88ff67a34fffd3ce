"""The measures, one file each (README "Geometry measures"): every module of this package that defines MEASURE (a
base.Measure) is one, found here, in the order of the modules' names. Adding one is its file, its test and its row
of the README's measures table (tests/test_measures_registry.py checks the table against MEASURES).

Readers: stats.finalize (the moments and spectral measures of each population: population()), stats.sample_readout.
sample_metrics (sample and pairs), run.results.flat_layer (a run that lacks a measure reads it as null), the report's
figures (report/measures.py: those drawn, Metric.drawn). A "step" measure (its Step: base.py) is accumulated by
the step where its setting turns it on (steps(), step_settings()), counted by the planner and read out by
run.measure (step_readout()); massive_activations.py and position_bands.py, on by default, were the step's own
streamed measures, sample_states.py is the sample (its K chosen by the planner; read out from the devices by
Runner.sample), intra_sim.py the per-token sums (on with token statistics; read out per token by
Runner.token_readout, per layer by stats.finalize) and centered_inter_sim.py is the centered pass's (on in that
pass alone; read out by run/centered.py). The moments and spectral measures read what every step keeps
(stats.accumulators: the count, the sums of x, x/|x| and |x|, and the second moments of x and x/|x|).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Moments, Spectra, Step

__all__ = ["MEASURES", "Measure", "Metric", "Moments", "Spectra", "Step", "population", "drawn", "steps", "per_token", "step_readout",
           "with_steps_by_source", "step_settings", "check_step", "default_step_nulls", "split", "init_sums",
           "batch_planner", "observer",
           "names", "columns", "nulls", "dict_valued", "labels", "optional", "check_optional", "to_final",
           "sample_programs", "sample_readout", "sample_dispatch", "sample_values", "pairs_dispatch"]


def _found() -> dict[str, Measure]:
    out = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "MEASURE", None), Measure):
            out[info.name] = module.MEASURE
    return out


MEASURES: dict[str, Measure] = _found()  # module name -> its Measure


ALL = ("moments", "spectra", "sample", "pairs", "step")  # every kind a measure reads (base.py)


def _on(reads: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[Measure]:
    """The measures reading `reads` that are read out: on by default, or named in `extra` (--measure)."""
    return [m for name, m in MEASURES.items() if m.reads in reads and (m.on_by_default or name in extra)]


def optional() -> list[str]:
    """The read-out measures off by default, which `--measure NAME` turns on (a step measure has a
    flag of its own)."""
    return [name for name, m in MEASURES.items() if not m.on_by_default and m.reads != "step"]


def check_optional(extra) -> tuple[str, ...]:
    """extra (names from --measure, or `measures=` of isojax.measure) as a tuple, each checked to be
    an off-by-default read-out measure; ValueError saying which are not."""
    try:
        extra = tuple(extra)
    except TypeError:
        raise ValueError(f"measures must be a list of measure names, not {extra!r}") from None
    wrong = [name for name in extra if name not in optional()]
    if wrong or not all(isinstance(name, str) for name in extra):
        raise ValueError(f"unknown measure {', '.join(map(str, wrong or extra))}: --measure takes "
                         f"{', '.join(optional()) or 'none'} (the others are on by default)")
    return tuple(dict.fromkeys(extra))


def steps() -> dict[str, Step]:
    """The step measures' hooks (Measure.step), by module name, in the registry's order."""
    return {name: m.step for name, m in MEASURES.items() if m.reads == "step"}


def split(step_measures) -> tuple[list, list]:
    """StatsOptions.step_measures' (name, setting) pairs, in order: (those whose sums sit in the accumulators'
    layer part, Step.layer_part; the others): Accumulators.layer_steps' and .step's."""
    on = [(name, setting) for name, setting in step_measures]
    return [x for x in on if steps()[x[0]].layer_part], [x for x in on if not steps()[x[0]].layer_part]


def init_sums(step_measures, num_groups: int, num_states: int, vocab_rows: int, width: int,
              dtype="float32") -> tuple[tuple, tuple]:
    """(layer_steps, step): one device's zero sums of the step measures on (Step.init); dtype: the forward's."""
    return tuple(tuple(steps()[name].init(setting, num_groups, num_states, vocab_rows, width, dtype)
                       for name, setting in part) for part in split(step_measures))


def _hook(step: Step, name: str, opts):
    """step's hook `name`, given the statistics' options where it takes them (Step.takes_options)."""
    from isojax.stats.options import StatsOptions
    hook = getattr(step, name)
    return hook if hook is None or not step.takes_options else functools.partial(
        hook, opts=StatsOptions() if opts is None else opts)


def batch_planner(step_measures, opts=None):
    """The per-batch hook of the step measures on (Step.plan_batch): plan(acc, batch) -> (acc, plans), once per
    batch and device before the states (batch: a stats.accumulators.Batch); plans: one per step measure on, in
    split()'s order (layer part first), None for those without plan_batch; observer's `observe` takes them.
    None where none plans. opts: the statistics' options (StatsOptions; None: the defaults), for the hooks
    that take them."""
    parts = split(step_measures)
    if not any(steps()[name].plan_batch for part in parts for name, _ in part):
        return None

    def plan(acc, batch):
        plans = []

        def run(sums, part):
            out = []
            for x, (name, setting) in zip(sums, part, strict=True):
                hook = _hook(steps()[name], "plan_batch", opts)
                x, one = (x, None) if hook is None else hook(x, setting, batch)
                out.append(x)
                plans.append(one)
            return tuple(out)

        acc = acc.replace(layer_steps=run(acc.layer_steps, parts[0]), step=run(acc.step, parts[1]))
        return acc, tuple(plans)

    return plan


def observer(step_measures, opts=None):
    """stats.accumulators.update_state's `observe` of the step measures on (StatsOptions.step_measures): each
    one's Step.observe on its sums in the accumulators, with its plan of the batch (batch_planner's plans, or
    None), in split()'s order but those of placement "vocab" last (Step.placement); None where none observes
    the states. opts: as batch_planner's."""
    parts = split(step_measures)
    if not any(steps()[name].observe for part in parts for name, _ in part):
        return None
    # (part, index in it, name, setting, index among the plans)
    on = [(p, i, name, setting) for p, part in enumerate(parts) for i, (name, setting) in enumerate(part)]
    on = [(p, i, name, setting, k) for k, (p, i, name, setting) in enumerate(on)]
    on.sort(key=lambda x: steps()[x[2]].placement == "vocab")  # stable: the others keep their order

    def observe(acc, s, group, rows, index, plans=None):
        plans = list(plans) if plans is not None else [None] * len(on)
        sums = [list(acc.layer_steps), list(acc.step)]
        for p, i, name, setting, k in on:
            hook = _hook(steps()[name], "observe", opts)
            if hook is not None:
                sums[p][i] = hook(sums[p][i], setting, s, group, rows, index, plans[k])
        return acc.replace(layer_steps=tuple(sums[0]), step=tuple(sums[1]))

    return observe


def step_readout(final: dict, step_sums: dict, settings: dict, counted: int) -> None:
    """Each step measure's read-out (base.Step) into run.measure's final: its metrics into the layers,
    its per-token arrays into final["token"] (tokens.zarr), its block of metrics.json into
    final["step_info"]. step_sums: each one's merged sums (Runner.step_sums); settings: their
    settings; counted: the tokens the statistics count."""
    for name, sums in step_sums.items():
        step = steps()[name]
        if step.layers is not None:
            for layer, extra in zip(final["layers"], step.layers(sums, None)):
                layer.update(extra)
        if step.tokens is not None and final.get("token") is not None:
            final["token"].update(step.tokens(sums, final["token"]["count_V"]))
        if step.info is not None:
            final.setdefault("step_info", {})[name] = step.info(sums, settings[name], counted)


def with_steps_by_source(final: dict, finish_groups, step_sums: dict, source_names):
    """finish_groups, then each source's step-measure metrics into its layers (now where the sources
    are read out already: finish_groups None)."""

    def by_source():
        for name, sums in step_sums.items():
            if steps()[name].layers is None:
                continue
            for g, source in enumerate(source_names):
                for layer, extra in zip(final["groups"][source]["layers"], steps()[name].layers(sums, [g])):
                    layer.update(extra)

    if finish_groups is None:
        by_source()
        return None
    return lambda: (finish_groups(), by_source())


def check_step(step: Step, value) -> int:
    """A step measure's setting given as its keyword of isojax.measure: a non-negative integer (0: off;
    a boolean one's True and False too); ValueError naming the keyword otherwise."""
    if step.boolean and isinstance(value, (bool, np.bool_)):
        return int(value)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 0 \
            or step.boolean and value > 1:
        raise ValueError(f"{step.keyword} must be {'True or False' if step.boolean else 'a non-negative integer'} "
                         f"(0: off), not {value!r}")
    return int(value)


def step_settings(given, token_stats: bool) -> tuple[tuple[str, int], ...]:
    """StatsOptions.step_measures: (module name, setting) of each step measure on, in the registry's
    order; given: {keyword: setting} (isojax.measure's keywords, the flags'), else its default; one
    that needs token stats is off without them."""
    given = dict(given)
    out = []
    for name, step in steps().items():
        setting = check_step(step, given.get(step.keyword, step.default))
        if setting and (token_stats or not step.needs_token_stats):
            out.append((name, setting))
    return tuple(out)


def _of_layers(m: Measure) -> list[Metric]:
    """m's metrics of every layer (in metrics.json's layers and layers.csv, null where not measured), not its
    per-token arrays, identifiers, lists nor those only in a run that measures them (Metric.only_where_on)."""
    return [metric for metric in m.metrics
            if not (metric.per_token or metric.identifier or metric.listed or metric.only_where_on)]


def per_token() -> list[Metric]:
    """The registered per-token metrics (arrays [S, V] in tokens.zarr, named as the metric)."""
    return [metric for m in MEASURES.values() for metric in m.metrics if metric.per_token]


def to_final() -> list[str]:
    """The pairs measures also read out across a sweep's checkpoints (Measure.to_final), by name: the
    module's, which is its one metric's."""
    out = [name for name, m in MEASURES.items() if m.to_final]
    assert all(MEASURES[name].metrics[0].name == name for name in out), out
    return out


def names(reads: tuple[str, ...] = ALL) -> list[str]:
    """Every registered metric name of a layer (of the measures reading `reads`; not the per-token ones)."""
    return [metric.name for m in MEASURES.values() if m.reads in reads for metric in _of_layers(m)]


def columns(reads: tuple[str, ...] = ALL) -> list[str]:
    """Every registered metric's columns in layers.csv / sweep.csv (a dict-valued one's: name_key)."""
    return [c for m in MEASURES.values() if m.reads in reads for metric in _of_layers(m) for c in metric.columns()]


def nulls(reads: tuple[str, ...] = ALL) -> dict:
    """Every registered metric's value where it is not measured: null ({key: null} for a dict-valued one)."""
    return {metric.name: metric.null() for m in MEASURES.values() if m.reads in reads for metric in _of_layers(m)}


def default_step_nulls() -> dict:
    """The metrics of the step measures on by default, null: their place in a layer (stats.finalize,
    where they were read out before they were step measures), filled by run.measure's read-out."""
    return {metric.name: metric.null() for m in MEASURES.values() if m.reads == "step" and m.step.default
            for metric in m.metrics if not metric.per_token}


def dict_valued() -> dict[str, Metric]:
    """The registered metrics whose value is a dict (Metric.keys), by name."""
    return {metric.name: metric for m in MEASURES.values() for metric in _of_layers(m) if metric.keys}


def labels() -> dict[str, str]:
    """Each registered column's axis label (a dict-valued metric's: its label at key)."""
    return {c: metric.label + (f" ({c[len(metric.name) + 1:]})" if metric.keys else "")
            for m in MEASURES.values() for metric in _of_layers(m) for c in metric.columns()}


def population(moments: Moments, spectra: Spectra | None) -> dict:
    """Every moments and spectral measure's metrics of one population (stats.finalize), in the registry's
    order: the moments measures', then, where its spectra are read out (not None), the spectral ones'."""
    out = {k: v for m in _on(("moments",)) for k, v in m.readout(moments).items()}
    if spectra is not None:
        out.update({k: v for m in _on(("spectra",)) for k, v in m.readout(spectra).items()})
    return out


def drawn() -> list[str]:
    """The registered metrics of a layer that the report's figures of the measures draw (Metric.drawn), one
    number each (a dict-valued one's are drawn by keys: report/measures.py)."""
    return [metric.name for m in MEASURES.values() for metric in _of_layers(m) if metric.drawn and not metric.keys]


@functools.cache
def _jitted(readout):
    import jax
    return jax.jit(readout)


def sample_programs(x, extra: tuple[str, ...] = ()) -> list:
    """Lowerings (thunks: call, then .compile()) of sample_readout's read-outs for sampled points
    of x's shape and sharding (a jax.ShapeDtypeStruct), for stats.finalize.compile_ahead (x64 on)."""
    return [lambda m=m: _jitted(m.readout).lower(*([x] if m.reads == "sample" else [x, x]))
            for m in _on(("sample", "pairs"), extra)]


def on_host() -> bool:
    """Whether sample_readout reads out in numpy on the host (the CPU backend: numpy's selections and
    LAPACK beat XLA's on the CPU) rather than jitted where the sample lies (accelerators)."""
    import jax
    return jax.default_backend() == "cpu"


def sample_readout(previous, x, what: str = "", extra: tuple[str, ...] = ()) -> dict:
    """Every sample and pairs measure's metrics of one state, from its sampled points x [K, D] and
    the previous state's (None for the first state: its pairs measures are null), in float64: numpy
    on the CPU, jitted where the points lie on accelerators (on_host); NaN written as null, with a
    log line naming the state `what` (not for the first state's pairs measures).
    sample_dispatch then sample_values: the same, split so that every state's read-outs are
    dispatched to the devices before any is read (stats.sample_readout.sample_metrics)."""
    return sample_values(sample_dispatch(previous, x, extra), what)


def sample_dispatch(previous, x, extra: tuple[str, ...] = ()) -> dict:
    """sample_readout's values of one state, not yet read: {name: 0-d array} (device arrays on
    accelerators, computed in numpy on the host); extra: the off-by-default measures turned on."""
    import jax
    run, pending = _runner(), {}
    with jax.enable_x64(True):
        for m in _on(("sample", "pairs"), extra):
            if m.reads == "sample":
                pending.update(run(m, x))
            elif previous is not None:
                pending.update(run(m, previous, x))
    return pending


def pairs_dispatch(x, y, names) -> dict:
    """The pairs measures `names` (MEASURES' keys) of the points x and y [K, D], not yet read, as
    sample_dispatch runs them: {metric: 0-d array}, NaN where undefined (a sweep's NAME_to_final)."""
    import jax
    run, pending = _runner(), {}
    with jax.enable_x64(True):
        for name in names:
            pending.update(run(MEASURES[name], x, y))
    return pending


def _runner():
    """How a read-out runs: numpy on the host (on_host), else jitted where its points lie (x64 on)."""
    import numpy as np
    return (lambda m, *a: m.readout(*map(np.asarray, a))) if on_host() else (lambda m, *a: _jitted(m.readout)(*a))


def sample_values(pending: dict, what: str = "") -> dict:
    """sample_readout's result from sample_dispatch's values (read from the devices if not yet)."""
    import numpy as np
    out = nulls(("sample", "pairs"))
    keyed = dict_valued()
    for name, value in pending.items():
        values = [float(v) for v in np.ravel(np.asarray(value))]
        values = [v if np.isfinite(v) else None for v in values]
        out[name] = dict(zip(keyed[name].keys, values)) if name in keyed else values[0]
    undefined = [name for name in pending if out[name] is None  # a dict-valued one: at any key
                 or isinstance(out[name], dict) and None in out[name].values()]
    if undefined and what:
        from isojax.log import log
        log(f"{', '.join(undefined)} of {what}: null (undefined on these sampled points: README \"Geometry measures\")")
    return out
