"""Rogue dimensions (Timkey & van Schijndel 2021): each dimension's share of InterSim."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric


def rogue_dims(n: int, unit_sum_D, unit_sq_sum_D, top: int = 3) -> list[dict] | None:
    """InterSim = sum_i c_i with c_i = (S_i^2 - sum_t u_ti^2) / (n^2 - n) the contribution of dimension i
    (u: unit vectors, S = sum_t u_t); the `top` largest c_i as [{"dim": i, "share": c_i / InterSim}]. None for
    n < 2 or InterSim = 0."""
    if n < 2:
        return None
    s_D = np.asarray(unit_sum_D, np.float64)
    c_D = (s_D * s_D - np.asarray(unit_sq_sum_D, np.float64)) / (float(n) * n - n)
    inter = c_D.sum()
    if inter == 0:
        return None
    order = np.argsort(-c_D, kind="stable")[:top]
    return [{"dim": int(i), "share": float(c_D[i] / inter)} for i in order]


def readout(spectra) -> dict:
    """Sum_t u_ti^2 = n x the unit covariance's diagonal + S_i^2 / n."""
    n, unit_sum_D = float(spectra.n), spectra.unit_sum_D
    rogue = rogue_dims(n, unit_sum_D, n * spectra.unit_cov_diag_D + unit_sum_D * unit_sum_D / max(n, 1.0))
    return {"rogue_dims": rogue, "rogue_share_top3": None if rogue is None else float(sum(r["share"] for r in rogue))}


MEASURE = Measure(
    metrics=(Metric("rogue_dims", "dimensions", "rogue dimensions", listed=True),
             Metric("rogue_share_top3", "share of InterSim", "InterSim share of the top 3 rogue dimensions")),
    reads="spectra", readout=readout, paper="Timkey & van Schijndel 2021",
    readme_row=('| `rogue_dims`, `rogue_share_top3` | InterSim = Σᵢ cᵢ with cᵢ = (Sᵢ² − Σₜ uₜᵢ²)/(n² − n) (u unit '
               'vectors, S = Σₜ uₜ); the 3 largest cᵢ as `[{"dim": i, "share": cᵢ/InterSim}]` (metrics.json only),'
               ' and the sum of their shares | Timkey & van Schijndel 2021 |'))
