"""anisotropy (Razzhigaev et al. 2024, The Shape of Learning §2.3: sigma_1^2 / Sum sigma^2 of the centered matrix
of the states), anisotropy_uncentered (the states as they are), unit_anisotropy (their unit vectors, centered) and
mean_sq_norm against numpy's SVD of Hugging Face float64 states (tests/measure_cases.py), per layer and per source
(where the top share is Lanczos' on the devices)."""

import numpy as np
from measure_cases import check_metrics


def top_share(m) -> float:
    sigma = np.linalg.svd(m, compute_uv=False)
    return float(sigma[0] ** 2 / (sigma ** 2).sum())


def reference(x, bf16: bool) -> dict:
    x = np.asarray(x, np.float64)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    return {"anisotropy": top_share(x - x.mean(0)), "anisotropy_uncentered": top_share(x),
            "unit_anisotropy": top_share(u - u.mean(0)), "mean_sq_norm": float((x * x).sum(1).mean())}


def test_anisotropy_equals_the_papers_formula_on_hugging_face_states():
    check_metrics(reference)
