"""A uniform sample of K token positions, with every hidden state of each, kept on the devices
(*The Shape of Learning* estimates intrinsic dimension and batch anisotropy from such samples).

Bottom-K sampling: every token of the corpus gets a 64-bit pseudo-random key from its identity
(its sequence's index in the token cache and its position there, hashed with a seed), and the
sample is the K tokens with the smallest keys seen. That is a uniform sample without
replacement, and it is mergeable: the sample of two parts is the bottom K of the union of
their samples. So it does not depend on batch size, packing, device or process count, or on a
resume, and merges like the other accumulators. Axes: K slots, S states, N positions, D width.

Each device keeps its own K slots; a batch replaces the slots whose keys no longer rank among
the K smallest, in place (a slot's sample never moves): after the first batches only a few
tokens enter per batch, so the per-state work is a gather/scatter of those rows, in chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

EMPTY = np.uint32(0xFFFFFFFF)  # the key of an empty slot (both words): above every token's
SEED = 0x5EED
CHUNK = 1024  # inserted rows per gather/scatter round


def _mix32(x):
    """murmur3's 32-bit finalizer: a bijection that spreads every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def token_keys(sequence_ids_N, positions_N, valid_N):
    """[N, 2] uint32 keys (high word, low word) of tokens by identity; EMPTY where not valid."""
    seq = sequence_ids_N.astype(jnp.uint32)
    pos = positions_N.astype(jnp.uint32)
    hi = _mix32(seq * jnp.uint32(0x9E3779B1) ^ _mix32(pos + jnp.uint32(SEED)))
    lo = _mix32(hi ^ _mix32(pos * jnp.uint32(0x27D4EB2F) + seq))
    key = jnp.stack([hi, lo], axis=-1)
    # a real key equal to EMPTY would be dropped: vanishingly rare (2^-64 per token), harmless
    return jnp.where(valid_N[:, None], key, EMPTY)


@struct.dataclass
class Plan:
    """Which batch rows enter which slots: slot_M[i] <- row_M[i] for i < count[0] (M = min(N, K))."""

    slot_M: jax.Array
    row_M: jax.Array
    count: jax.Array


def _bottom_k(keys_Mx2, k: int):
    """Indices of the k smallest keys, in ascending key order."""
    idx = jnp.arange(keys_Mx2.shape[0], dtype=jnp.int32)
    _, _, order = lax.sort((keys_Mx2[:, 0], keys_Mx2[:, 1], idx), num_keys=2)
    return order[:k]


def plan(sample_keys_Kx2, batch_keys_Nx2):
    """(new slot keys [K, 2], Plan) for one batch on one device."""
    k, n = sample_keys_Kx2.shape[0], batch_keys_Nx2.shape[0]
    m = min(n, k)
    chosen_K = _bottom_k(jnp.concatenate([sample_keys_Kx2, batch_keys_Nx2]), k)
    from_batch = chosen_K >= k
    kept_K = jnp.zeros(k, bool).at[jnp.where(from_batch, k, chosen_K)].set(True, mode="drop")
    # the slots freed and the rows that fill them pair up in order; both number `count`
    slot_M = jnp.nonzero(~kept_K, size=m, fill_value=k)[0].astype(jnp.int32)
    rows = jnp.where(from_batch, chosen_K - k, n)
    row_M = jnp.sort(rows)[:m].astype(jnp.int32)
    count = jnp.sum(from_batch, keepdims=True).astype(jnp.int32)  # [1]: splittable over devices
    keys = sample_keys_Kx2.at[slot_M].set(batch_keys_Nx2.at[row_M].get(mode="fill", fill_value=EMPTY),
                                          mode="drop")
    return keys, Plan(slot_M, row_M, count)


def insert(sample_SxKxD, s, x_NxD, p: Plan):
    """The rows of state s that enter the sample, copied into their slots (in chunks of
    CHUNK rows, as many as were inserted)."""
    m = p.slot_M.shape[0]
    chunk = min(CHUNK, m)
    x_NxD = x_NxD.astype(sample_SxKxD.dtype)

    def one(c, sample):
        take = lambda v: lax.dynamic_slice_in_dim(v, c * chunk, chunk)
        slots, rows = take(jnp.pad(p.slot_M, (0, -m % chunk), constant_values=sample.shape[1])), \
            take(jnp.pad(p.row_M, (0, -m % chunk)))
        return sample.at[s, slots].set(x_NxD.at[rows].get(mode="fill", fill_value=0), mode="drop")

    return lax.fori_loop(0, (p.count[0] + chunk - 1) // chunk, one, sample_SxKxD)


def merge(keys_a, sample_a, keys_b, sample_b):
    """The bottom K of two samples (keys [K, 2], states [S, K, D])."""
    k = keys_a.shape[0]
    if k == 0:
        return keys_a, sample_a
    order = _bottom_k(jnp.concatenate([keys_a, keys_b]), k)
    return jnp.concatenate([keys_a, keys_b])[order], jnp.concatenate([sample_a, sample_b], axis=1)[:, order]


def merge_host(keys_PxKx2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(part, slot) of the K smallest keys over P parts' samples, in ascending key order, the
    empty slots left out (numpy, for the final merge across devices and processes)."""
    p, k, _ = keys_PxKx2.shape
    flat = keys_PxKx2.reshape(-1, 2)
    order = np.lexsort((flat[:, 1], flat[:, 0]))[:k]
    order = order[~((flat[order, 0] == EMPTY) & (flat[order, 1] == EMPTY))]
    return order // k, order % k


IDENTITY = ("sequence_ids", "positions", "token_ids")  # samples.zarr's arrays beside keys, one entry per sampled token


def identify(keys_Kx2: np.ndarray, offsets: np.ndarray, tokens: np.ndarray, chunk: int = 1 << 22) -> dict:
    """{"sequence_ids": int64, "positions": int32, "token_ids": int32} [K] of the sampled tokens, in the
    order of keys_Kx2, recovered on the host: every token of the token cache (sequence i is
    tokens[offsets[i]:offsets[i+1]], a window as the run packed it) gets its key by token_keys, the
    device's own function, about `chunk` tokens at a time (one compile: chunks padded to one size),
    and the sampled keys are looked up among them. -1 where a key matches no token (never, unless the
    cache is not the run's)."""
    k = len(keys_Kx2)
    packed = lambda hi_lo: (hi_lo[:, 0].astype(np.uint64) << np.uint64(32)) | hi_lo[:, 1].astype(np.uint64)
    wanted = packed(np.asarray(keys_Kx2, np.uint32))
    order = np.argsort(wanted)
    ranked = wanted[order]
    out = {"sequence_ids": np.full(k, -1, np.int64), "positions": np.full(k, -1, np.int32),
           "token_ids": np.full(k, -1, np.int32)}
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    n_seq = len(lengths)
    if not k or not n_seq:
        return out
    size = chunk + int(lengths.max())
    cpu = jax.devices("cpu")[0]
    keys_of = jax.jit(lambda s, p: token_keys(s, p, jnp.ones(s.shape, bool)))  # on the host's CPU: inputs placed there
    first = 0
    while first < n_seq:
        last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + chunk, "right")) - 1)
        last = min(last, n_seq)
        seq = np.repeat(np.arange(first, last, dtype=np.int64), lengths[first:last])
        at = np.arange(offsets[first], offsets[last], dtype=np.int64)
        pos = at - offsets[seq]
        n = len(seq)
        pad = lambda a: jax.device_put(np.pad(a.astype(np.int32), (0, size - n)), cpu)
        got = packed(np.asarray(keys_of(pad(seq), pad(pos)))[:n])
        slot = np.minimum(np.searchsorted(ranked, got), k - 1)
        hit = ranked[slot] == got
        where = order[slot[hit]]
        out["sequence_ids"][where] = seq[hit]
        out["positions"][where] = pos[hit]
        out["token_ids"][where] = np.asarray(tokens[at[hit]])
        first = last
    return out
