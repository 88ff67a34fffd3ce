"""What a checkpoint's device-to-host copy costs a busy device: ways of moving accumulators to host
memory while a loop of matrix products runs (issue 11's checkpoint target).

For each way: how long the caller is blocked ("start"), the time until the copy is in host
memory (or on disk, for the writer), and the speed of a loop of matrix products (at most 2 steps
in flight) while the copy runs, relative to the same loop alone; "loop lost" = the seconds of loop
work the copy cost (blocked + slowed). Ways:
  asarray      a background thread calls np.asarray on a device copy (isojax <= 9c60022, part)
  async        copy_to_host_async on the device copy, then np.asarray in the thread (9c60022)
  pinned       jax.device_put of the device copy into the "pinned_host" memory space, then
               np.asarray in the thread (name it twice: the second finds XLA's pinned pool grown)
  writer       isojax's checkpoint writer: a thread moves each array into pinned host memory
               one slice of the leading axis at a time and writes it to .npy files (disk included)
  torch        what the link allows: PyTorch copies as many bytes from its own device buffer into
               page-locked host memory it allocated beforehand (not isojax; needs torch)

    python -m bench.bench_transfer --gb 10
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=10.0, help="bytes to move (two float32 arrays)")
    ap.add_argument("--steps", type=int, default=200, help="steps of the baseline loop")
    ap.add_argument("--ways", default="asarray,async,pinned,writer")
    ap.add_argument("--dir", default="/tmp/isojax_bench_transfer", help="where the writer writes")
    args = ap.parse_args()
    dev = jax.devices()[0]
    rows = int(args.gb * 1e9 / 2 / 4 / 2048 / 25)
    make = jax.jit(lambda k: jax.random.normal(jax.random.key(k), (25, rows, 2048), jnp.float32))
    arrays = [make(0), make(1)]
    w = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    work = jax.jit(lambda a: jnp.tanh(a @ w) @ w)
    a = w
    jax.block_until_ready(work(a))
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))

    def loop(until=None):
        """Steps of `work`, at most 2 in flight (as isojax's loop): args.steps of them, or as many
        as run until `until()` is true. Returns (steps, seconds)."""
        t = time.perf_counter()
        out, pending, n = a, [], 0
        while (n < args.steps) if until is None else not until():
            out = work(out)
            pending.append(out)
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
            n += 1
        out.block_until_ready()
        return n, time.perf_counter() - t

    n, secs = min((loop() for _ in range(3)), key=lambda r: r[1])
    per_step = secs / n
    nbytes = sum(x.nbytes for x in arrays)
    print(f"card: {dev.device_kind}; jax {jax.__version__}; {nbytes / 1e9:.1f} GB; a step of the loop "
          f"{per_step * 1e3:.2f} ms")
    print(f"{'way':<10}{'start s':>9}{'host done s':>12}{'GB/s':>7}{'loop speed':>11}{'loop lost s':>12}")
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    for way in args.ways.split(","):
        device_copy = copy(arrays)
        jax.block_until_ready(device_copy)
        done = {}
        if way == "torch":
            import torch
            src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
            t = time.perf_counter()
            dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            torch.cuda.synchronize()
            print(f"(torch: {nbytes / 1e9:.1f} GB of page-locked host memory allocated in "
                  f"{time.perf_counter() - t:.2f} s)", flush=True)
        t0 = time.perf_counter()
        if way == "asarray":
            parts = device_copy
        elif way == "async":
            for x in device_copy:
                x.copy_to_host_async()
            parts = device_copy
        elif way == "pinned":
            parts = [jax.device_put(x, pinned) for x in device_copy]
        elif way in ("writer", "torch"):
            parts = device_copy
        else:
            raise SystemExit(f"unknown way {way}")
        start = time.perf_counter() - t0

        def drain(parts=parts, way=way):
            if way == "writer":
                from isojax.device import checkpoints as checkpointing
                shutil.rmtree(args.dir, ignore_errors=True)
                Path(args.dir).mkdir(parents=True)
                checkpointing._write_shards(Path(args.dir), [(f"a{i}.npy", p) for i, p in enumerate(parts)])
                done["n"] = sum(p.nbytes for p in parts)
            elif way == "torch":
                with torch.cuda.stream(torch.cuda.Stream()):
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.current_stream().synchronize()
                done["n"] = nbytes
            else:
                done["n"] = sum(np.asarray(p).nbytes for p in parts)
            done["t"] = time.perf_counter() - t0

        th = threading.Thread(target=drain)
        th.start()
        steps, during = loop(until=lambda: "t" in done)
        th.join()
        speed = steps * per_step / during  # the loop's speed while the transfer ran, 1 = undisturbed
        print(f"{way:<10}{start:>9.3f}{done['t']:>12.2f}{done['n'] / done['t'] / 1e9:>7.2f}{speed:>11.1%}"
              f"{start + during * (1 - speed):>12.2f}", flush=True)
        del device_copy, parts
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
