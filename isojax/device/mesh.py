"""Devices and hosts: process setup, the mesh, shardings and each process's share of a batch.
The only module that knows how many devices and hosts there are.

Mesh axes ("data", "model"): every device is data parallel, i.e. the rows of a batch are split
over all n devices (ALL = both axes). Parameters are replicated, or sharded over "model" (FSDP:
XLA gathers each layer's weights when the layer scan reaches it), which divides their memory by
the size of "model". Accumulators (see device/runner.py): the layer part holds one partial per device
on a leading axis of n; the per-token part is split over the vocabulary, device k owning token
ids k, k + n, k + 2n, ... (interleaved, so that every device gets its share of a batch's
distinct tokens: a contiguous split gave the first of 8 devices 2.9 times its share on real
text).

Multi-host: one process per host, `jax.distributed.initialize` (explicit coordinator or the
cluster's environment), every process supplies the rows of its own devices (`local_rows`) of the
same steps; global arrays are assembled from process-local data. Each process fills its rows from
its own share of the corpus (data/shares.py; the processes trade what they read through
`exchange`), or, where the corpus is not split, every process plans the same batches.
"""

from __future__ import annotations

import os
import socket
import time

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from isojax.errors import UserError

AXES = ("data", "model")
ALL = AXES  # rows (and token ids) are split over both axes
SHUTDOWN_TIMEOUT_S = 3600  # extract's --shutdown-timeout: process 0 may write large results while the others wait


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               auto: bool = False, timeout_s: int = 120, shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S) -> None:
    """Join a multi-process run: explicit (coordinator, count, id), or auto = the cluster's
    environment (TPU pod slices, SLURM, Open MPI; see jax.distributed.initialize). Must run
    before anything touches a JAX backend. shutdown_timeout_s: how long the end waits for the
    slowest process (finish)."""
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if not (explicit or auto):
        return
    if explicit and None in (coordinator, num_processes, process_id):
        raise UserError("--coordinator, --num-processes and --process-id go together")
    if explicit and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in [0, {num_processes})")
    if explicit and process_id != 0:  # the distributed client aborts the process when it times out
        _wait_for_coordinator(coordinator, timeout_s)
    if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU stand-in for a pod
    try:
        if explicit:
            jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                                       shutdown_timeout_seconds=shutdown_timeout_s)
        else:
            jax.distributed.initialize(initialization_timeout=timeout_s, shutdown_timeout_seconds=shutdown_timeout_s)
    except Exception as e:  # unreachable coordinator, no cluster found, ...
        raise UserError(f"could not join the distributed run ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Until the coordinator (process 0) listens at HOST:PORT; else a short error."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--coordinator {address!r}: expected HOST:PORT")
    deadline = time.time() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.time() >= deadline:
                raise UserError(f"coordinator {address} unreachable after {timeout_s:.0f} s ({e.strerror or e}); "
                                "start process 0 first, or check the address and --coordinator-timeout") from None
            time.sleep(0.5)


def parse_mesh(spec: str | None) -> dict[str, int]:
    """'data=2,model=2' (either may be left out) -> {"data": 2, "model": 2}; missing sizes are
    filled in by make_mesh."""
    if not spec:
        return {}
    sizes = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES or not value.strip().isdigit() or int(value) < 1 or name in sizes:
            raise UserError(f"--mesh {spec!r}: expected data=N,model=M with positive integers")
        sizes[name] = int(value)
    return sizes


def use_gspmd_partitioner() -> None:
    """XLA's Shardy partitioner segfaults compiling isojax's step for 2 or more GPUs (jax 0.11.2,
    CUDA 13, H100/H200: in the shardy-xla pass, for the forward alone and for the statistics
    alone; single-device programs and small shard_map programs compile; bench/RESULTS.md §7). The GSPMD partitioner compiles and runs it, so isojax uses GSPMD on every
    backend (the CPU tests then exercise what the GPUs run)."""
    if hasattr(jax.config, "jax_use_shardy_partitioner") and jax.config.jax_use_shardy_partitioner:
        jax.config.update("jax_use_shardy_partitioner", False)


def make_mesh(sizes: dict[str, int] | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over all devices (of every process); a size left out is what
    the other leaves."""
    use_gspmd_partitioner()
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    sizes = dict(sizes or {})
    model = sizes.get("model")
    data = sizes.get("data")
    if model is None:
        model = n // data if data and n % data == 0 else 1
    if data is None:
        data = n // model if n % model == 0 else 0
    if "data" in sizes and "model" in sizes and data * model < n and jax.process_count() == 1:
        devices, n = devices[:data * model], data * model  # both sizes given: the first data x model devices
    if data * model != n:
        raise UserError(f"mesh data={data},model={model} does not divide the {n} devices "
                        f"(data x model must equal {n}, or name both to use fewer devices on one host)")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def rows(mesh: Mesh) -> NamedSharding:
    """Batch rows split over every device."""
    return NamedSharding(mesh, P(ALL))


def param_shardings(params, mesh: Mesh):
    """Replicated when "model" has size 1; else each parameter split over "model" along its
    largest axis that divides evenly (the stacked layer axis of scanned weights excepted)."""
    m = mesh.shape["model"]

    def one(path, x):
        if m == 1 or x.ndim == 0:
            return replicated(mesh)
        scanned = any(getattr(k, "key", None) == "layers" for k in path)
        axes = [a for a in range(int(scanned), x.ndim) if x.shape[a] % m == 0]
        if not axes:
            return replicated(mesh)
        a = max(axes, key=lambda i: x.shape[i])
        spec = [None] * x.ndim
        spec[a] = "model"
        return NamedSharding(mesh, P(*spec))

    return jax.tree_util.tree_map_with_path(one, params)


def local_rows(mesh: Mesh, total_rows: int) -> np.ndarray:
    """The global row indices of a batch this process supplies: the rows of its own devices, in
    ascending order (on one host: all of them)."""
    index_map = rows(mesh).addressable_devices_indices_map((total_rows,))
    return np.unique(np.concatenate([np.arange(total_rows)[idx[0]] for idx in index_map.values()]))


def global_rows(local_LxT: np.ndarray, mesh: Mesh, total_rows: int) -> jax.Array:
    """This process's rows of a batch (those of local_rows(), in that order) -> the global
    [total_rows, T] array, split over every device."""
    if jax.process_count() == 1:
        return jax.device_put(local_LxT, rows(mesh))
    shape = (total_rows, *local_LxT.shape[1:])
    where = {r: i for i, r in enumerate(local_rows(mesh, total_rows))}
    shards = []
    for device, idx in rows(mesh).addressable_devices_indices_map(shape).items():
        block = np.arange(total_rows)[idx[0]]
        shards.append(jax.device_put(local_LxT[[where[r] for r in block]], device))
    return jax.make_array_from_single_device_arrays(shape, rows(mesh), shards)


EXCHANGE_DEADLINE_S = 3600.0  # ISOJAX_EXCHANGE_TIMEOUT (seconds) overrides it
_LONGER = "ISOJAX_EXCHANGE_TIMEOUT=SECONDS waits longer"


def finish(timeout_s: float) -> None:
    """The end of a multi-process run, in every process once the results are committed (process 0
    wrote them): wait, up to timeout_s, until every process has got here, so that jax.distributed's
    shutdown barrier at exit finds them all at once. That barrier cannot be caught: a process that
    comes later than its timeout ends every waiting one in the coordination service's fatal error
    (a loaded host writing the results was one). This wait goes through the key-value store, whose
    deadline isojax keeps: a process that does not come in time is a warning, and this process then
    leaves without the barrier, exit status 0, its results whole."""
    if jax.process_count() == 1:
        return
    from isojax.log import log
    try:
        exchange("finished", b"", deadline_s=timeout_s, longer="--shutdown-timeout SECONDS waits longer")
    except UserError as e:
        log(f"warning: the results are complete, but {e}; process {jax.process_index()} leaves without "
            "jax.distributed's shutdown barrier")
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def exchange(name: str, value: bytes, deadline_s: float | None = None, longer: str = _LONGER) -> list[bytes]:
    """Every process's `value` published under `name`, in process order; each process calls it once
    per name. Through jax.distributed's key-value store, so from any thread and with no device
    involved. It waits for the others up to deadline_s (default: $ISOJAX_EXCHANGE_TIMEOUT, else an
    hour: a process may still be tokenizing its share), then raises a UserError naming the processes
    that never published."""
    if jax.process_count() == 1:
        return [value]
    deadline_s = _exchange_deadline() if deadline_s is None else deadline_s
    # jax (0.10, 0.11) has no public key-value API (jax.distributed offers initialize and shutdown,
    # multihost_utils trades arrays through the devices): the client jax.distributed keeps
    from jax._src.distributed import global_state
    client = global_state.client
    client.key_value_set_bytes(f"isojax/{name}/{jax.process_index()}", value)
    end = time.monotonic() + deadline_s
    out = []
    for p in range(jax.process_count()):
        while len(out) == p:
            left_ms = int(min(60.0, end - time.monotonic()) * 1000)
            try:
                out.append(client.blocking_key_value_get_bytes(f"isojax/{name}/{p}", max(left_ms, 1)))
            except Exception as e:  # noqa: BLE001 -- the wait's deadline: process p is still at work
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                if time.monotonic() >= end:
                    missing = [q for q in range(p, jax.process_count()) if not _published(client, f"isojax/{name}/{q}")]
                    raise UserError(f"exchange {name!r}: process{'es' if len(missing) > 1 else ''} "
                                    f"{', '.join(map(str, missing))} of {jax.process_count()} did not publish within "
                                    f"{deadline_s:g} s (dead, stuck or far behind: see their logs); {longer}") from None
    return out


def _exchange_deadline() -> float:
    text = os.environ.get("ISOJAX_EXCHANGE_TIMEOUT")
    if text is None:
        return EXCHANGE_DEADLINE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UserError(f"ISOJAX_EXCHANGE_TIMEOUT={text!r}: expected a number of seconds > 0")
    return seconds


def _published(client, key: str) -> bool:
    try:
        client.key_value_try_get_bytes(key)
    except Exception:  # noqa: BLE001 -- NOT_FOUND
        return False
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0



def all_processes_agree(ok: bool) -> bool:
    """Whether `ok` holds on every process (on one process, ok itself). Through the key-value store,
    not a collective: processes come to it far apart (a resume's checkpoint loads), and the first
    collective of a device set waits only 30 s for the others on CPUs (gloo's context), where
    exchange waits up to its deadline."""
    if jax.process_count() == 1:
        return bool(ok)
    return all(v == b"1" for v in exchange(_next("agree"), b"1" if ok else b"0"))


def all_processes_here(name: str) -> None:
    """Wait until every process has come here (each calls it as often, in the same order): before
    a collective that processes reach far apart, such as the first step (see all_processes_agree)."""
    if jax.process_count() > 1:
        exchange(_next(name), b"")


_calls: dict[str, int] = {}


def _next(name: str) -> str:
    """name and how often this process asked for it: a fresh key for each call, the same in every process."""
    _calls[name] = _calls.get(name, 0) + 1
    return f"{name}/{_calls[name]}"
