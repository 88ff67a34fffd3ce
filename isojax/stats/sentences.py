"""The sentence probe: the two measures that cannot stream exactly, computed as their papers define
them on a fixed subset of the corpus's sentences, after the loop, from a forward pass of its own.

The subset (`choose`): the token cache's sequences (a unit longer than the row length is already
cut into windows of it, each a sequence, as the loop reads them) in the order of a 64-bit hash of
their index in the cache (the murmur3 finalizer, as the sample's keys: stats/sample.py), those of
fewer than 2 tokens skipped, each placed into the first of R = max(1, TOKEN_BUDGET // row_len) rows
of row_len tokens with room for it (first fit; one that fits nowhere is skipped), until
MAX_SENTENCES are placed or every sequence has been tried. It depends on the cache (corpus,
tokenizer, row length) alone, so every checkpoint of a model over one corpus reads the same
sentences, whatever the device count or batch size.

The probe (`Probe`): the run's own module (its dtype and kernels, without the loop's row split) over
the rows used (`pack`), packed as the loop packs (segments, positions restarting at 0), returning
every state [S, R', row_len, D] in the model's dtype; read out in float64 on the host (`measures`):

- `erank` (Wei et al. 2024, Diff-eRank): per sentence, its states x_i centered on the sentence's mean
  and then each L2-normalized, z_i = (x_i - mu)/||x_i - mu||; Sigma = (1/n) sum z_i z_i^T, trace-
  normalized; eRank = exp(-sum lambda_k log lambda_k) over its eigenvalues (lambda, not sqrt);
  averaged over the subset's sentences. (From the n x n Gram Z Z^T / n: the same nonzero eigenvalues.)
- massive activations (Sun et al. 2024): per sentence and state, the median and the top-3 of |x| over
  all its n x D activations; an activation is massive when |x| > 100 and |x| >= 1000 x that median.
"""

from __future__ import annotations

import numpy as np

MAX_SENTENCES = 64
TOKEN_BUDGET = 8192
SEED = 0x5E47E
TOP_K = 3  # Sun et al.'s figures: the top-1, 2 and 3 magnitudes and the median
MASSIVE_ABOVE, MASSIVE_OVER_MEDIAN = 100.0, 1000.0
DELIMITERS = {".", ",", ";", ":", "!", "?"}
RULE = (f"the token cache's sequences in the order of a hash of their index, those of fewer than 2 tokens "
        f"skipped, first fit into max(1, {TOKEN_BUDGET} // row_len) rows of row_len tokens, up to "
        f"{MAX_SENTENCES} sentences")


def _mix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer on uint32 (wrapping) arithmetic."""
    x = x ^ (x >> np.uint32(16))
    x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
    x = x ^ (x >> np.uint32(13))
    x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
    return x ^ (x >> np.uint32(16))


def sentence_keys(indices: np.ndarray) -> np.ndarray:
    """uint64 keys of sequence indices: a hash, the same in every process and run."""
    with np.errstate(over="ignore"):
        seq = np.asarray(indices, np.uint64)
        low, high = (seq & np.uint64(0xFFFFFFFF)).astype(np.uint32), (seq >> np.uint64(32)).astype(np.uint32)
        hi = _mix32((low * np.uint32(0x9E3779B1)).astype(np.uint32) ^ _mix32(high + np.uint32(SEED)))
        lo = _mix32(hi ^ _mix32((low + np.uint32(0x27D4EB2F)).astype(np.uint32)))
    return (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)


def probe_rows(row_len: int) -> int:
    return max(1, TOKEN_BUDGET // row_len)


def choose(offsets: np.ndarray, row_len: int) -> list[tuple[int, int, int]]:
    """[(sequence index, row, start column)] of the subset (module docstring), in key order."""
    lengths = np.diff(np.asarray(offsets, np.int64))
    room = [row_len] * probe_rows(row_len)
    keys = sentence_keys(np.arange(len(lengths)))
    chosen = []
    first = min(len(keys), 1 << 16)  # the smallest keys first; the rest sorted only if they are needed
    head = np.argpartition(keys, first - 1)[:first] if 0 < first < len(keys) else np.arange(len(keys))
    head = head[np.lexsort((head, keys[head]))]
    for part in (head, None):
        if part is None:
            if len(chosen) == MAX_SENTENCES or first == len(keys):
                break
            part = np.lexsort((np.arange(len(keys)), keys))[first:]
        for i in part:
            n = int(lengths[i])
            row = next((r for r, free in enumerate(room) if free >= n), None) if n >= 2 else None
            if row is None:
                continue
            chosen.append((int(i), row, row_len - room[row]))
            room[row] -= n
            if len(chosen) == MAX_SENTENCES:
                break
    return chosen


def pack(cache, chosen, row_len: int):
    """(tokens, segment ids, positions) [R', row_len] int32 of the chosen sentences, and each one's
    (row, start, length). R': the rows they use (first fit fills rows in order) rounded up to a power
    of two, at most probe_rows (few shapes, so few compiles; the rows after theirs are padding)."""
    used = max((row for _, row, _ in chosen), default=0) + 1
    r = min(1 << (used - 1).bit_length(), probe_rows(row_len))
    tokens, seg, pos = (np.zeros((r, row_len), np.int32) for _ in range(3))
    spans = []
    for seg_id, (i, row, start) in enumerate(chosen, 1):
        ids = cache.sequence(i)
        tokens[row, start:start + len(ids)] = ids
        seg[row, start:start + len(ids)] = seg_id
        pos[row, start:start + len(ids)] = np.arange(len(ids))
        spans.append((row, start, len(ids)))
    return tokens, seg, pos, spans


_FORWARDS: dict = {}  # (cfg, dtype, options, mesh) -> the jitted forward (Probe)
_COMPILED: dict = {}  # and rows' shape, parameters' shapes -> its executable


def _jitted_forward(module, replicated):
    import jax
    import jax.numpy as jnp

    from isojax.model.decoder import collect_states
    cfg = module.cfg

    def forward(params, tokens, seg, pos):
        buf = jnp.zeros((cfg.num_states, *tokens.shape, cfg.hidden_size), module.dtype)
        return module.apply({"params": params}, tokens, seg, pos, buf, collect_states)

    return jax.jit(forward, out_shardings=replicated)


class Probe:
    """The forward of every state over the subset's packed rows: the run's module without its rows'
    split over devices, its parameters where the run placed them, inputs and output replicated.
    prepare(cache) chooses and packs the subset; compile_beside(finished) does that and compiles the
    forward for its rows on a thread, while the devices measure (finished() -> the finished cache)."""

    def __init__(self, module, params, mesh, row_len: int):
        import dataclasses

        from jax.sharding import NamedSharding, PartitionSpec
        self.module = module.clone(options=dataclasses.replace(module.options, activation_sharding=None))
        self.params, self.mesh, self.row_len = params, mesh, row_len
        self.replicated = NamedSharding(mesh, PartitionSpec())  # stats/ imports nothing of device/
        # one jitted forward per model shape and mesh in a process: a sweep's checkpoints share it, and
        # its executable (_COMPILED), so a later checkpoint neither traces nor compiles the probe again
        self._key = (self.module.cfg, self.module.dtype, self.module.options, mesh)
        if self._key not in _FORWARDS:
            _FORWARDS[self._key] = _jitted_forward(self.module, self.replicated)
        self._jitted = _FORWARDS[self._key]
        self._compiled, self._ahead, self.packed = None, None, None

    def prepare(self, cache):
        if self.packed is None:
            self.chosen = choose(cache.offsets, self.row_len)
            self.packed = pack(cache, self.chosen, self.row_len)
        return self

    def _inputs(self, arrays):
        import jax
        return [jax.make_array_from_callback(a.shape, self.replicated, lambda idx, a=a: a[idx]) for a in arrays]

    def compile(self, cache):
        """prepare(cache), then compile the forward for the rows' shape and these parameters."""
        import jax
        self.prepare(cache)
        rows = jax.ShapeDtypeStruct(self.packed[0].shape, np.int32, sharding=self.replicated)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params)
        key = (self._key, rows.shape, str(jax.tree.structure(abstract)), tuple(jax.tree.leaves(abstract)))
        if key not in _COMPILED:
            _COMPILED[key] = self._jitted.lower(abstract, rows, rows, rows).compile()
        self._compiled = _COMPILED[key]

    def compile_beside(self, finished) -> None:
        """compile(finished()) on a thread (while the devices measure); states() waits for it."""
        import concurrent.futures
        # not a daemon thread: a compile still running at exit would abort the interpreter's
        # finalization; one that failed is found by settle(), which compiles at the call instead
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="isojax-sentences")
        self._ahead = pool.submit(lambda: self.compile(finished()))
        pool.shutdown(wait=False)

    def settle(self) -> None:
        """Wait for the compile beside, if any; one that failed is done again at the call."""
        if self._ahead is not None and self._ahead.exception() is not None:
            self._compiled = None

    def states(self, cache) -> np.ndarray:
        """[S, R', row_len, D] in the model's dtype, on the host."""
        self.settle()
        self.prepare(cache)
        fn = self._compiled or self._jitted
        out = fn(self.params, *self._inputs(self.packed[:3]))
        return np.asarray(out.addressable_shards[0].data)


def delimiter_ids(tokenizer, token_ids) -> set[int]:
    """The ids among token_ids that decode to a delimiter: after stripping spaces, one of . , ; : ! ?
    or whitespace holding a newline."""
    found = set()
    for t in sorted(set(int(t) for t in token_ids)):
        text = tokenizer.decode([t])
        if text.strip(" ") in DELIMITERS or (text and not text.strip() and "\n" in text):
            found.add(t)
    return found


def sentence_erank(x_NxD: np.ndarray) -> float | None:
    """Diff-eRank's eRank of one sentence's states (module docstring), float64; None where no token's
    centered state is nonzero. A token whose centered state is 0 stays 0 (no direction)."""
    x = np.asarray(x_NxD, np.float64)
    c = x - x.mean(0)
    norms = np.linalg.norm(c, axis=1, keepdims=True)
    z = np.divide(c, norms, out=np.zeros_like(c), where=norms > 0)
    g = z @ z.T / len(z) if len(z) <= z.shape[1] else z.T @ z / len(z)
    trace = np.trace(g)
    if not trace > 0:
        return None
    lam = np.clip(np.linalg.eigvalsh(g / trace), 0.0, None)
    lam = lam[lam > 0]
    return float(np.exp(-np.sum(lam * np.log(lam))))


def sentence_massive(x_NxD: np.ndarray):
    """(median |x|, the top-3 |x| descending, the (position, dim) of each massive activation) of one
    sentence's state."""
    a = np.abs(np.asarray(x_NxD, np.float64))
    flat = a.ravel()
    c = flat.size
    middle = np.partition(flat, [(c - 1) // 2, c // 2])  # the median without a full sort
    median = float((middle[(c - 1) // 2] + middle[c // 2]) / 2)
    k = min(TOP_K, c)
    top = [float(v) for v in np.sort(np.partition(flat, c - k)[c - k:])[::-1]] + [None] * (TOP_K - k)
    where = np.argwhere((a > MASSIVE_ABOVE) & (a >= MASSIVE_OVER_MEDIAN * median))
    return median, top, where


def measures(states_SxRxTxD: np.ndarray, spans, token_ids: list[np.ndarray], delimiters: set[int]) -> list[dict]:
    """Per state: erank and the massive-activation measures (README "Measures") of the sentences at
    `spans` [(row, start, length)], whose token ids are token_ids; float64 on the host."""
    import concurrent.futures
    import os

    one = lambda s: _state_measures(states_SxRxTxD[s], spans, token_ids, delimiters)
    # a state per thread (numpy's eigensolver and partitions let go of the GIL)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(states_SxRxTxD), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, range(len(states_SxRxTxD))))


def _state_measures(states_RxTxD, spans, token_ids, delimiters) -> dict:
    """measures() of one state [R, T, D]."""
    eranks, medians, tops, count, having, first, at_delim, dims = [], [], [], 0, 0, 0, 0, {}
    for (row, start, n), ids in zip(spans, token_ids):
        x = np.asarray(states_RxTxD[row, start:start + n], np.float64)
        e = sentence_erank(x)
        if e is not None:
            eranks.append(e)
        median, top, where = sentence_massive(x)
        medians.append(median)
        tops.append(top)
        if len(where):
            having += 1
            count += len(where)
            first += int(np.sum(where[:, 0] == 0))
            at_delim += sum(int(ids[p]) in delimiters for p in where[:, 0])
            for d in where[:, 1]:
                dims[int(d)] = dims.get(int(d), 0) + 1
    mean = lambda v: float(np.mean(v)) if len(v) else None
    top_mean = [mean([t[k] for t in tops if t[k] is not None]) for k in range(TOP_K)]
    return {"erank": mean(eranks), "erank_sentences": len(eranks), "massive_count": count, "massive_sequences": having,
            "massive_dims": [{"dim": d, "count": c} for d, c in sorted(dims.items(), key=lambda dc: (-dc[1], dc[0]))],
            "massive_first_share": first / count if count else None,
            "massive_delimiter_share": at_delim / count if count else None,
            **{f"massive_top{k + 1}": top_mean[k] for k in range(TOP_K)}, "massive_median": mean(medians)}


def probe(cache, probe: Probe, tokenizer) -> tuple[list[dict], dict]:
    """(per-state measures, metrics.json's `sentences`) of the subset of `cache` through `probe`."""
    import time

    from isojax.log import log
    start = time.time()
    probe.settle()
    spans = probe.prepare(cache).packed[3]
    states = probe.states(cache) if spans else None
    ids = [probe.packed[0][row, begin:begin + n] for row, begin, n in spans]
    delimiters = delimiter_ids(tokenizer, np.concatenate(ids)) if ids and tokenizer is not None else set()
    forward = time.time()
    layers = measures(states, spans, ids, delimiters) if spans else []
    tokens, rows = sum(n for _, _, n in spans), len(probe.packed[0])
    log(f"sentence probe: {len(spans)} sentences, {tokens:,} tokens in {rows} x {probe.row_len} rows; forward "
        f"{forward - start:.2f} s, float64 read-out {time.time() - forward:.2f} s")
    info = {"rule": RULE, "sentences": len(spans), "tokens": tokens, "rows": rows, "row_len": probe.row_len,
            "indices": [i for i, _, _ in probe.chosen], "delimiter_ids": sorted(delimiters)}
    return layers, info
