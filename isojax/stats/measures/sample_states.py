"""The uniform sample of K tokens with every state of each (`--sample-states K`, samples.zarr), as a step
measure (base.Step): its setting, sums, per-batch plan, per-state update, merge and memory. The algorithms
(bottom-K of the tokens' keys, the plan, the chunked insert, the merges) are stats/sample.py's; the sample's
read-outs are the "sample" and "pairs" measures (stats.sample_readout, this package's registry).

Its setting is K (0: no sample), chosen by the planner (run/plan.py: --sample-states, --no-sample, or the
default sample on accelerators), not by a flag of its own: device/runner.py's Layout adds it to the step
measures on. One device's sums: the keys [K, 2] uint32 of its K sampled tokens (EMPTY in a free slot) and
their states [S, K, D] in the forward's dtype, as the forward made them (Rows.state_NxD: neither float32 nor
masked). Per batch and device (plan_batch): the tokens' keys (sample.token_keys of their sequence index and
position, EMPTY for the rows the statistics leave out) and the slots they enter (sample.plan); per state
(observe): those rows copied into their slots (sample.insert). Merge: bottom-K, on the host at the end
(device/runner.py Runner.sample, sample.merge_host: the merged sample stays on the devices for the batch
anisotropy's jitted read-out, so it is not among Runner.step_sums' host sums: `merged` is None), or of two
devices' sums on the devices (Sums.merge, sample.merge). Checkpointed with the accumulators.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from isojax.stats.measures.base import Measure, Step


class Sums(NamedTuple):
    """One device's sample."""
    keys_Kx2: Any  # uint32 keys (high word, low word) of the K sampled tokens; sample.EMPTY: a free slot
    states_SxKxD: Any  # their states, in the forward's dtype

    def merge(self, other: "Sums") -> "Sums":
        """The bottom K of both samples (stats/sample.py merge)."""
        from isojax.stats import sample
        return Sums(*sample.merge(self.keys_Kx2, self.states_SxKxD, other.keys_Kx2, other.states_SxKxD))


def init(k: int, num_groups: int, num_states: int, vocab_rows: int, width: int, dtype) -> Sums:
    import jax.numpy as jnp

    from isojax.stats import sample
    return Sums(jnp.full((k, 2), sample.EMPTY, jnp.uint32), jnp.zeros((num_states, k, width), dtype))


def plan_batch(sums: Sums, k: int, batch):
    """(sums with the slots' new keys, sample.Plan): which of the batch's rows enter which slots."""
    from isojax.stats import sample
    keys_Nx2 = sample.token_keys(batch.sequences_N, batch.positions_N, batch.valid_N)
    keys, plan = sample.plan(sums.keys_Kx2, keys_Nx2)
    return sums._replace(keys_Kx2=keys), plan


def observe(sums: Sums, k: int, s, group, rows, index, plan) -> Sums:
    """State s of the batch: its rows that enter the sample, as the forward made them, into their slots."""
    from isojax.stats import sample
    return sums._replace(states_SxKxD=sample.insert(sums.states_SxKxD, s, rows.state_NxD, plan))


def sample_bytes(num_states: int, width: int, k: int, dtype: str) -> int:
    """The sample's device bytes: keys K x 2 x 4 and states S x K x D in the forward's dtype."""
    return k * (8 + num_states * width * (2 if dtype == "bfloat16" else 4))


def step_bytes(cfg, dtype: str, tokens_per_device: int, k: int, model_axis: int = 1) -> int:
    return sample_bytes(cfg.num_states, cfg.hidden_size, k, dtype)


STEP = Step(keyword="sample_states", add_arguments=lambda ap, positive_int: None, setting=lambda args: None,
            init=init, merged=None, step_bytes=step_bytes, needs_sequences=lambda k: True, observe=observe,
            plan_batch=plan_batch)

MEASURE = Measure(
    metrics=(), reads="step", readout=None, paper="*The Shape of Learning*", step=STEP,
    readme_row="| `samples.zarr` | every state of K uniformly sampled tokens (**Sample** above: `--sample-states K`), in the "
               "forward's dtype; the sample and pairs measures read it | *The Shape of Learning* |")
