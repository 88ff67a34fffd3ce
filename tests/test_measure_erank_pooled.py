"""erank_pooled (after Wei et al. 2024: exp of the entropy of the trace-normalized eigenvalues of the covariance
of the unit vectors x/|x| of all the layer's tokens, floored) against numpy on Hugging Face float64 states
(tests/measure_cases.py); null per source."""

import numpy as np
from measure_cases import FAMILIES, check_metrics, finalized, floored_spectrum
from test_author_measures import entropy_exp


def reference(x, bf16: bool) -> dict:
    x = np.asarray(x, np.float64)
    return {"erank_pooled": entropy_exp(floored_spectrum(x / np.linalg.norm(x, axis=1, keepdims=True), bf16))}


def test_erank_pooled_equals_the_formula_on_hugging_face_states_and_is_null_per_source():
    check_metrics(reference, sources=False)
    for family in FAMILIES:
        _, _, groups = finalized(family, False)
        assert all(layer["erank_pooled"] is None for g in groups.values() for layer in g["layers"])
