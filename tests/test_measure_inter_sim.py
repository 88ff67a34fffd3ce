"""inter_sim (Machina & Mercer 2024, eq. 7: the mean cosine over distinct pairs of a layer's states), the count,
mean_norm and norm_of_mean against brute-force float64 numpy on Hugging Face states (tests/measure_cases.py),
per layer and per source."""

import numpy as np
from measure_cases import check_metrics


def reference(x, bf16: bool) -> dict:
    x = np.asarray(x, np.float64)
    n = len(x)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = u @ u.T
    return {"count": n, "inter_sim": float((cos.sum() - np.trace(cos)) / (n * n - n)),
            "mean_norm": float(np.linalg.norm(x, axis=1).mean()), "norm_of_mean": float(np.linalg.norm(x.mean(0)))}


def test_inter_sim_and_the_norms_equal_brute_force_on_hugging_face_states():
    check_metrics(reference)
