"""rogue_dims and rogue_share_top3 (Timkey & van Schijndel 2021: InterSim = Sum_i c_i, c_i = (S_i^2 - Sum_t
u_ti^2) / (n^2 - n), the top 3 dimensions by c_i and their share) against brute-force numpy on Hugging Face
float64 states (tests/measure_cases.py), per layer and per source."""

import numpy as np
from measure_cases import FAMILIES, check_metrics, finalized


def contributions(x) -> np.ndarray:
    """c_i of every dimension: the products u_ti u_si summed over distinct pairs t != s."""
    u = np.asarray(x, np.float64)
    u = u / np.linalg.norm(u, axis=1, keepdims=True)
    n = len(u)
    return np.einsum("ti,si->i", u, u) / (n * n - n) - np.einsum("ti,ti->i", u, u) / (n * n - n)


def reference(x, bf16: bool) -> dict:
    c = contributions(x)
    return {"rogue_share_top3": float(np.sort(c)[::-1][:3].sum() / c.sum())}


def test_rogue_dimensions_equal_brute_force_on_hugging_face_states():
    check_metrics(reference)
    for family in FAMILIES:
        x, layers, _ = finalized(family, False)
        for i, layer in enumerate(layers):
            c = contributions(x[i])
            assert [r["dim"] for r in layer["rogue_dims"]] == list(np.argsort(-c)[:3]), (family, i)
            for r in layer["rogue_dims"]:
                assert abs(r["share"] - c[r["dim"]] / c.sum()) < 1e-6 * max(1.0, abs(r["share"])), (family, i, r)
