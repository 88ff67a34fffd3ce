"""null_eigenvalues and rank_deficient: the centered covariance's eigenvalues under the README's floor, counted
by numpy on Hugging Face float64 states (tests/measure_cases.py): 40 token ids leave the GPT-NeoX embedding rank
39, and a LayerNorm's output (final_ln) misses one dimension."""

from measure_cases import FAMILIES, check_metrics, finalized, floored_spectrum


def reference(x, bf16: bool) -> dict:
    nulls = int((floored_spectrum(x, bf16) == 0).sum())
    return {"null_eigenvalues": nulls, "rank_deficient": nulls > 0}


def test_null_eigenvalues_count_the_floored_spectrum_of_hugging_face_states():
    check_metrics(reference)
    for family in FAMILIES:
        x, layers, _ = finalized(family, False)
        assert layers[-1]["rank_deficient"] and layers[-1]["null_eigenvalues"] >= 1, family  # final_ln
        if family == "gpt_neox":
            assert layers[0]["null_eigenvalues"] == x.shape[2] - 39
