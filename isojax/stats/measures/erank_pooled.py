"""eRank (Wei et al. 2024, Diff-eRank's) of a layer's unit vectors, pooled over all its tokens."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric


def erank(eig_D) -> float | None:
    """Wei et al. (2024)'s effective rank: exp of the Shannon entropy of the eigenvalues (lambda,
    not sqrt) of a trace-normalized covariance (floored spectrum); None without variance."""
    lam = np.clip(np.asarray(eig_D, np.float64), 0.0, None)
    if not lam.sum() > 0:
        return None
    p = lam[lam > 0] / lam.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


MEASURE = Measure(
    metrics=(Metric("erank_pooled", "dimensions", "eRank of the unit vectors, pooled"),),
    reads="spectra", readout=lambda spectra: {"erank_pooled": None if spectra.unit is None else erank(spectra.unit)},
    paper="after Wei et al. 2024 (Diff-eRank)",
    readme_row=('| `erank_pooled` | exp of the entropy of the eigenvalues λ_k/Σλ (λ, not √λ) of the covariance of '
               "the unit vectors x/‖x‖ of all the layer's tokens (floored spectrum), exact from the streamed unit "
               "sums and Grams. Diff-eRank's eRank differs in two ways: the authors center each sentence's states "
               "on the sentence's mean, then normalize them (their `normalize`), and average the entropy over "
               "sentences; isojax normalizes the raw states, then centers on the mean of all the layer's unit "
               "vectors, pooled over all tokens. The paper's quantity is `erank` (the sentence probe). Per source:"
               " null (only the unit covariance's largest eigenvalue is read out per source) | after Wei et al. "
               '2024 (Diff-eRank) |'))
