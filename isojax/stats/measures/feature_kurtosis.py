"""Feature kurtosis (He et al. 2024): how unequal the dimensions' scales are."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric


def feature_kurtosis(n: int, sq_sum_D) -> float | None:
    """With s_i^2 = mean over tokens of x_ti^2 (sq_sum_D = sum_t x_ti^2), mean_i(s_i^4) / mean_i(s_i^2)^2 (1 when
    every dimension has the same scale)."""
    if n < 1:
        return None
    s2_D = np.asarray(sq_sum_D, np.float64) / n
    mean = s2_D.mean()
    return float((s2_D * s2_D).mean() / (mean * mean)) if mean > 0 else None


MEASURE = Measure(
    metrics=(Metric("feature_kurtosis", "ratio", "feature kurtosis"),),
    reads="spectra", paper="He et al. 2024",
    readout=lambda spectra: {"feature_kurtosis": feature_kurtosis(float(spectra.n),
                                                                  float(spectra.n) * spectra.second_moment_diag_D)},
    readme_row=('| `feature_kurtosis` | with sᵢ² = mean over tokens of xᵢ² (uncentered), meanᵢ(sᵢ⁴)/meanᵢ(sᵢ²)²: 1 '
               'when every dimension has the same scale | He et al. 2024 |'))
