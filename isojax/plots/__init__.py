"""All of isojax's plotting.

- `run`: the PNGs of one extract result (`plot_metrics`, written into its `plots/` folder);
- `paper`: the figures of Machina & Mercer regenerated across runs, for `python -m isojax.report`;
- `weights`: the figures of `python -m isojax.weights` (singular values, SVD projections, sweeps);
- `style`: the Agg backend, one style for every figure, the PNG + SVG writer;
- `axes`: layer ticks (embed, 1 … L, final_ln, thinned to fit), legends beside the axes.

tests/test_figures.py draws every figure for 2 and 24 layers and checks what can be measured.
"""

from isojax.plots.run import plot_metrics, title_for
from isojax.plots.style import DPI, plt, save, styled

__all__ = ["DPI", "plot_metrics", "plt", "save", "styled", "title_for"]
