"""Block influence (ShortGPT) on the sample: how much a block turns its input."""

from isojax.stats.measures.base import Measure, Metric


def readout(x_KxD, y_KxD) -> dict:
    """1 - the mean over the sampled tokens of cos(x_t, y_t), x the block's input (the previous
    state), y its output; tokens with a zero vector in either are left out (NaN if all are)."""
    xp = x_KxD.__array_namespace__()
    x, y = xp.astype(x_KxD, xp.float64), xp.astype(y_KxD, xp.float64)
    norms = xp.sqrt(xp.sum(x * x, axis=1)) * xp.sqrt(xp.sum(y * y, axis=1))
    ok = norms > 0
    cos = xp.where(ok, xp.sum(x * y, axis=1) / xp.where(ok, norms, 1.0), 0.0)
    kept = xp.sum(xp.astype(ok, xp.float64))
    return {"block_influence": xp.where(kept > 0, 1.0 - xp.sum(cos) / xp.where(kept > 0, kept, 1.0), xp.nan)}


MEASURE = Measure(
    metrics=(Metric("block_influence", "1 − cosine", "block influence 1 − cos(input, output)"),),
    reads="pairs", readout=readout, paper="Men et al. 2024 (ShortGPT)",
    readme_row="| `block_influence` | BIᵢ = 1 − meanₜ cos(xᵢ₋₁,ₜ, xᵢ,ₜ): one minus the mean cosine between each token's "
               "state before and after block i (for `final_ln`: before and after the final norm), over the K sampled "
               "tokens (`sample_tokens`; the same tokens at every state, so an unbiased estimate of the mean over all "
               "tokens); null for `embed` and without a sample | Men et al. 2024 (ShortGPT) |")
