"""InterSim, the paper's measure of a layer (Machina & Mercer 2024, eq. 7), and the states' norms: from a
population's first moments, exact over every state (the count and the streamed sums of x, x/|x| and |x|)."""

import numpy as np

from isojax.stats.measures.base import Measure, Metric


def mean_cos(sq_norm_of_sum, n):
    """(|Sum u|^2 - n) / (n^2 - n): the mean cosine over distinct pairs of n unit vectors (NaN for n < 2)."""
    n = np.asarray(n, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n >= 2, (sq_norm_of_sum - n) / (n * n - n), np.nan)


def readout(moments) -> dict:
    n = moments.n
    return {"count": int(n),
            "inter_sim": float(mean_cos(moments.unit_sum_D @ moments.unit_sum_D, n)),
            "mean_norm": float(moments.norm_sum / n) if n else float("nan"),
            "norm_of_mean": float(np.linalg.norm(moments.sum_D) / n) if n else float("nan")}


MEASURE = Measure(
    metrics=(Metric("count", "tokens", "tokens counted", drawn=False),
             Metric("inter_sim", "cosine", "InterSim", drawn=False),  # the paper's figures draw it (report/states.py)
             Metric("mean_norm", "norm", "mean ‖x‖", drawn=False),
             Metric("norm_of_mean", "norm", "‖mean x‖", drawn=False)),
    reads="moments", readout=readout, paper="Machina & Mercer 2024",
    readme_row=('| `count`, `inter_sim`, `mean_norm`, `norm_of_mean` | the tokens counted; InterSim (above): the '
               "mean cosine over distinct pairs of all the layer's states, (‖Σ û‖² − n)/(n² − n), exact from the "
               'streamed sum of unit vectors; the mean ‖x‖ and ‖mean x‖; per layer and per source | Machina & '
               'Mercer 2024 |'))
