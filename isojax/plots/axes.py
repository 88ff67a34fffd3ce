"""Axis helpers shared by isojax's figures: named layer ticks that never run together, few
ticks on scatter axes, legends beside the axes (never over the data), no line hidden under
another without a word."""

from __future__ import annotations

import re

import numpy as np

from matplotlib.textpath import TextPath
from matplotlib.ticker import MaxNLocator

# Block numbers a tick may stand on: every block, every 2nd, 4th, 5th, ... (round numbers)
_STEPS = (1, 2, 4, 5, 10, 20, 25, 50, 100, 200, 500, 1000)
_GAP_IN = 0.1  # inches of white between two neighbouring tick labels


def layer_label(name: str) -> str:
    """'block_7' -> '7'; 'embed', 'final_ln' and other names as they are."""
    m = re.fullmatch(r"block_(\d+)", str(name))
    return m.group(1) if m else str(name)


def _width_in(text: str, size: float) -> float:
    return TextPath((0, 0), text, size=size).get_extents().width / 72


def layer_axis(ax, names: list[str], labels: list[str] | None = None, fontsize: float = 8) -> None:
    """Ticks at the integer positions of `names` (embed = 0, block_i = i, final_ln = L + 1),
    labelled embed, 1 … L, final_ln; the first and last always, the blocks between at the
    smallest round step at which no two labels touch at the axes' drawn width. Call it after the title,
    legend and labels are set: under a layout engine the figure is laid out first to learn that
    width."""
    n = len(names)
    labels = list(labels) if labels is not None else [layer_label(s) for s in names]
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    if n == 0:
        ax.set_xticks([])
        return
    fig = ax.figure
    if fig.get_layout_engine() is not None:
        fig.draw_without_rendering()
    per = ax.get_position().width * fig.get_figwidth() / n  # inches per layer
    need = [_width_in(s, fontsize) + _GAP_IN for s in labels]

    def fits(a: int, b: int) -> bool:
        return (b - a) * per >= (need[a] + need[b]) / 2

    for step in _STEPS:
        ticks = [0] + [i for i in range(1, n - 1) if i % step == 0] + ([n - 1] if n > 1 else [])
        if len(ticks) > 2 and not fits(ticks[-2], ticks[-1]):  # L next to final_ln at L + 1: final_ln wins
            del ticks[-2]
        if all(fits(a, b) for a, b in zip(ticks, ticks[1:])):
            break
    ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=fontsize)


def few_ticks(ax, nbins: int = 4) -> None:
    """At most nbins + 1 ticks per axis: labels such as -0.075 need room (scatters of weights)."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=nbins))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=nbins))


def legend_beside(ax, fontsize: float = 8) -> None:
    """The legend to the right of the axes, outside them, so that it never hides data."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              borderaxespad=0.0)


# No series hidden without a word: a line that a later one covers is drawn with rings around its
# points and its label names the line over it.
SAME = 0.005  # lines closer than this share of the axes' y range at every point would hide one another
WIDER = 1.0  # points: a line at least this much wider than the one over it shows around it


def covered_lines(series) -> dict[int, str]:
    """series: [(label, x, y, style)] in drawing order -> {index: label of the later line over it} for
    each line a later one covers: the same x and missing points, y within SAME of the y range of all
    the series at every point, and the earlier line not wider by WIDER (a wide band shows around)."""
    xs = [np.asarray(x, dtype=float) for _, x, _, _ in series]
    ys = [np.asarray(y, dtype=float) for _, _, y, _ in series]
    width = [float(style.get("linewidth", style.get("lw", 1.5))) for *_, style in series]
    finite = np.concatenate([y[np.isfinite(y)] for y in ys] + [np.zeros(0)])
    tol = SAME * float(np.ptp(finite)) if finite.size else 0.0
    out = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        if not np.isfinite(y).any():
            continue
        for j in range(len(series) - 1, i, -1):
            if xs[j].shape == x.shape and np.array_equal(xs[j], x) and np.array_equal(np.isnan(ys[j]), np.isnan(y)) \
                    and np.all(np.abs(ys[j] - y)[np.isfinite(y)] <= tol) and width[i] <= width[j] + WIDER:
                out[i] = series[j][0] or f"line {j + 1}"
                break
    return out


def under(label: str, style: dict, over: str | None) -> tuple[str, dict]:
    """(label, style) of a line drawn under the line `over` (None: as they are): open rings that show
    around the points of the line over it, and the label saying so."""
    if over is None:
        return label, style
    return (f"{label}\n(same values as\n{over}, under it)",
            {**style, "marker": "o", "markersize": 8, "markerfacecolor": "none", "markeredgewidth": 1.5})
