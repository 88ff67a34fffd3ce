"""Axis helpers shared by isojax's figures: named layer ticks that never run together, few
ticks on scatter axes, legends beside the axes (never over the data)."""

from __future__ import annotations

import re

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
