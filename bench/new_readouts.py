"""The GPU cost of the read-outs added in session 45 (registry sample measures, the sentence probe's host read-out, the sample's identity): python bench/new_readouts.py."""
import time, sys
import numpy as np
import jax, jax.numpy as jnp
from isojax.stats import measures
from isojax.stats import sentences
S, K, D = 26, 16384, 1024
rng = np.random.default_rng(0)
xs = [jax.device_put(rng.standard_normal((K, D)).astype(np.float32)) for _ in range(S)]
for name, m in measures.MEASURES.items():
    if m.reads not in ("sample", "pairs"):
        continue
    f = measures._jitted(m.readout)
    with jax.enable_x64(True):
        args = (xs[0],) if m.reads == "sample" else (xs[0], xs[1])
        t = time.time(); jax.block_until_ready(f(*args)); c = time.time() - t
        t = time.time()
        outs = [f(*((xs[s],) if m.reads == "sample" else (xs[s - 1], xs[s]))) for s in range(1, S)]
        jax.block_until_ready(outs)
    print(f"{name}: first call {c:.2f} s, {S-1} states {time.time()-t:.3f} s", flush=True)
st = rng.standard_normal((S, 16, 512, D)).astype(np.float32)
spans = [(r, 64 * j, 50) for r in range(16) for j in range(4)]
ids = [rng.integers(0, 50000, 50) for _ in spans]
t = time.time(); sentences.measures(st, spans, ids, {13}); print(f"sentence probe host read-out (64 x 50 tokens, 26 states): {time.time()-t:.2f} s", flush=True)
from isojax.stats.sample import identify
offsets = np.arange(0, 2_000_001, 55, dtype=np.int64); toks = rng.integers(0, 50000, offsets[-1]).astype(np.int32)
keys = np.zeros((K, 2), np.uint32)
t = time.time()
try:
    identify(keys, offsets, toks)
except Exception as e:
    print("identify:", type(e).__name__, e)
print(f"identify over 2M tokens: {time.time()-t:.2f} s", flush=True)
