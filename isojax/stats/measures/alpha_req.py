"""alpha-ReQ (Agrawal et al. 2022): the decay of the centered covariance's floored spectrum."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric

# the fit range as reptrix.alpha.get_alpha fits it: fit_range np.arange(10, 100), 0-based: ranks 11 to 100
RANKS = (11, 100)


def alpha_req(eig_D) -> float | None:
    """As reptrix fits it (after Stringer et al. 2019): the decay alpha of lambda_k ~ k^-alpha, by least
    squares of log lambda_k against log k weighted by 1/k, over the ranks RANKS of the descending (floored)
    spectrum, cut at the last nonzero eigenvalue; None with fewer than two ranks there (D or rank under 12)."""
    eig = np.sort(np.asarray(eig_D, np.float64))[::-1]
    lo, hi = RANKS
    hi = min(hi, int((eig > 0).sum()))
    if hi - lo + 1 < 2:
        return None
    k = np.arange(lo, hi + 1, dtype=np.float64)
    x, y, w = np.log(k), np.log(eig[lo - 1:hi]), 1.0 / k
    x0, y0 = x - (w @ x) / w.sum(), y - (w @ y) / w.sum()
    return float(-(w * x0 @ y0) / (w * x0 @ x0))


MEASURE = Measure(
    metrics=(Metric("alpha_req", "decay exponent", "α-ReQ"),),
    reads="spectra", readout=lambda spectra: {"alpha_req": alpha_req(spectra.centered)}, paper="Agrawal et al. 2022",
    readme_row=('| `alpha_req` | α of λ_k ∝ k^−α fitted as `reptrix` fits it (after Stringer et al. 2019): least '
               "squares of log λ_k on log k weighted by 1/k over ranks 11 to 100 of the centered covariance's "
               "floored spectrum (reptrix's `fit_range` np.arange(10, 100), 0-based), cut at its last nonzero "
               'eigenvalue; null with fewer than two ranks there (D or rank under 12), with a log line. Before '
               "issue 45: an unweighted fit over every eigenvalue (a random GPT-NeoX's `final_ln`: 2.870 then, "
               '4.020 now, as in float64) | Agrawal et al. 2022 |'))
