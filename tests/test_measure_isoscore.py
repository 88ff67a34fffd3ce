"""isoscore (Rudman et al. 2022) against the IsoScore 2.0.1 package's IsoScore(points) on Hugging Face float64
states (tests/measure_cases.py), per layer and per source."""

import numpy as np
from conftest import need
from measure_cases import check_metrics


def reference(x, bf16: bool) -> dict:
    need("torch")
    package = need("IsoScore.IsoScore")
    return {"isoscore": float(package.IsoScore(np.asarray(x, np.float64)))}


def test_isoscore_equals_the_package_on_hugging_face_states():
    check_metrics(reference)
