"""rankme (Garrido et al. 2023, eq. 1: exp of the entropy of p_k = sigma_k / ||sigma||_1 + eps, eps = 1e-7,
over the min(N, D) singular values of the N x D embedding matrix, not centered) against numpy's SVD of
Hugging Face float64 states (tests/measure_cases.py); null per source."""

import numpy as np
from measure_cases import FAMILIES, check_spectral, finalized
from test_author_measures import floor_of


def reference(x, bf16):
    sigma = np.linalg.svd(x, compute_uv=False)  # min(N, D) of them, descending
    lam = sigma ** 2 / len(x)  # the second moment's eigenvalues, floored as the README says
    sigma = np.where(lam > floor_of(lam, x, bf16), sigma, 0.0)
    p = sigma / sigma.sum() + 1e-7
    return float(np.exp(-(p * np.log(p)).sum()))


def test_rankme_equals_the_papers_formula_on_hugging_face_states():
    check_spectral("rankme", reference, sources=False)
    for family in FAMILIES:
        x, layers, groups = finalized(family, False)
        assert all(layer["rankme"] is None for g in groups.values() for layer in g["layers"])  # no spectrum there
        # not effective_rank: RankMe of the states as they are, not centered
        assert all(abs(layer["rankme"] - layer["effective_rank"]) > 1e-3 for layer in layers), family
