"""nesum (He & Ozay 2022: NESum = Sum_i lambda_i / lambda_1 of the covariance's eigenvalues) against
numpy's eigenvalues of Hugging Face float64 states (tests/measure_cases.py)."""

from measure_cases import check_spectral, floored_spectrum


def reference(x, bf16: bool) -> float:
    lam = floored_spectrum(x, bf16)
    return lam.sum() / lam[0]


def test_nesum_equals_the_papers_formula_on_hugging_face_states():
    check_spectral("nesum", reference)
