"""isoscore_star (Rudman & Eickhoff 2024) as I-STAR's analysis calls the package: IsoScore_star(points, C0, 0.75),
C0 = np.cov of the same states (the layer's own: tests/measure_cases.py's Hugging Face float64 states). A source's,
against the layer's C0: tests/test_spectral_measures.py."""

import numpy as np
from conftest import need
from measure_cases import check_metrics


def reference(x, bf16: bool) -> dict:
    torch, package = need("torch"), need("IsoScore.IsoScore")
    x = np.asarray(x, np.float64)
    return {"isoscore_star": float(package.IsoScore_star(x, torch.tensor(np.cov(x.T)), 0.75))}


def test_isoscore_star_equals_the_package_on_hugging_face_states():
    check_metrics(reference, sources=False)
