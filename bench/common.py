"""Helpers the benchmarks share: the synthetic workload (sentence lengths, token ids, model shapes),
its packing through isojax's packer, and a median timer.

The paper's throughput figures (Machina & Mercer 2024, Table 3) are over Enron Emails split
into sentences: 107M tokens in 3.2M sentences, a mean of ≈ 33 tokens. We draw sentence
lengths from a log-normal with that mean and token ids from a Zipf law, so that batching
(padding waste) and the per-token scatter (contention on frequent rows) both look like
real text. Weights are random, so the token *content* matters only through that skew.

A corpus is a flat int32 token array plus int64 offsets: sentence i is
``tokens[offsets[i]:offsets[i + 1]]`` (a list of small arrays costs ~100 B per sentence).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

MEAN_SENTENCE_TOKENS = 33.0
# Spread of sentence lengths in log space; at mean 33, 0.9 puts 90% of sentences between
# 5 and 97 tokens (median 22), a long right tail like sentence-split email text.
SIGMA = 0.9

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def _preset_shape(name: str) -> tuple[int, int, int, int, int]:
    # The JSON presets, not isojax.model.config: the peer runs where torch is and jax may not be.
    c = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    return (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["vocab_size"],
            c["intermediate_size"])


# name -> (d_model, n_layers, n_heads, vocab, d_ff), e.g. pythia-1.4b: (2048, 24, 16, 50304, 8192).
PYTHIA_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    name: _preset_shape(name) for name in ("pythia-70m", "pythia-410m", "pythia-1.4b", "pythia-6.9b", "pythia-12b",
                                           "gpt-neox-20b")
}


def sentence_lengths(
    n_tokens_target: int,
    mean: float = MEAN_SENTENCE_TOKENS,
    sigma: float = SIGMA,
    seed: int = 0,
    max_len: int = 2048,
) -> np.ndarray:
    """Log-normal sentence lengths (int64) whose total first reaches ``n_tokens_target``.

    mu = ln(mean) - sigma²/2 makes E[length] = mean; rounding to the nearest integer and
    clipping to [1, max_len] move it by well under 0.1% at sigma <= 1.
    """
    if n_tokens_target <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - 0.5 * sigma**2
    out: list[np.ndarray] = []
    total = 0
    while total < n_tokens_target:
        n = int(1.05 * (n_tokens_target - total) / mean) + 64
        lens = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_len).astype(np.int64)
        out.append(lens)
        total += int(lens.sum())
    lens = np.concatenate(out)
    stop = int(np.searchsorted(np.cumsum(lens), n_tokens_target)) + 1
    return lens[:stop]


def random_sentences(
    lengths: np.ndarray, vocab_size: int, seed: int = 0, zipf_s: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Zipf token ids for sentences of the given lengths: (tokens int32 [N], offsets int64 [n+1]).

    P(rank r) ∝ r^-zipf_s over the whole vocabulary, ranks mapped to ids by a random
    permutation (frequent tokens are not the low ids). At s = 1 and V = 50304 the most
    frequent id is ≈ 8.8% of tokens, like "the"/","/"." in English.
    """
    lengths = np.asarray(lengths, np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(seed)
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -zipf_s
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(int(offsets[-1])), side="right")
    ranks = np.minimum(ranks, vocab_size - 1)  # guard against cdf[-1] rounding below 1
    rank_to_id = rng.permutation(vocab_size).astype(np.int32)
    return rank_to_id[ranks], offsets


def non_embedding_params(shape: tuple[int, int, int, int, int]) -> int:
    """Parameters outside embed_in / embed_out, biases and LayerNorms included.

    Same count as isojax.model.config.ModelConfig.non_embedding_params, for bare shape tuples
    (tests/test_peer.py checks that they agree)."""
    d, n_layers, _, _, ff = shape
    attn = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * ff + ff) + (ff * d + d)
    norms = 2 * 2 * d
    return n_layers * (attn + mlp + norms) + 2 * d  # + final LayerNorm


def flops_per_token(shape: tuple[int, int, int, int, int], gram: bool = True) -> float:
    """Forward FLOPs per token ≈ 2 × non-embedding params (+ 2d² per state for Σxxᵀ).

    Attention-score FLOPs (4·L·d·context) are left out: at ~33-token sentences they are
    < 1% of the total. The L+2 states are embed, block_1..block_L and final_ln.
    """
    d, n_layers = shape[0], shape[1]
    flops = 2.0 * non_embedding_params(shape)
    if gram:
        flops += 2.0 * d * d * (n_layers + 2)
    return flops


def timed(f, *args, reps: int = 20) -> float:
    """Median milliseconds of f(*args) over reps calls, after one call that compiles."""
    import statistics
    import time

    import jax
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def pack_in_memory(tokens, offsets, rows, row_len):
    """Packed [B, T] batches of the workload through isojax's own packer (before timing)."""
    from isojax.data.packing import pack_batches
    from isojax.data.tokens import TokenCache
    cache = TokenCache(tokens=tokens, offsets=offsets, source_ids=np.zeros(len(offsets) - 1, np.int16),
                       source_names=["synthetic"], fingerprint="bench", max_len=row_len, path=Path("."),
                       from_cache=False, meta={})
    batches = list(pack_batches(cache, rows=rows, row_len=row_len, prefetch=0))
    return [(b.tokens_BxT, b.segment_ids_BxT, b.positions_BxT, b.n_tokens) for b in batches]
