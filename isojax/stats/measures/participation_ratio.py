"""Participation ratio of the centered covariance's spectrum."""

from isojax.stats.measures.base import Measure, Metric


def readout(spectra) -> dict:
    lam = spectra.centered
    sq = float((lam * lam).sum())
    return {"participation_ratio": float(lam.sum()) ** 2 / sq if sq > 0 else None}


MEASURE = Measure(
    metrics=(Metric("participation_ratio", "dimensions", "participation ratio (Σλ)²/Σλ²"),),
    reads="spectra", readout=readout, paper="Gao et al. 2017; Recanatesi et al. 2019",
    readme_row="| `participation_ratio` | (Σλ)²/Σλ² of the centered covariance's floored spectrum: from 1 "
               "(one direction) to D (isotropic); per layer and per source; null without variance "
               "| Gao et al. 2017; Recanatesi et al. 2019 |")
