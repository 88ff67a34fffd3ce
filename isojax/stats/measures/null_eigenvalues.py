"""The centered covariance's eigenvalues under the spectral floor (stats.geometry.spectral_floor)."""

from isojax.stats.measures.base import Measure, Metric


def readout(spectra) -> dict:
    nulls = int((spectra.centered == 0).sum()) if spectra.centered[0] > 0 else None
    return {"null_eigenvalues": nulls, "rank_deficient": None if nulls is None else nulls > 0}


MEASURE = Measure(
    metrics=(Metric("null_eigenvalues", "eigenvalues", "eigenvalues under the spectral floor", drawn=False),
             Metric("rank_deficient", "yes/no", "rank deficient", drawn=False)),
    reads="spectra", readout=readout, paper="",
    readme_row=("| `null_eigenvalues`, `rank_deficient` | the centered covariance's eigenvalues under the spectral "
               'floor, and whether there is one (above) | |'))
