"""feature_kurtosis (He et al. 2024: with s_i^2 the mean over tokens of x_i^2, mean(s^4) / mean(s^2)^2) against
numpy on Hugging Face float64 states (tests/measure_cases.py), per layer and per source."""

import numpy as np
from measure_cases import check_metrics


def reference(x, bf16: bool) -> dict:
    s2 = (np.asarray(x, np.float64) ** 2).mean(0)
    return {"feature_kurtosis": float((s2 ** 2).mean() / s2.mean() ** 2)}


def test_feature_kurtosis_equals_the_papers_formula_on_hugging_face_states():
    check_metrics(reference)
