"""Where loading a Hugging Face checkpoint's seconds go (issue 12): reading the safetensors files
into host memory, copying host arrays to the device, and isojax's load_model as a whole.

    python -m bench.bench_load --model /tmp/e2e/model      # a local Hugging Face directory

Rows (seconds, the best of --repeats; the files are in the page cache after the first):
  read            CheckpointReader.read of every tensor into numpy (safetensors get_tensor)
  device_put      jax.device_put of those numpy arrays (pageable host memory), one at a time
  via pinned      the same arrays put into "pinned_host" memory first, then onto the device
  load_model      isojax.hf.loading.load_model: read, copy and build the parameter tree (bf16)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


import jax


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from isojax.hf.files import CheckpointReader
    from isojax.hf.loading import load_model

    reader = CheckpointReader(Path(args.model))
    names = reader.names()
    host = {n: reader.read(n) for n in names}
    nbytes = sum(a.nbytes for a in host.values())
    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    rows = [("read", best(lambda: [reader.read(n) for n in names], args.repeats))]
    rows.append(("device_put", best(lambda: [jax.device_put(a) for a in host.values()], args.repeats)))
    if "pinned_host" in kinds:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_device = jax.sharding.SingleDeviceSharding(dev)
        jax.block_until_ready([jax.device_put(a, pinned) for a in host.values()])  # grow XLA's pinned pool once
        rows.append(("via pinned", best(lambda: [jax.device_put(jax.device_put(a, pinned), on_device)
                                                 for a in host.values()], args.repeats)))
    rows.append(("load_model", best(lambda: load_model(args.model, dtype="bfloat16").params, args.repeats)))
    print(f"device: {dev.device_kind}; jax {jax.__version__}; {len(names)} tensors, {nbytes / 1e9:.2f} GB "
          f"({', '.join(sorted({str(a.dtype) for a in host.values()}))})")
    print(f"{'step':<14}{'s':>8}{'GB/s':>8}")
    for name, secs in rows:
        print(f"{name:<14}{secs:>8.2f}{nbytes / secs / 1e9:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
