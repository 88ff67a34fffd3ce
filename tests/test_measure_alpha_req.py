"""alpha_req (Agrawal et al. 2022, fitted as reptrix fits it): least squares of log lambda_k on log k weighted by
1/k over ranks 11 to 100 of the floored centered spectrum (numpy's polyfit with w = k^-1/2), on Hugging Face
float64 states (tests/measure_cases.py); to 1e-3 (its tail eigenvalues carry the Gram's float32 rounding)."""

import numpy as np
from measure_cases import check_metrics, floored_spectrum


def reference(x, bf16: bool) -> dict:
    lam = floored_spectrum(x, bf16)
    k = np.arange(11, min(100, int((lam > 0).sum())) + 1)
    return {"alpha_req": -np.polyfit(np.log(k), np.log(lam[k - 1]), 1, w=k ** -0.5)[0] if k.size >= 2 else None}


TOLERANCE = 1e-3  # absolute


def test_alpha_req_equals_the_papers_fit_on_hugging_face_states():
    check_metrics(reference, absolute=TOLERANCE)
