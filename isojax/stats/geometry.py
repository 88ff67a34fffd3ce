"""Geometry of sampled states across layers and checkpoints."""

from __future__ import annotations

import numpy as np


def linear_cka(x_KxD, y_KxD) -> float:
    """Linear CKA (Kornblith et al. 2019) of two representations of the same K tokens, in float64
    on centered columns: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F). NaN where either is constant."""
    x = np.asarray(x_KxD, np.float64)
    y = np.asarray(y_KxD, np.float64)
    x = x - x.mean(axis=0)
    y = y - y.mean(axis=0)
    den = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(np.linalg.norm(y.T @ x) ** 2 / den) if den > 0 else float("nan")
