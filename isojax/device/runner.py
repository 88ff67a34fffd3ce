"""The device side of a run: one jitted step = GPT-NeoX forward + statistics of every state,
consumed inside the layer scan, on every device of every process.
Length: the step, the accumulators' global layout and their on-device merge and read-out change together.

The forward is plain jit code that XLA partitions from the shardings of its inputs (rows over
all devices, parameters replicated or over "model": device/mesh.py). The observer the layer scan
calls with each state runs the statistics per device under shard_map: each device adds its rows
to its own partial of the layer part and sends its per-token sums to the tokens' owners
(stats/token_sums.py).

Global layout of the accumulators (a stats.Accumulators of global arrays):
  layer part  counts, sums, Grams: [n, ...], one partial per device (axis 0 split).
              With a "model" axis of m > 1 (and m dividing D), the devices of one model group
              pool their rows for the Grams: each keeps D/m rows [H, S, D/m, D] of the group's
              Grams (stats.update_state's reduce-scatter), so they cost 1/m per device.
  step        the step measures' sums (StatsOptions.step_measures; stats/measures base.Step), each
              [n, ...] per device, added on the host at the end (`step_sums`); () when none is on; those
              of Step.layer_part in the layer part (Accumulators.layer_steps), merged with it. The sample
              (stats/measures/sample_states.py) is one: keys [n, K, 2], states [n, S, K, D], each device's
              bottom-K sample, merged on the host at the end (`sample`). Those of placement "vocab" (the
              per-token sums, stats/measures/intra_sim.py: count [S, V'], sums [S, V', D]) are split over
              V' = V rounded up to a multiple of n instead; global row k * V'/n + j holds token id j * n + k
              (device/mesh.py).
`merged_layers` merges the partials on the devices (a butterfly of ppermutes over "model", then
over "data", one state at a time); `token_readout` turns the per-token sums into IntraSim on the
devices, in float64.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from isojax.device import mesh as parallel
from isojax.stats import accumulators as stats
from isojax.stats import sample as sample_lib
from isojax.stats import token_sums
from isojax.stats.measures import batch_planner, init_sums, observer, split, steps
from isojax.model.decoder import Decoder
from isojax.stats.options import StatsOptions
from isojax.device.mesh import ALL

MAX_GROUP_SPECTRA = 8
LAYER_FIELDS = ("count_lo_GxS", "count_hi_GxS", "sum_GxSxD", "unit_sum_GxSxD", "norm_sum_GxS",
                "m2_HxSxDxD", "unit_m2_HxSxDxD", "layer_steps")  # S is axis 1 of each leaf
SAMPLE, CENTERED = "sample_states", "centered_inter_sim"  # the sample's and the centered pass's step measures
INTRA = "intra_sim"  # IntraSim's per-token sums (stats/measures/intra_sim.py)


def _map_fields(acc: stats.Accumulators, fields, fn) -> stats.Accumulators:
    return acc.replace(**{f: jax.tree.map(fn, getattr(acc, f)) for f in fields})


def split_over_vocab(options: StatsOptions) -> tuple[bool, ...]:
    """Per entry of Accumulators.step: split over the vocabulary (Step.placement "vocab"), else per device."""
    return tuple(steps()[name].placement == "vocab" for name, _ in split(options.step_measures)[1])


def _map_per_device(acc: stats.Accumulators, vocab: tuple[bool, ...], fn) -> stats.Accumulators:
    """fn on every leaf with a device axis: the layer part's and those of the step measures placed per device."""
    acc = _map_fields(acc, LAYER_FIELDS, fn)
    return acc.replace(step=tuple(x if v else jax.tree.map(fn, x)
                                  for x, v in zip(acc.step, vocab or (False,) * len(acc.step), strict=True)))


def accumulator_specs(acc: stats.Accumulators, vocab: tuple[bool, ...]) -> stats.Accumulators:
    """PartitionSpecs of the global layout (module docstring); vocab: split_over_vocab's."""
    specs = jax.tree.map(lambda _: P(ALL), acc)
    return specs.replace(step=tuple(jax.tree.map(lambda x: P(None, ALL, *[None] * (x.ndim - 2)), x) if v else spec
                                    for x, spec, v in zip(acc.step, specs.step, vocab, strict=True)))


def vocab_rows(vocab_size: int, n: int) -> int:
    return -(-vocab_size // n) * n


class Layout:
    """What the step's program depends on besides the values: the module, the mesh, the statistics'
    options and the accumulators' shapes and placement (module docstring). Known before any
    weights load, so the step can compile from it (device/ahead.py)."""

    def __init__(self, module: Decoder, mesh, *, token_stats: bool, num_groups: int, centered: bool = False,
                 options: StatsOptions | None = None, sample_size: int = 0):
        cfg, n = module.cfg, mesh.size
        self.module, self.mesh = module, mesh
        options = options or StatsOptions()
        # the sample (K chosen by the planner, run/plan.py), the centered pass's, those on with token stats
        # (Step.with_token_stats: IntraSim's per-token sums)
        added = {SAMPLE: sample_size, CENTERED: int(centered),
                 **({name: 1 for name, step in steps().items() if step.with_token_stats} if token_stats else {})}
        if any(added.values()):
            on = dict(options.step_measures, **added)
            options = dataclasses.replace(options, step_measures=tuple((name, on[name]) for name in steps()
                                                                       if on.get(name)))
        self.options = dataclasses.replace(options, token_shards=n, token_axes=ALL) if n > 1 else options
        if not token_stats:  # a step measure that reads the token index is off without token stats
            self.options = dataclasses.replace(self.options, step_measures=tuple(
                (name, setting) for name, setting in options.step_measures if not steps()[name].needs_token_stats))
        rows = gram_rows(cfg.hidden_size, mesh.shape["model"])
        if rows:
            self.options = dataclasses.replace(self.options, gram_shards=mesh.shape["model"], gram_axis="model")
        # Per-source spectra cost 2 x S x D x D x 8 bytes per source: kept for up to 8 sources.
        self.init_kwargs = dict(num_groups=num_groups,
                                group_spectra=num_groups <= MAX_GROUP_SPECTRA, gram_rows=rows)
        self.token_stats, self.sample_size = token_stats, sample_size
        self.vocab_rows = vocab_rows(cfg.vocab_size, n) if token_stats else 0
        self.vocab = split_over_vocab(self.options)
        shapes = jax.eval_shape(self.init_global)
        self.specs = accumulator_specs(shapes, self.vocab)
        self.shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs)
        self.abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                     shapes, self.shardings)

    def init_global(self) -> stats.Accumulators:
        cfg, n = self.module.cfg, self.mesh.size
        acc = stats.init_accumulators(cfg.num_states, cfg.hidden_size, **self.init_kwargs)
        layer_steps, step = init_sums(self.options.step_measures, self.init_kwargs["num_groups"], cfg.num_states,
                                      self.vocab_rows, cfg.hidden_size, self.module.dtype)
        acc = acc.replace(layer_steps=layer_steps, step=step)
        return _map_per_device(acc, self.vocab, lambda x: jnp.broadcast_to(x[None], (n, *x.shape)))

    def step(self):
        """The jitted step: one per module, mesh, options and layout in a process (a sweep's
        checkpoints share it, and its compiles)."""
        return _compiled_step(self.module, self.mesh, self.options, self.specs, self.vocab_rows)


def signature(params, acc, mesh, rows: int, row_len: int, centers_SxD) -> tuple:
    """The step's arguments as ShapeDtypeStructs: params and acc (abstract trees), a batch of
    rows x row_len split by rows (device/mesh.py global_rows), the group, the centers."""
    batch = jax.ShapeDtypeStruct((rows, row_len), np.int32, sharding=parallel.rows(mesh))
    return params, acc, batch, batch, batch, batch, jax.ShapeDtypeStruct((), np.int32), centers_SxD


class Runner:
    """Params, accumulators and the compiled step of one model on one mesh."""

    def __init__(self, module: Decoder, params, mesh=None, *, token_stats: bool = True, num_groups: int = 1,
                 centers_SxD=None, options: StatsOptions | None = None, sample_size: int = 0):
        cfg = module.cfg
        self.module, self.cfg = module, cfg
        self.mesh = mesh if mesh is not None else parallel.make_mesh()
        self.num_devices = self.mesh.size
        layout = Layout(module, self.mesh, token_stats=token_stats, num_groups=num_groups,
                        centered=centers_SxD is not None, options=options, sample_size=sample_size)
        self.options, self.init_kwargs, self.vocab_rows = layout.options, layout.init_kwargs, layout.vocab_rows
        self.sample_size, self.token_stats = layout.sample_size, layout.token_stats
        self.specs, self.shardings, self.abstract = layout.specs, layout.shardings, layout.abstract
        self._init_global = layout.init_global
        self.params = jax.device_put(params, parallel.param_shardings(params, self.mesh))
        self.centers_SxD = jax.device_put(np.asarray(  # the centered pass's centers; [S, 0] outside it
            np.zeros((cfg.num_states, 0)) if centers_SxD is None else centers_SxD, np.float32),
            parallel.replicated(self.mesh))
        self.acc = self.fresh_accumulators()
        self._step = layout.step()
        self._executable = None  # use_compiled

    def use_compiled(self, executable) -> None:
        """Run the step with `executable`, compiled ahead for its arguments at the batches' shape (device/ahead.py runner_signature)
        (device/ahead.py): no compile at the first batch."""
        self._executable = executable

    @property
    def compiled_ahead(self) -> bool:
        """Whether the step runs an executable compiled ahead (use_compiled): its first batch compiles nothing."""
        return self._executable is not None

    def fresh_accumulators(self) -> stats.Accumulators:
        return jax.jit(self._init_global, out_shardings=self.shardings)()

    def accumulator_bytes(self) -> int:
        """Bytes of accumulators on each device."""
        from isojax.stats.measures.sample_states import sample_bytes
        kw = {k: v for k, v in self.init_kwargs.items() if k != "gram_rows"}
        sample = sample_bytes(self.cfg.num_states, self.cfg.hidden_size, self.sample_size,
                              jnp.dtype(self.module.dtype).name)
        return sample + per_device_accumulator_bytes(self.cfg, self.num_devices, model_axis=self.mesh.shape["model"],
                                                     token_stats=self.token_stats, **kw)

    def step(self, tokens_BxT, segment_ids_BxT, positions_BxT, group: int, sequences_BxT=None) -> jax.Array:
        """Consume one batch (asynchronous). Arrays: this process's rows (parallel.local_rows) of
        a batch whose row count is a multiple of the device count; sequences_BxT (the tokens'
        sequence indices, packing.Batch) only when keeping a sample. Returns an array that is
        ready when the devices have finished the step."""
        total = len(tokens_BxT) * self.num_devices // len(self.mesh.local_devices)
        if sequences_BxT is None:
            if any(steps()[name].needs_sequences(setting) for name, setting in self.options.step_measures):
                raise ValueError("a Runner that keeps a sample or --logit-lens-every needs the batch's sequence indices")
            sequences_BxT = np.zeros_like(tokens_BxT)
        rows = [parallel.global_rows(np.asarray(a), self.mesh, total)
                for a in (tokens_BxT, segment_ids_BxT, positions_BxT, sequences_BxT)]
        step = self._executable or self._step
        self.acc, finished = step(self.params, self.acc, *rows, jnp.int32(group), self.centers_SxD)
        return finished

    def merged_layers(self) -> stats.Accumulators:
        """The layer part merged over devices (token fields left empty): numpy, but for the
        second moments, which stay on the devices for finalize to read out there: on a local
        device, or split by rows over "model" (a global [H, S, D, D] array)."""
        merged = _layer_part(self.acc)
        if self.num_devices > 1:
            merged = _compiled_merge(self.mesh, self.specs.replace(step=()), self.cfg.num_states, self.options.gram_shards > 1)(merged)
        m2 = [getattr(merged, f) for f in ("m2_HxSxDxD", "unit_m2_HxSxDxD")]
        merged = _map_fields(merged, LAYER_FIELDS, lambda x: _on_its_device(x.addressable_shards[0].data[0]))
        if self.options.gram_shards > 1:
            merged = merged.replace(**dict(zip(("m2_HxSxDxD", "unit_m2_HxSxDxD"),
                                               [stats.DFPair(model_rows(self.mesh, x.hl)) for x in m2])))
        return _map_fields(merged, [f for f in LAYER_FIELDS if "m2" not in f], np.asarray)

    def step_sums(self, merged: stats.Accumulators | None = None) -> dict:
        """{name: sums} of each step measure on (its Step.merged), in the registry's order: those of the
        layer part from `merged` (merged_layers(), made here if None), the others' per-device sums added
        over every device and process in float64."""
        layer, other = split(self.options.step_measures)
        if layer and merged is None:
            merged = self.merged_layers()
        out = {name: steps()[name].merged(jax.tree.map(lambda x: np.asarray(x)[None], sums), 1, self.cfg.vocab_size)
               for (name, _), sums in zip(layer, merged.layer_steps if layer else (), strict=True)}
        out.update({name: steps()[name].merged(jax.tree.map(_gather, sums), self.num_devices, self.cfg.vocab_size)
                    for (name, _), sums in zip(other, self.acc.step, strict=True)
                    if steps()[name].merged is not None})  # None: read where they lie (the sample: `sample`)
        return {name: out[name] for name, _ in self.options.step_measures if name in out}

    def token_readout(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(count_V int64, intra_sim_SxV float64) from the per-token sums, computed on the devices
        in float64 one state at a time; None without token stats."""
        if not self.vocab_rows:
            return None
        n, v, sums = self.num_devices, self.cfg.vocab_size, self._step_sums(INTRA)
        count = _gather(sums.count_SxV[:1])  # every state counts the same tokens
        # only rows with two or more occurrences have an IntraSim: read out that many per device,
        # rounded up to a power of two (few compiles); a short run sees a small part of V
        most = int((count[0] >= 2).reshape(n, -1).sum(1).max())
        rows = min(1 << max(0, most - 1).bit_length(), self.vocab_rows // n)
        with jax.enable_x64(True):
            intra = _gather(_compiled_readout(self.mesh, rows)(sums.count_SxV, sums.sum_SxVxD))
        return stats.token_order(count, n, v)[0].astype(np.int64), stats.token_order(intra, n, v)

    def token_sums(self, s: int) -> np.ndarray:
        """Per-token unit-vector sums of state s, hi + lo in float64, [V, D] in token order."""
        with jax.enable_x64(True):
            sums = _gather(token_sums.state_sums(self._step_sums(INTRA).sum_SxVxD, jnp.int32(s)))
        n, d = self.num_devices, sums.shape[-1]
        return sums.reshape(n, -1, d).transpose(1, 0, 2).reshape(-1, d)[:self.cfg.vocab_size]

    def load(self, acc) -> None:
        self.acc = acc

    def gram_shape(self) -> tuple[int, int, int, int]:
        """(H, S, D, D): the merged second moments' shape (merged_layers), all D rows."""
        return self.acc.gram_slots(), self.cfg.num_states, self.cfg.hidden_size, self.cfg.hidden_size

    def readout_device(self):
        """The device where merged_layers leaves the second moments of a local read-out."""
        return self.acc.m2_HxSxDxD.hl.addressable_shards[0].device

    def second_pass(self, centers_SxD, num_groups: int) -> "Runner":
        """A Runner of the same module, placed params, mesh and statistics' options for a second
        pass centered on centers_SxD [S, D]: no token stats, no sample."""
        return Runner(self.module, self.params, self.mesh, token_stats=False, num_groups=num_groups,
                      centers_SxD=centers_SxD, options=dataclasses.replace(self.options, step_measures=()))

    def sample(self):
        """(number of sampled tokens K', states(s) -> [K', D] float32 in key order: shuffled)
        of the merged sample over every device and process (a jax array on the devices, or numpy
        where other processes hold part of it); None without a sample."""
        if not self.sample_size:
            return None
        sums = self._step_sums(SAMPLE)
        keys = _gather(sums.keys_Kx2)  # [n, K, 2]
        part, slot = sample_lib.merge_host(keys)

        def states(s: int):
            x = _state_sample(sums.states_SxKxD, jnp.int32(s))  # [n, K, D]
            if x.is_fully_addressable:  # stays on the devices, where the batch anisotropy reads it
                return _on_its_device(_take_sample(x, part, slot))
            return _gather(x)[part, slot].astype(np.float32)

        return len(part), states

    def sample_keys(self) -> np.ndarray | None:
        """[K', 2] uint32: the merged sample's keys (stats/sample.py token_keys: a hash of each token's
        sequence and position, high word first), ascending, in the order of sample()'s states; None
        without a sample. Every process calls it (a gather across processes)."""
        if not self.sample_size:
            return None
        keys = _gather(self._step_sums(SAMPLE).keys_Kx2)  # [n, K, 2]
        part, slot = sample_lib.merge_host(keys)
        return keys[part, slot]

    def older_leaf(self, leaf: str, sample: bool = False, tokens: bool = False) -> str:
        """The name a leaf of these accumulators had in a checkpoint written before the per-token sums (`tokens`;
        fields tok_count_SxV, tok_sum_SxVxD) or the sample (fields sample_keys_Kx2, sample_SxKxD) became step measures
        (issue 46; checkpoints name leaves by their path); the step measures after either sat one place earlier."""
        other = [name for name, _ in split(self.options.step_measures)[1]]
        head, _, rest = leaf.partition("__")
        if head != "step":
            return leaf
        i, _, field = rest.partition("__")
        i = int(i)
        for older, name in ((tokens, INTRA), (sample, SAMPLE)):  # the newer layout's change undone first
            if not older or name not in other:
                continue
            at = other.index(name)
            if i == at:
                return "tok_" + field if name == INTRA else {"keys_Kx2": "sample_keys_Kx2",
                                                              "states_SxKxD": "sample_SxKxD"}[field]
            other, i = other[:at] + other[at + 1:], i - (i > at)
        return f"step__{i}__{field}"

    def _step_sums(self, name: str):
        """The sums of step measure `name` (not of the layer part) in the accumulators, global arrays: the
        sample's (stats/measures/sample_states.py Sums), IntraSim's (intra_sim.py Sums)."""
        other = [x for x, _ in split(self.options.step_measures)[1]]
        return self.acc.step[other.index(name)]


def gram_rows(d: int, model_axis: int) -> int | None:
    """Rows of the Grams each device keeps on a "model" axis of model_axis devices: D / m where
    m > 1 divides D; None (all D rows, not split) otherwise."""
    return d // model_axis if model_axis > 1 and d % model_axis == 0 else None


def per_device_accumulator_bytes(cfg, n: int, *, token_stats=True, model_axis: int = 1, **kw) -> int:
    """Bytes on each of n devices: one layer part (its Grams split over model_axis: gram_rows),
    plus 1/n of the per-token part (rounded up). kw: stats.init_accumulators' num_groups,
    group_spectra. (The step measures' sums are counted with what they add to the step: device/memory.py
    step_bytes; the sample's by memory_per_device.)"""
    from isojax.stats.measures.intra_sim import sums_bytes
    rows = vocab_rows(cfg.vocab_size, n) // n if token_stats else 0
    return sums_bytes(cfg.num_states, cfg.hidden_size, rows) + stats.accumulator_bytes(
        cfg.num_states, cfg.hidden_size, gram_rows=gram_rows(cfg.hidden_size, model_axis), **kw)


def model_rows(mesh, x: jax.Array) -> jax.Array:
    """Merged Grams split by rows, [n, H, S, D/m, D, 2] (device k: the rows of its model index)
    -> one [H, S, D, D, 2] array split by rows over "model" (replicated over "data": merged,
    every data row holds the same)."""
    shape = (*x.shape[1:3], x.shape[3] * mesh.shape["model"], *x.shape[4:])
    sharding = NamedSharding(mesh, P(None, None, "model"))
    return jax.make_array_from_single_device_arrays(shape, sharding, [s.data[0] for s in x.addressable_shards])


def _gather(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@jax.jit
def _state_sample(sample_nxSxKxD, s):
    return lax.dynamic_index_in_dim(sample_nxSxKxD, s, 1, keepdims=False)


@jax.jit
def _take_sample(x_nxKxD, part_K, slot_K):
    return x_nxKxD[part_K, slot_K].astype(jnp.float32)


def _layer_part(acc: stats.Accumulators) -> stats.Accumulators:
    """acc without the step measures' sums (what the merge of the layer part carries)."""
    return acc.replace(step=())


def _on_its_device(x: jax.Array) -> jax.Array:
    """x, held by one device, with that device's SingleDeviceSharding (the same buffer, no copy): the
    sharding finalize.compile_ahead compiles the read-outs for. On a mesh of one device, jit and
    indexing hand back a NamedSharding, for which jit would compile every read-out again."""
    if isinstance(x.sharding, SingleDeviceSharding) or len(x.sharding.device_set) != 1:
        return x
    (device,) = x.sharding.device_set
    return jax.make_array_from_single_device_arrays(x.shape, SingleDeviceSharding(device), [x])


def _device_view(acc, vocab=()):
    return _map_per_device(acc, vocab, lambda x: x[0])


def _stacked(acc, vocab=()):
    return _map_per_device(acc, vocab, lambda x: x[None])


@functools.cache
def _compiled_step(module: Decoder, mesh, options: StatsOptions, specs, vocab_rows: int):
    """vocab_rows: the padded vocabulary V' the token index keys into (0 without token stats)."""
    d = module.cfg.hidden_size
    on = [(i, steps()[name], setting) for i, (name, setting) in enumerate(split(options.step_measures)[1])]
    after = [(i, step, setting) for i, step, setting in on if step.after_forward is not None]
    vocab = split_over_vocab(options)
    observe = observer(options.step_measures, options)  # the step measures' per-state updates (base.Step.observe)
    plan_batch = batch_planner(options.step_measures, options)  # and per-batch plans (base.Step.plan_batch)

    def local_update(acc, s, x_BxTxD, tokens_BxT, seg_BxT, pos_BxT, seq_BxT, index, plans, group, centers):
        center_D = lax.dynamic_index_in_dim(centers, s, 0, keepdims=False) if centers.shape[1] else None
        flat = lambda x_BxT: x_BxT.reshape(-1)
        acc = stats.update_state(_device_view(acc, vocab), s, x_BxTxD.reshape(-1, d), flat(tokens_BxT),
                                 flat(seg_BxT) != 0, group, center_D, index=index, opts=options, plans=plans,
                                 positions_N=flat(pos_BxT), sequences_N=flat(seq_BxT), observe=observe)
        return _stacked(acc, vocab)

    def local_batch(acc, tokens_BxT, seg_BxT, pos_BxT, seq_BxT):
        """Once per batch and device: the sort of the ids (for all states) and the step measures' plans (the
        sample's, the per-token sums' exchange: base.Step.plan_batch)."""
        acc, valid_N = _device_view(acc, vocab), seg_BxT.reshape(-1) != 0
        index = stats.index_tokens(tokens_BxT.reshape(-1), valid_N, vocab_rows, mesh.size) if vocab_rows else None
        plans = None
        if plan_batch is not None:
            acc, plans = plan_batch(acc, stats.Batch(tokens_BxT.reshape(-1), valid_N, pos_BxT.reshape(-1),
                                                     seq_BxT.reshape(-1), index))
        return _stacked(acc, vocab), index, plans

    def step(params, acc, tokens_BxT, seg_BxT, pos_BxT, seq_BxT, group, centers_SxD):
        # the statistics' segments (every sum, the token index, the sample's keys): the first skip_positions
        # positions of each sequence are padding there; the forward sees them all
        kept_BxT = jnp.where(pos_BxT >= options.skip_positions, seg_BxT, 0) if options.skip_positions else seg_BxT
        acc, index, plans = jax.shard_map(
            local_batch, mesh=mesh, in_specs=(specs, P(ALL), P(ALL), P(ALL), P(ALL)),
            out_specs=(specs, P(ALL), P(ALL)), check_vma=False)(acc, tokens_BxT, kept_BxT, pos_BxT, seq_BxT)
        update = jax.shard_map(local_update, mesh=mesh,
                               in_specs=(specs, P(), *[P(ALL)] * 7, P(), P()), out_specs=specs, check_vma=False)
        observe = lambda acc, s, x_BxTxD: update(acc, s, x_BxTxD, tokens_BxT, kept_BxT, pos_BxT, seq_BxT, index,
                                                 plans, group, centers_SxD)
        if after:  # every state kept for the step measures that read them after the forward
            acc = _after_forward_step(module, mesh, specs, after, params, acc, observe, tokens_BxT, seg_BxT, kept_BxT,
                                      pos_BxT, seq_BxT, group)
        else:
            acc = module.apply({"params": params}, tokens_BxT, seg_BxT, pos_BxT, acc, observe)
        return acc, acc.count_lo_GxS[:, 0, 0]  # one number per device, ready when its step is

    # the accumulators come back where they came from: XLA would put the empty ones (no sample,
    # not centered) elsewhere on 2+ devices, and the next call would compile the step again
    out = (jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs), NamedSharding(mesh, P(ALL)))
    return jax.jit(step, donate_argnums=(1,), out_shardings=out)


def _after_forward_step(module: Decoder, mesh, specs, after, params, acc, observe, tokens_BxT, seg_BxT, kept_BxT,
                        pos_BxT, seq_BxT, group):
    """The forward with the step measures `after` ([(index in acc.step, Step, setting)]) that read
    every state after it: the states go into a buffer [S, B, T, D] (split by rows like the batch)
    beside the statistics' observer; then each device's rows through each one's update
    (base.Step.after_forward: the logit lens's, stats/measures/logit_lens.py)."""
    b, t = tokens_BxT.shape
    buf = lax.with_sharding_constraint(jnp.zeros((module.cfg.num_states, b, t, module.cfg.hidden_size), module.dtype),
                                       NamedSharding(mesh, P(None, ALL)))
    keep = lambda obs, s, x_BxTxD: (observe(obs[0], s, x_BxTxD),
                                    lax.dynamic_update_index_in_dim(obs[1], x_BxTxD.astype(obs[1].dtype), s, 0))
    acc, buf = module.apply({"params": params}, tokens_BxT, seg_BxT, pos_BxT, (acc, buf), keep)
    sums = list(acc.step)
    for i, step, setting in after:
        update, weights = step.after_forward(module, params, setting)

        def local(sums, buf, tokens, seg, kept, pos, seq, group, weights, update=update):
            sums = update(jax.tree.map(lambda x: x[0], sums), buf, tokens, seg, kept, pos, seq, group, weights)
            return jax.tree.map(lambda x: x[None], sums)

        sums[i] = jax.shard_map(local, mesh=mesh, in_specs=(specs.step[i], P(None, ALL), *[P(ALL)] * 5, P(), P()),
                                out_specs=specs.step[i], check_vma=False)(acc.step[i], buf, tokens_BxT, seg_BxT,
                                                                          kept_BxT, pos_BxT, seq_BxT, group, weights)
    return acc.replace(step=tuple(sums))


@functools.cache
def _compiled_merge(mesh, specs, num_states: int, split_grams: bool):
    """Merge the per-device layer partials on the devices, one state at a time (memory: one
    state's partial more per device): over "model", then over "data". Along an axis of a power
    of two: a butterfly of ppermutes, after which every device holds the same total
    (stats.merge is symmetric, so partners agree bit for bit); other sizes: all-gather one
    state and fold. split_grams: the devices of a model group hold rows of one pooled Gram,
    which the model merge keeps and the data merge merges row by row."""

    def merge_over(part, axis, **kw):
        size = mesh.shape[axis]
        if size & (size - 1) == 0:
            k = 1
            while k < size:
                other = jax.tree.map(lambda x: lax.ppermute(x, axis, [(i, i ^ k) for i in range(size)]), part)
                part = stats.merge(part, other, **kw)
                k *= 2
            return part
        every = jax.tree.map(lambda x: lax.all_gather(x, axis), part)
        total = jax.tree.map(lambda x: x[0], every)
        for i in range(1, size):
            total = stats.merge(total, jax.tree.map(lambda x, i=i: x[i], every), **kw)
        return total.replace(m2_HxSxDxD=part.m2_HxSxDxD, unit_m2_HxSxDxD=part.unit_m2_HxSxDxD) \
            if kw.get("keep_m2") else total

    def merge_all(part):
        part = merge_over(part, "model", keep_m2=split_grams)
        row0 = lax.axis_index("model") * part.m2_HxSxDxD.hl.shape[2] if split_grams else None
        return merge_over(part, "data", m2_row0=row0)

    def local(acc):
        acc = _device_view(acc)

        def one_state(s, acc):
            take = lambda x: lax.dynamic_slice_in_dim(x, s, 1, axis=1)
            part = merge_all(_map_fields(acc, LAYER_FIELDS, take))
            return acc.replace(**{f: jax.tree.map(lambda x, y: lax.dynamic_update_slice_in_dim(x, y, s, axis=1),
                                                  getattr(acc, f), getattr(part, f)) for f in LAYER_FIELDS})

        return _stacked(lax.fori_loop(0, num_states, one_state, acc))

    layer_specs = specs  # token fields are empty [S, 0(, D)] arrays, split over nothing
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(layer_specs,), out_specs=layer_specs,
                                 check_vma=False))


@functools.cache
def _compiled_readout(mesh, rows: int):
    """IntraSim of every token row, in float64 (call under jax.enable_x64), each device of its own rows
    (stats/token_sums.py intra_sim: its first `rows` rows with two or more occurrences)."""
    local = functools.partial(token_sums.intra_sim, rows=rows)
    tok_spec = stats.DF(P(None, ALL, None), P(None, ALL, None))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, ALL), tok_spec), out_specs=P(None, ALL)))
