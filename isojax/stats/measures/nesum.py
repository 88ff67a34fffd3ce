"""NESum: the sum of the centered covariance's eigenvalues over the largest."""

from isojax.stats.measures.base import Measure, Metric


def readout(spectra) -> dict:
    lam = spectra.centered
    return {"nesum": float(lam.sum() / lam[0]) if lam.size and lam[0] > 0 else None}


MEASURE = Measure(
    metrics=(Metric("nesum", "dimensions", "NESum Σλᵢ/λ₁"),),
    reads="spectra", readout=readout, paper="He & Ozay 2022",
    readme_row="| `nesum` | Σᵢ λᵢ/λ₁ of the centered covariance's floored spectrum (NESum): from 1 to D; per layer "
               "and per source; null without variance | He & Ozay 2022 |")
