"""IsoScore* (Rudman & Eickhoff 2024) as I-STAR's analysis calls it, from the floored spectra."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric
from isojax.stats.measures.isoscore import isoscore, isoscore_of

# Rudman & Eickhoff (ICLR 2024), I-STAR/analysis.py: IsoScore* of a layer's points with
# zeta = 0.75 and C0 = np.cov of a large sample of the same layer's states (training, ~250k points).
ZETA = 0.75


def isoscore_star(eig_D, n: int, zeta: float = ZETA) -> float | None:
    """The package's IsoScore_star(points, C0, zeta) with C0 the covariance (np.cov, ddof=1) of a large
    sample of the same space: here the exact covariance of all n states of the layer from its streamed second
    moments, eigenvalues eig_D (ddof=0). Points and C0 are then the same states, so (1 - zeta) C +
    zeta C0 = C: the score equals IsoScore whatever zeta. A source's states against the layer's C0
    differ: stats.finalize shrinks each source's covariance toward the layer's (Spectra.shrunk), and the
    score is IsoScore of that."""
    if n < 2:
        return None
    cov_D = np.asarray(eig_D, np.float64) * (n / (n - 1))
    return isoscore_of(np.abs((1.0 - zeta) * cov_D + zeta * cov_D))


def readout(spectra) -> dict:
    if spectra.shrunk is not None and spectra.n >= 2:  # a source: IsoScore of the shrunk covariance (scale-free)
        return {"isoscore_star": isoscore(spectra.shrunk)}
    return {"isoscore_star": isoscore_star(spectra.centered, spectra.n, ZETA if spectra.zeta is None else spectra.zeta)}


MEASURE = Measure(
    metrics=(Metric("isoscore_star", "score", "IsoScore*"),),
    reads="spectra", readout=readout, paper="Rudman & Eickhoff 2024",
    readme_row=("| `isoscore_star` | as I-STAR's analysis (I-STAR/analysis.py) calls the package's "
               "`IsoScore_star(points, C0, zeta)`: the points' sample covariance C (ddof = 1) shrunk to (1−ζ)C + "
               'ζC0, C0 the covariance (ddof = 1) of a large sample of the same space, ζ = `--isoscore-zeta`, '
               "default 0.75 (the analysis' value; 0.2 is their training setting). isojax's C0 is the exact "
               "covariance of all the layer's states, from its streamed second moments: for the layer itself the "
               "points are C0's own states, so `isoscore_star` equals `isoscore`; for a source (per-source "
               "results) it is the source's covariance shrunk toward the layer's (one more Householder reduction "
               'per source and state). Before issue 45: C0 = I and ζ = 0.2 (scale-dependent; not kept) | Rudman & '
               'Eickhoff 2024 |'))
