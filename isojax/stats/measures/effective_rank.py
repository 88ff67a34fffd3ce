"""Effective rank (Roy & Vetterli 2007) of the centered states, from their floored spectrum."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric
from isojax.stats.measures.erank_pooled import erank


def effective_rank(eig_D) -> float | None:
    """exp of the Shannon entropy of p_k = s_k / Sum s_j, s_k = sqrt(lambda_k) the centered states' singular
    values (floored spectrum): Wei et al.'s eRank of the singular values; None without variance."""
    return erank(np.sqrt(np.clip(np.asarray(eig_D, np.float64), 0.0, None)))


MEASURE = Measure(
    metrics=(Metric("effective_rank", "dimensions", "effective rank"),),
    reads="spectra", readout=lambda spectra: {"effective_rank": effective_rank(spectra.centered)},
    paper="Roy & Vetterli 2007; Garrido et al. 2023 (RankMe)",
    readme_row=("| `effective_rank` | exp of the entropy of the centered states' normalized singular values "
               '√λ_k/Σ√λ (RankMe where equal: above), floored spectrum | Roy & Vetterli 2007; Garrido et al. 2023 '
               '(RankMe) |'))
