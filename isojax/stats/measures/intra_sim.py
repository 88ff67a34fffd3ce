"""IntraSim per token (Ethayarajh 2019's self-similarity, as Machina & Mercer 2024 average it): the mean cosine
between the states of one token id, per state, from the per-token sums of unit vectors, as a step measure
(base.Step): its sums, per-batch plan, per-state update, merge, placement, read-out declaration and bytes. The
algorithms (the chunked TwoSum add, the exchange with the vocabulary split over the devices, the float64 read-out
on the devices) are stats/token_sums.py's; the double-float arithmetic, the token index and the segment sums are
stats/accumulators.py's.

On exactly with token statistics (Step.with_token_stats: device/runner.py's Layout adds it, setting 1; off with
--no-token-stats), not by a flag of its own. Its sums: per state and token row, the count (int32) and the
double-float sum of x/|x| [S, V', D], split over the padded vocabulary V' on every device (placement "vocab":
device k holds token ids k, k + n, ...; device/runner.py), each row on one device, so they are never merged but
in stats-level merges of two runs' sums (Sums.merge). Per batch and device (plan_batch): with the vocabulary split,
the exchange's plan (token_sums.plan_exchange, from the batch's token index); per state (observe, after the other
step measures): the state's unit vectors summed per token id and added to the owners' rows (token_sums.update).
Read out in float64 on the devices (Runner.token_readout: `intra_sim` of tokens.zarr) or on the host (host_readout
below), and into each layer's metrics by stats.finalize (layer_metrics below); `--save-token-sums` writes the sums
themselves (Runner.token_sums).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step


class Sums(NamedTuple):
    """The per-token sums, [S, V', ...] (every device's rows: placement "vocab")."""
    count_SxV: Any  # int32 occurrences of each token row
    sum_SxVxD: Any  # stats.accumulators.DF: Sum x/|x| of each token row, hi + lo in float32

    def merge(self, other: "Sums") -> "Sums":
        """The sums of both populations (of the same token rows): counts added, sums by TwoSum."""
        from isojax.stats.accumulators import DF, _two_sum
        hi, err = _two_sum(self.sum_SxVxD.hi, other.sum_SxVxD.hi)
        return Sums(self.count_SxV + other.count_SxV, DF(hi, self.sum_SxVxD.lo + other.sum_SxVxD.lo + err))


def init(on: int, num_groups: int, num_states: int, vocab_rows: int, width: int, dtype=None) -> Sums:
    import jax.numpy as jnp

    from isojax.stats.accumulators import DF
    zeros = lambda: jnp.zeros((num_states, vocab_rows, width), jnp.float32)
    return Sums(jnp.zeros((num_states, vocab_rows), jnp.int32), DF(zeros(), zeros()))


def plan_batch(sums: Sums, on: int, batch, opts):
    """(sums, the batch's token_sums.Exchange with a leading axis of 1) with the vocabulary split over the devices
    (inside shard_map); (sums, None) on one device."""
    if opts.token_shards == 1:
        return sums, None
    import jax

    from isojax.stats import token_sums
    exchange = token_sums.plan_exchange(batch.index, sums.count_SxV.shape[1], opts)
    return sums, jax.tree.map(lambda x: x[None], exchange)


def observe(sums: Sums, on: int, s, group, rows, index, plan, opts) -> Sums:
    """State s of one device's batch: its unit vectors summed per token id into the rows' owners."""
    import jax

    from isojax.stats import token_sums
    exchange = jax.tree.map(lambda x: x[0], plan)
    count, tok = token_sums.update(sums.count_SxV, sums.sum_SxVxD, s, rows.unit_NxD, rows.token_ids_N, rows.valid_N,
                                   index, opts, exchange)
    return Sums(count, tok)


def sums_bytes(num_states: int, width: int, rows: int) -> int:
    """Device bytes of the sums of `rows` token rows (one device's V'/n): an int32 count and two float32 sums a
    row: (L+2) x V x (4 + 8 D) over the devices, 21.4 GB for pythia-1.4b (S = 26, V = 50304, D = 2048)."""
    return num_states * rows * (4 + 8 * width)


def step_bytes(cfg, dtype: str, tokens_per_device: int, on: int, model_axis: int = 1) -> int:
    """Its sums are counted with the accumulators (device/runner.py per_device_accumulator_bytes: sums_bytes), its
    temporaries with the step's activations (device/memory.py STEP_BYTES_PER_TOKEN_WIDTH, measured with them)."""
    return 0


STEP = Step(keyword="token_stats", add_arguments=lambda ap, positive_int: None, setting=lambda args: None,
            init=init, merged=None, step_bytes=step_bytes, needs_token_stats=True, observe=observe,
            plan_batch=plan_batch, placement="vocab", with_token_stats=True, takes_options=True)

def host_readout(acc) -> tuple[np.ndarray, np.ndarray] | None:
    """(count_V, intra_sim_SxV) in float64 from the per-token sums among the accumulators' step measures on the
    host, one state at a time (in float64 all at once the sums would double the host memory of the accumulators:
    21 GB more at pythia-1.4b); None without them. device/runner.py Runner.token_readout does the same on the
    devices."""
    from isojax.stats.measures.inter_sim import mean_cos
    tok = next((x for x in acc.step if isinstance(x, Sums)), None)
    if tok is None:
        return None
    count_SxV = np.asarray(tok.count_SxV, np.int64)
    intra = []
    for s in range(count_SxV.shape[0]):
        sum_VxD = np.asarray(tok.sum_SxVxD.hi[s], np.float64) + np.asarray(tok.sum_SxVxD.lo[s], np.float64)
        intra.append(mean_cos(np.einsum("vd,vd->v", sum_VxD, sum_VxD), count_SxV[s]))
    return count_SxV[0], np.stack(intra)


def _bands(count_V, intra_V) -> list[dict]:
    """IntraSim by frequency band of the count: [2, 4), [4, 8), ... (rare-token drift)."""
    bands, lo = [], 2
    top = int(count_V.max()) if count_V.size else 0
    while lo <= top:
        sel = (count_V >= lo) & (count_V < 2 * lo)
        k = int(sel.sum())
        bands.append({"lo": lo, "hi": 2 * lo, "tokens": k,
                      "intra_sim": float(intra_V[sel].mean()) if k else float("nan")})
        lo *= 2
    return bands


def layer_metrics(count_V, intra_V) -> dict:
    """One state's metrics from every token's count and IntraSim (clipped at 1), [V] each: over the tokens seen
    at least twice."""
    seen = count_V >= 2
    k = int(seen.sum())
    return {"intra_sim": float(intra_V[seen].mean()) if k else float("nan"),
            "intra_sim_weighted": float((intra_V[seen] * count_V[seen]).sum() / count_V[seen].sum()) if k
            else float("nan"),
            "intra_tokens": k, "intra_sim_by_band": _bands(count_V, intra_V)}


# drawn by the report's own figures (report/states.py: the paper's Figs. 2 and 4), not among the measures'
MEASURE = Measure(
    metrics=(Metric("intra_sim", "cosine", "IntraSim (mean over token types)", drawn=False),
             Metric("intra_sim_weighted", "cosine", "IntraSim (count-weighted mean)", drawn=False),
             Metric("intra_tokens", "token types", "token types seen twice or more", drawn=False),
             Metric("intra_sim_by_band", "cosine", "IntraSim by count band", listed=True)),
    reads="step", readout=None, paper="Machina & Mercer 2024 (after Ethayarajh 2019)", step=STEP,
    readme_row="| `intra_sim`, `intra_sim_weighted`, `intra_tokens`, `intra_sim_by_band` | IntraSim(l, t): the mean "
               "cosine over distinct pairs of the states of token id t, (‖Σ û‖² − c)/(c² − c) from the per-token sums "
               "of unit vectors (every t seen c ≥ 2 times; per token in `tokens.zarr/intra_sim`); their unweighted "
               "mean, count-weighted mean, number, and mean per count band [2, 4), [4, 8), … (below); with token "
               "statistics (`--no-token-stats`: off) | Machina & Mercer 2024 (after Ethayarajh 2019) |")
