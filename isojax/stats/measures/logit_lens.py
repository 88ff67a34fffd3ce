"""Logit lens per layer (nostalgebraist 2020): every state through the final norm and the
unembedding, against the model's own next-token distribution. The first measure of the step side
of issue 46: its flags, accumulators, per-batch update, merge, float64 read-out, metrics and
memory are all here (STEP, base.Step); the step (device/runner.py), the planner (device/memory.py),
the run (run/measure.py) and the CLI (extract.py) call it as they call every step measure.

Definitions, per state s (embed, block_1 .. block_L, final_ln), over the measured tokens t:
  p_s(t) = softmax(unembed(final_norm(x_s(t)))) (+ the unembedding's bias where the family has one;
  tied families unembed with the embedding), p_final(t) the model's own output distribution: the
  final_ln state unembedded (no second norm; so p_final_ln = p_final).
  logit_lens_kl = mean KL(p_final || p_s), logit_lens_entropy = mean H(p_s) (nats),
  logit_lens_top1_agreement = fraction with argmax p_s = argmax p_final,
  logit_lens_xent = mean -log p_s[next token], over the measured tokens whose next token is in the
  same segment (the same sequence window).
Measured tokens: with --logit-lens every token the statistics count; with --logit-lens-every K the
tokens with (sequence index + position) % K == 0: every K-th token of each sequence window, its
offset shifting with the sequence, so the same tokens on any device count, batch or packing, and
an unbiased estimate of the means over positions.

The step: the states of the device's rows are kept in a buffer [S, B, T, D] (the forward's dtype)
while the layer scan observes them; after the forward, per device (shard_map), the measured tokens
are taken C at a time (a while loop over their number: K cuts the products, not the buffer), their
logits [C, V] computed in float32 (the product in the forward's dtype with float32 accumulation,
float32's at HIGHEST), log-softmax in float32 (max subtracted), and each chunk's float32 sums added
into double-float sums per group (G) and state (S) with TwoSum; counts are int32 limbs. Merge
across devices, processes and checkpoints: the per-device sums are kept per device (a leading
device axis, like the layer part), checkpointed with the accumulators and added on the host in
float64 at the read-out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from isojax.stats.measures.base import Measure, Metric, Step

# jax is imported inside the step's functions: the registry (read by isojax.load, the report)
# stays free of it. accumulators._COUNT_BITS: the counts' int32 limbs.
COUNT_BITS = 30

# one [C, V] float32 block of logits; the update holds about five of them. On an H200 at pythia-1.4b 512 MB
# (C = 2048 tokens) took the loop of every token from 5.8x to 3.8x the loop without (32 MB: bench/RESULTS.md 16)
LOGITS_BYTES = 512 << 20
COUNTS = ("tokens", "next")  # measured tokens, and those of them with a next token in their segment


# ---- flags ---------------------------------------------------------------------------------------

def add_arguments(ap, positive_int) -> None:
    ap.add_argument("--logit-lens", action="store_true",
                    help="the logit lens per layer on every token: KL to the model's output distribution, "
                         "entropy, top-1 agreement and next-token cross-entropy of each state through the final "
                         "norm and unembedding (off by default: a D x V product per state and token)")
    ap.add_argument("--logit-lens-every", type=positive_int, default=0, metavar="K",
                    help="the logit lens on every K-th token of each sequence ((sequence + position) %% K == 0)")


def every(args) -> int | None:
    """The run's K: 1 (--logit-lens), --logit-lens-every's, or None (neither: off)."""
    return int(args.logit_lens_every or (1 if args.logit_lens else 0)) or None


# ---- accumulators --------------------------------------------------------------------------------

class Sums(NamedTuple):
    """One device's sums (a pytree of arrays; the step's global ones lead with a device axis).
    Double-float sums (hi, lo: float32, the value hi + lo, accumulators.DF's arithmetic); counts in
    int32 limbs (n = hi * 2**30 + lo)."""
    kl_hi_GxS: Any  # Sum KL(p_final || p_s)
    kl_lo_GxS: Any
    entropy_hi_GxS: Any  # Sum H(p_s)
    entropy_lo_GxS: Any
    xent_hi_GxS: Any  # Sum -log p_s[next token] (tokens with a next token)
    xent_lo_GxS: Any
    top1_lo_GxS: Any  # tokens with argmax p_s = argmax p_final
    top1_hi_GxS: Any
    count_lo_Gx2: Any  # COUNTS
    count_hi_Gx2: Any


def init(every_k: int, num_groups: int, num_states: int, vocab_rows: int = 0, width: int = 0, dtype=None) -> Sums:
    import jax.numpy as jnp
    g, s = num_groups, num_states
    return Sums(*(jnp.zeros((g, s), jnp.float32) for _ in range(6)), *(jnp.zeros((g, s), jnp.int32) for _ in range(2)),
                *(jnp.zeros((g, 2), jnp.int32) for _ in range(2)))


def chunk_tokens(vocab_size: int, tokens: int) -> int:
    """C: measured tokens per block of logits (a power of two, at least 8, at most the batch's)."""
    c = 1 << max(3, (LOGITS_BYTES // (4 * vocab_size)).bit_length() - 1)
    return max(1, min(c, 1 << max(0, tokens - 1).bit_length()))


def step_bytes(cfg, dtype: str, tokens_per_device: int, every_k: int, model_axis: int = 1) -> int:
    """Device bytes the step adds with the logit lens on: the buffer of every state of the device's
    tokens, about five [C, V] float32 blocks, and the sums (4 bytes x 10 per group and state: counted
    with one group per state, a few KB); with parameters split over "model", its unembedding gathered."""
    if not every_k:
        return 0
    width = 2 if dtype == "bfloat16" else 4
    c = chunk_tokens(cfg.vocab_size, tokens_per_device)
    return (cfg.num_states * tokens_per_device * cfg.hidden_size * width + 5 * c * cfg.vocab_size * 4
            + c * cfg.num_states * cfg.hidden_size * 4 + 40 * cfg.num_states
            + (cfg.hidden_size * cfg.vocab_size * width if model_axis > 1 else 0))


# ---- the per-batch update (inside the jitted step) ------------------------------------------------

def head(module, params):
    """(norm, unembed) of the model's params: norm(x [C, D]) the final norm in the forward's dtype,
    unembed(h [C, D]) -> float32 logits [C, V] (+ bias)."""
    import jax.numpy as jnp
    from jax import lax

    from isojax.model.layers import make_norm
    cfg, dtype = module.cfg, module.dtype
    norm = make_norm(cfg, dtype, module.param_dtype, "final_layer_norm")
    norm_params = params["final_layer_norm"]
    w_DxV = params["embed_in"].T if cfg.tie_word_embeddings else params["embed_out"]
    bias_V = params["embed_out_bias"] if cfg.unembed_bias else None
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

    def unembed(h_CxD, w_DxV, bias_V):
        logits = jnp.dot(h_CxD.astype(dtype), w_DxV.astype(dtype), precision=precision,
                         preferred_element_type=jnp.float32)
        return logits if bias_V is None else logits + bias_V.astype(jnp.float32)

    return (lambda p, x: norm.apply({"params": p}, x)), unembed, (norm_params, w_DxV, bias_V)


def update(sums: Sums, states_SxBxTxD, tokens_BxT, seg_BxT, kept_BxT, pos_BxT, seq_BxT, group, weights, *,
           norm, unembed, every_k: int) -> Sums:
    """One device's batch: the measured tokens among its rows (kept_BxT: the statistics' segments,
    seg_BxT: the forward's), C at a time."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from isojax.stats.accumulators import _COUNT_BITS, _add_count, _df_add
    assert _COUNT_BITS == COUNT_BITS
    s_count, b, t, d = states_SxBxTxD.shape
    n = b * t
    x_SxNxD = states_SxBxTxD.reshape(s_count, n, d)
    kept_N = kept_BxT.reshape(-1) != 0
    if every_k > 1:
        kept_N &= (seq_BxT.reshape(-1) + pos_BxT.reshape(-1)) % every_k == 0
    has_next_BxT = jnp.pad((seg_BxT[:, 1:] == seg_BxT[:, :-1]) & (seg_BxT[:, 1:] != 0), ((0, 0), (0, 1)))
    next_N = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1))).reshape(-1)
    has_next_N = has_next_BxT.reshape(-1) & kept_N
    c = chunk_tokens(weights[1].shape[1], n)
    chunks = -(-n // c)
    idx = jnp.pad(jnp.nonzero(kept_N, size=n, fill_value=n)[0], (0, chunks * c - n), constant_values=n)
    measured = jnp.sum(kept_N, dtype=jnp.int32)
    norm_params, w_DxV, bias_V = weights
    last = s_count - 1

    def chunk(carry):
        i, sums = carry
        ids_C = lax.dynamic_slice_in_dim(idx, i * c, c)
        ok_C = ids_C < n
        x_SxCxD = x_SxNxD.at[:, ids_C].get(mode="fill", fill_value=0)
        next_C = next_N.at[ids_C].get(mode="fill", fill_value=0)
        nxt_C = has_next_N.at[ids_C].get(mode="fill", fill_value=False)
        final_CxV = jax.nn.log_softmax(unembed(x_SxCxD[last], w_DxV, bias_V), axis=-1)
        p_final_CxV = jnp.exp(final_CxV)
        top_final_C = jnp.argmax(final_CxV, axis=-1)

        def state(s, sums):
            x_CxD = lax.dynamic_index_in_dim(x_SxCxD, s, 0, keepdims=False)
            h_CxD = jnp.where(s == last, x_CxD, norm(norm_params, x_CxD).astype(x_CxD.dtype))
            lp_CxV = jax.nn.log_softmax(unembed(h_CxD, w_DxV, bias_V), axis=-1)
            kl_C = jnp.maximum(jnp.sum(p_final_CxV * (final_CxV - lp_CxV), axis=-1), 0.0)  # >= 0 but for rounding
            ent_C = -jnp.sum(jnp.exp(lp_CxV) * lp_CxV, axis=-1)
            xent_C = -jnp.take_along_axis(lp_CxV, next_C[:, None], axis=-1)[:, 0]
            top1 = jnp.sum(ok_C & (jnp.argmax(lp_CxV, axis=-1) == top_final_C), dtype=jnp.int32)
            out = {}
            for name, v in (("kl", jnp.where(ok_C, kl_C, 0.0)), ("entropy", jnp.where(ok_C, ent_C, 0.0)),
                            ("xent", jnp.where(nxt_C, xent_C, 0.0))):
                hi, lo = getattr(sums, f"{name}_hi_GxS"), getattr(sums, f"{name}_lo_GxS")
                new_hi, new_lo = _df_add(hi[group, s], lo[group, s], jnp.sum(v))
                out.update({f"{name}_hi_GxS": hi.at[group, s].set(new_hi), f"{name}_lo_GxS": lo.at[group, s].set(new_lo)})
            lo, hi = _add_count(sums.top1_lo_GxS[group, s], sums.top1_hi_GxS[group, s], top1)
            return sums._replace(**out, top1_lo_GxS=sums.top1_lo_GxS.at[group, s].set(lo),
                                 top1_hi_GxS=sums.top1_hi_GxS.at[group, s].set(hi))

        return i + 1, lax.fori_loop(0, s_count, state, sums)

    _, sums = lax.while_loop(lambda carry: carry[0] * c < measured, chunk, (jnp.int32(0), sums))
    lo, hi = _add_count(sums.count_lo_Gx2[group], sums.count_hi_Gx2[group],
                        jnp.stack([measured, jnp.sum(has_next_N, dtype=jnp.int32)]))
    return sums._replace(count_lo_Gx2=sums.count_lo_Gx2.at[group].set(lo),
                        count_hi_Gx2=sums.count_hi_Gx2.at[group].set(hi))


def after_forward(module, params, every_k: int):
    """(update of one device's sums after the forward, the weights it reads): base.Step.after_forward."""
    norm, unembed, weights = head(module, params)

    def step_update(sums, states_SxBxTxD, tokens_BxT, seg_BxT, kept_BxT, pos_BxT, seq_BxT, group, weights):
        return update(sums, states_SxBxTxD, tokens_BxT, seg_BxT, kept_BxT, pos_BxT, seq_BxT, group, weights,
                      norm=norm, unembed=unembed, every_k=every_k)

    return step_update, weights


# ---- merge and float64 read-out (host) ------------------------------------------------------------

def merged(per_device: Sums, num_devices: int = 1, vocab_size: int = 0) -> dict:
    """The per-device sums (numpy, a leading device axis) added in float64 over the devices:
    {"kl", "entropy", "xent", "top1": [G, S], "tokens", "next": [G]}."""
    df = lambda name: sum(np.asarray(getattr(per_device, f"{name}_{part}_GxS"), np.float64) for part in ("hi", "lo")).sum(0)
    limbs = lambda lo, hi: ((np.asarray(hi, np.int64) << COUNT_BITS) + np.asarray(lo, np.int64)).sum(0)
    counts = limbs(per_device.count_lo_Gx2, per_device.count_hi_Gx2)
    return dict(kl=df("kl"), entropy=df("entropy"), xent=df("xent"),
                top1=limbs(per_device.top1_lo_GxS, per_device.top1_hi_GxS).astype(np.float64),
                tokens=counts[:, 0], next=counts[:, 1])


def readout(sums: dict, groups=None) -> list[dict]:
    """Per state, the four metrics of the groups `groups` (None: all) of merged(...)'s sums; null
    where no token was measured (xent: no measured token had a next token)."""
    pick = (lambda x: x.sum(0)) if groups is None else (lambda x: x[list(groups)].sum(0))
    n, n_next = int(pick(sums["tokens"])), int(pick(sums["next"]))
    mean = lambda key, count: [float(v) / count if count else None for v in pick(sums[key])]
    rows = zip(mean("kl", n), mean("entropy", n), mean("top1", n), mean("xent", n_next))
    return [dict(zip(NAMES, r)) for r in rows]


def info(sums: dict, every_k: int, counted_tokens: int) -> dict:
    """metrics.json's "logit_lens": K, the tokens measured, and their fraction of the tokens counted."""
    n = int(sums["tokens"].sum())
    return {"every": every_k, "tokens": n, "tokens_with_next": int(sums["next"].sum()),
            "fraction": n / counted_tokens if counted_tokens else None}


STEP = Step(keyword="logit_lens_every", add_arguments=add_arguments, setting=every, init=init, merged=merged,
            step_bytes=step_bytes, needs_sequences=lambda every_k: every_k > 1, after_forward=after_forward,
            layers=readout, info=info)

MEASURE = Measure(
    metrics=(Metric("logit_lens_kl", "nats", "logit lens KL(p_final ‖ p_layer)"),
             Metric("logit_lens_entropy", "nats", "logit lens entropy of p_layer"),
             Metric("logit_lens_top1_agreement", "fraction of tokens", "logit lens top-1 agreement with the output"),
             Metric("logit_lens_xent", "nats", "logit lens next-token cross-entropy")),
    reads="step", readout=readout, paper="nostalgebraist 2020 (interpreting GPT: the logit lens)",
    on_by_default=False, step=STEP,
    readme_row="| `logit_lens_kl`, `logit_lens_entropy`, `logit_lens_top1_agreement`, `logit_lens_xent` | with "
               "`--logit-lens` (every token) or `--logit-lens-every K` (tokens with (sequence + position) mod K = 0): "
               "each state through the final norm and the unembedding (its bias where the family has one; tied "
               "families the embedding), p_s = softmax of those logits, p_final the model's output distribution (the "
               "`final_ln` state unembedded); the means over the measured tokens of KL(p_final ‖ p_s) and of the "
               "entropy of p_s (nats), the fraction whose argmax of p_s is p_final's, and −log p_s[next token] over "
               "those whose next token is in their sequence window; logits in float32, sums in double-float; "
               "metrics.json's `logit_lens` records K, the tokens measured and their fraction; of the tokens the "
               "statistics count (`--skip-positions` applies); per layer and per source; null where off. "
               "On one H200 at pythia-1.4b the loop takes 3.8x its time without on every token, 1.4x with K = 8 | nostalgebraist 2020 (interpreting GPT: the logit lens) |")
NAMES = tuple(m.name for m in MEASURE.metrics)
