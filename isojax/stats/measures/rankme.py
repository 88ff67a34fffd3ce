"""RankMe of the states as they are (not centered), as Garrido et al. define it."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric

EPSILON = 1e-7  # the paper's


def readout(spectra) -> dict:
    """exp(-Sum_k p_k log p_k), p_k = sigma_k / Sum sigma + EPSILON over the min(n, D) singular values
    sigma_k of the n x D matrix of states: sqrt(n lambda_k) of its second moment's floored
    eigenvalues (the factor sqrt(n) cancels)."""
    if spectra.uncentered is None or spectra.n < 1:
        return {"rankme": None}
    sigma = np.sqrt(np.clip(spectra.uncentered[:min(spectra.n, spectra.uncentered.size)], 0.0, None))
    if not sigma.sum() > 0:
        return {"rankme": None}
    p = sigma / sigma.sum() + EPSILON
    return {"rankme": float(np.exp(-(p * np.log(p)).sum()))}


MEASURE = Measure(
    metrics=(Metric("rankme", "dimensions", "RankMe (uncentered, ε = 1e-7)"),),
    reads="spectra", readout=readout, paper="Garrido et al. 2023 (RankMe)",
    readme_row="| `rankme` | RankMe as the paper defines it: exp(−Σₖ pₖ log pₖ), pₖ = σₖ/Σσ + ε with ε = 1e-7, over the "
               "min(n, D) singular values σₖ of the n×D matrix of the layer's states **as they are** (not centered: "
               "√(n·λₖ) of the second moment Σxxᵀ/n, floored spectrum). `effective_rank` is the same of the centered "
               "states with ε = 0. Per source: null (no second-moment spectrum is read out per source) "
               "| Garrido et al. 2023 (RankMe) |")
