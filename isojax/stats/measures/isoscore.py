"""IsoScore (Rudman et al. 2022) of a layer's states, from their covariance's floored spectrum."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric


def isoscore_of(pcs_D: np.ndarray) -> float | None:
    """The IsoScore of a covariance's principal-component variances (IsoScore 2.0.1, steps 3-6),
    in float64 throughout (the package takes sqrt(D) in float32: ~1e-7 of difference)."""
    d = pcs_D.size
    norm = np.linalg.norm(pcs_D)
    if d < 2 or not norm > 0:
        return None
    pcs_norm = pcs_D * np.sqrt(d) / norm
    defect = np.linalg.norm(pcs_norm - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    return float(((d - defect ** 2 * (d - np.sqrt(d))) ** 2 - d) / (d * (d - 1)))


def isoscore(eig_D) -> float | None:
    """IsoScore from the (floored) eigenvalues of a point cloud's covariance: the package's
    IsoScore(points) takes torch.cov (ddof=1) and its singular values; the score is invariant to the
    covariance's scale, so the population covariance (ddof=0) gives the same."""
    return isoscore_of(np.abs(np.asarray(eig_D, np.float64)))


MEASURE = Measure(
    metrics=(Metric("isoscore", "score", "IsoScore"),),
    reads="spectra", readout=lambda spectra: {"isoscore": isoscore(spectra.centered)}, paper="Rudman et al. 2022",
    readme_row=("| `isoscore` | the IsoScore 2.0.1 package's `IsoScore(points)` of all states of the layer, from "
               "the eigenvalues of their covariance (the score does not depend on the covariance's scale) | Rudman"
               ' et al. 2022 |'))
