"""Anisotropy (Razzhigaev et al. 2024, *The Shape of Learning* §2.3): the largest eigenvalue's share of the
trace, of the centered covariance of all the layer's states (exact from the streamed sums and second moments),
of their second moment (uncentered) and of their unit vectors' covariance; and the mean squared norm."""

from isojax.stats.measures.base import Measure, Metric


def top_share(eig_D) -> float:
    """sigma_1^2 / Sum sigma^2 from the eigenvalues, descending (NaN without variance)."""
    total = eig_D.sum()
    return float(eig_D[0] / total) if total > 0 else float("nan")


def readout(spectra) -> dict:
    return {"anisotropy": top_share(spectra.centered_raw),
            "anisotropy_uncentered": float(spectra.top_share_uncentered),
            "unit_anisotropy": float(spectra.top_share_unit),
            "mean_sq_norm": float(spectra.mean_sq_norm)}


MEASURE = Measure(
    metrics=(Metric("anisotropy", "share of the variance", "anisotropy σ₁²/Σσ² (centered)", drawn=False),
             Metric("anisotropy_uncentered", "share of the second moment", "anisotropy, uncentered", drawn=False),
             Metric("unit_anisotropy", "share of the variance", "anisotropy of the unit vectors", drawn=False),
             Metric("mean_sq_norm", "squared norm", "mean ‖x‖²", drawn=False)),
    reads="spectra", readout=readout, paper="Razzhigaev et al. 2024 (The Shape of Learning)",
    readme_row=('| `anisotropy`, `anisotropy_uncentered`, `unit_anisotropy`, `mean_sq_norm` | σ₁²/Σσ² of the '
               "centered matrix of all the layer's states (above), of the states as they are, and of their unit "
               'vectors centered; the mean ‖x‖²; exact from the streamed sums and second moments, where the '
               'population keeps its own | Razzhigaev et al. 2024 (The Shape of Learning) |'))
