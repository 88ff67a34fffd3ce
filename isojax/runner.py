"""The device side of a run: one jitted step = GPT-NeoX forward + statistics of every state,
consumed inside the layer scan, data-parallel over all local devices.

Each device keeps its own accumulators (a leading device axis, sharded over the mesh axis
"data"); batch rows are split across devices; `merged_accumulators` merges the per-device
slices (stats.merge is associative) only when results are read. One device is the same code
with a mesh of one.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from isojax import stats
from isojax.model import GPTNeoX


MAX_GROUP_SPECTRA = 8


class Runner:
    """Holds params, per-device accumulators and the compiled step for one model shape."""

    def __init__(self, module: GPTNeoX, params, *, token_stats: bool = True, num_groups: int = 1,
                 centers_SxD=None, devices=None):
        cfg = module.cfg
        self.module, self.cfg = module, cfg
        devices = devices or jax.local_devices()
        self.mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
        self.num_devices = len(devices)
        self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
        self.row_sharding = NamedSharding(self.mesh, P("data"))
        self.centered = centers_SxD is not None
        self.centers_SxD = (jax.device_put(jnp.asarray(centers_SxD, jnp.float32), NamedSharding(self.mesh, P()))
                            if self.centered else jnp.zeros((cfg.num_states, 0), jnp.float32))
        # Per-source spectra cost 2 x S x D x D x 8 bytes per source: kept for up to 8 sources.
        self.init_kwargs = dict(num_groups=num_groups, token_stats=token_stats, centered=self.centered,
                                group_spectra=num_groups <= MAX_GROUP_SPECTRA)
        self.acc = self.fresh_accumulators()
        self._step = _compiled_step(module, self.mesh, self.centered)

    def fresh_accumulators(self):
        cfg = self.cfg
        init = lambda: jax.tree.map(lambda x: x[None], stats.init_accumulators(
            cfg.num_states, cfg.hidden_size, cfg.vocab_size, **self.init_kwargs))
        sharding = jax.tree.map(lambda _: NamedSharding(self.mesh, P("data")), jax.eval_shape(init))
        return jax.jit(lambda: jax.tree.map(lambda x: jnp.repeat(x, self.num_devices, 0), init()),
                       out_shardings=sharding)()

    def load_accumulators(self, acc_host) -> None:
        """Resume from merged accumulators: device 0 takes them, the others start from zero."""
        def stack(x):
            x = np.asarray(x)
            return np.concatenate([x[None], np.zeros((self.num_devices - 1, *x.shape), x.dtype)])
        self.acc = jax.device_put(jax.tree.map(stack, acc_host), NamedSharding(self.mesh, P("data")))

    def accumulator_bytes(self) -> int:
        cfg = self.cfg
        return stats.accumulator_bytes(cfg.num_states, cfg.hidden_size, cfg.vocab_size, **self.init_kwargs)

    def step(self, tokens_BxT, segment_ids_BxT, positions_BxT, group: int) -> None:
        """Consume one batch (rows must divide evenly over the devices); asynchronous."""
        rows = jax.device_put((tokens_BxT, segment_ids_BxT, positions_BxT), self.row_sharding)
        self.acc = self._step(self.params, self.acc, *rows, jnp.int32(group), self.centers_SxD)

    def merged_accumulators(self) -> stats.Accumulators:
        """The per-device accumulators merged into one, on the host CPU backend, one device's
        slice at a time: host memory holds at most three copies (running total, the next
        slice, their merge) however many devices there are."""
        leaves, treedef = jax.tree.flatten(self.acc)
        total = None
        for i in range(self.num_devices):
            part = treedef.unflatten([np.asarray(x.addressable_shards[i].data)[0] for x in leaves])
            if total is None:
                total = part
                continue
            with jax.default_device(jax.devices("cpu")[0]):  # not on the accelerator, which holds self.acc
                total = jax.device_get(stats.merge(total, part))
        return total


def _compiled_step(module: GPTNeoX, mesh, centered: bool):
    def local_step(params, acc, tokens_BxT, seg_BxT, pos_BxT, group, centers_SxD):
        acc = jax.tree.map(lambda x: x[0], acc)  # this device's slice
        d = module.cfg.hidden_size
        ids_N, valid_N = tokens_BxT.reshape(-1), seg_BxT.reshape(-1) != 0
        vocab = acc.tok_count_SxV.shape[1]
        index = stats.index_tokens(ids_N, valid_N, vocab) if vocab else None

        def observe(acc, s, x_BxTxD):
            center_D = jax.lax.dynamic_index_in_dim(centers_SxD, s, 0, keepdims=False) if centered else None
            return stats.update_state(acc, s, x_BxTxD.reshape(-1, d), ids_N, valid_N, group, center_D,
                                      index=index)

        acc = module.apply({"params": params}, tokens_BxT, seg_BxT, pos_BxT, acc, observe)
        return jax.tree.map(lambda x: x[None], acc)

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data"), P("data"),
                                                             P(), P()),
                            out_specs=P("data"), check_vma=False)
    return jax.jit(sharded, donate_argnums=(1,))


def device_memory_bytes() -> int | None:
    """Memory of one local device (None where the backend does not say, e.g. CPU)."""
    try:
        stats_ = jax.local_devices()[0].memory_stats()
        return int(stats_["bytes_limit"]) if stats_ and "bytes_limit" in stats_ else None
    except Exception:
        return None


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

