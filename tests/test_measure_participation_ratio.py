"""participation_ratio ((Sum lambda)^2 / Sum lambda^2 of the centered covariance) against numpy's
eigenvalues of Hugging Face float64 states (tests/measure_cases.py)."""

from measure_cases import check_spectral, floored_spectrum


def reference(x, bf16: bool) -> float:
    lam = floored_spectrum(x, bf16)
    return lam.sum() ** 2 / (lam ** 2).sum()


def test_participation_ratio_equals_its_formula_on_hugging_face_states():
    check_spectral("participation_ratio", reference)
