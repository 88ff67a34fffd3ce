"""effective_rank (Roy & Vetterli 2007: exp of the entropy of sqrt(lambda_k) / Sum sqrt(lambda)) of the centered
states' floored spectrum against numpy on Hugging Face float64 states (tests/measure_cases.py)."""

import numpy as np
from measure_cases import check_metrics, floored_spectrum
from test_author_measures import entropy_exp


def reference(x, bf16: bool) -> dict:
    return {"effective_rank": entropy_exp(np.sqrt(floored_spectrum(x, bf16)))}


def test_effective_rank_equals_the_papers_formula_on_hugging_face_states():
    check_metrics(reference)
