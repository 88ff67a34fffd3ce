"""The figures of Machina & Mercer (NAACL 2024), drawn from plain series so that any mix of runs
can be shown: lines over layers, training steps or frequency bands (Figs 1-4, 7, 9), grouped
bars over model sizes (Figs 5, 6, 8), 2-D SVD scatters (Fig 10), and heatmaps of layer x layer
matrices (linear CKA).

Every function returns an open matplotlib Figure drawn under `styled()`; pass it to
`isojax.plots.save`, which writes PNG and SVG and closes it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from isojax.plots.axes import covered_lines, few_ticks, layer_axis, legend_beside, under
from isojax.plots.style import plt, styled


@dataclasses.dataclass
class Line:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    style: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Panel:
    title: str
    lines: list[Line]
    layers: list[str] | None = None  # layer names at x = 0, 1, ...: named ticks; None: automatic
    layer_labels: list[str] | None = None  # their tick labels; None: embed, 1 … L, final_ln


def _grid(n: int, ncols_max: int = 3, width: float = 5.2, height: float = 3.9, **kw):
    ncols = min(n, ncols_max)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 0.4, height * nrows + 0.6),
                             squeeze=False, layout="constrained", **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _finite(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def lines(panels: list[Panel], xlabel: str, ylabel: str, title: str, xscale: str = "linear",
          sharey: bool = True, ncols: int = 3, width: float = 5.2):
    """One axes per panel, its legend beside it on the right (never over the lines); a line that a later
    one covers is drawn with rings and says so (axes.covered_lines, axes.under)."""
    with styled():
        legends = any(line.label for panel in panels for line in panel.lines)
        fig, axes = _grid(len(panels), ncols, width=width + (1.8 if legends else 0.0), sharey=sharey)
        for ax, panel in zip(axes, panels):
            covered = covered_lines([(line.label, line.x, _finite(line.y), line.style) for line in panel.lines])
            for i, line in enumerate(panel.lines):
                y = _finite(line.y)
                style = {"marker": "o", "markersize": 3.5 if len(y) <= 40 else 0, **line.style}
                label, style = under(line.label, style, covered.get(i))
                ax.plot(np.asarray(line.x, dtype=float), y, label=label, **style)
            if xscale == "log2":
                ax.set_xscale("log", base=2)
            ax.set(xlabel=xlabel, ylabel=ylabel)
            ax.set_title(panel.title, fontsize=10)
            ax.grid(True, alpha=0.3)
            if any(line.label for line in panel.lines):
                legend_beside(ax, fontsize=7 if len(panel.lines) > 6 else 8)
        fig.suptitle(title, fontsize=12)
        for ax, panel in zip(axes, panels):  # last: the ticks are fitted to the laid-out width
            if panel.layers is not None:
                layer_axis(ax, panel.layers, panel.layer_labels)
    return fig


_LABEL_CHARS = 24


def _wrap(label: str) -> str:
    """Lines of at most _LABEL_CHARS characters, broken before ' @ ', after '-' or at spaces."""
    lines, line = [], ""
    for piece in re.findall(r"[^\s-]*-|\S+|\s+", label.replace(" @ ", "\n@ ")):
        if piece == "\n" or line and len(line + piece.rstrip()) > _LABEL_CHARS:
            lines.append(line.rstrip())
            line = "" if piece.isspace() else piece
        else:
            line += piece
    return "\n".join(lines + [line.rstrip()])


def bars(categories: list[str], groups: list[tuple[str, Sequence[float]]], ylabel: str, title: str,
         ylim: tuple[float, float] | None = None):
    """Grouped bars: one group of len(groups) bars per category, the value written on each bar.
    Categories longer than 24 characters ('model @ stage2-ingredient1-step...') are written on
    lines of at most that many, level, and the figure widened to hold them."""
    with styled():
        legend = 1.8 if len(groups) > 1 else 0.0  # inches for the legend beside the bars
        wide = max(map(len, categories), default=0) > _LABEL_CHARS
        if wide:
            categories = [_wrap(c) for c in categories]
        per = 0.09 * _LABEL_CHARS + 0.3 if wide else 0.0  # inches per category for its label
        fig, ax = plt.subplots(figsize=(max(5.5, 1.1 * len(categories) * max(1, len(groups)) * 0.6 + 2.5,
                                            per * len(categories) + 1.0) + legend, 4.4), layout="constrained")
        x = np.arange(len(categories))
        width = 0.8 / max(len(groups), 1)
        for i, (label, values) in enumerate(groups):
            v = _finite(values)
            rects = ax.bar(x + (i - (len(groups) - 1) / 2) * width, np.nan_to_num(v), width, label=label)
            ax.bar_label(rects, labels=["n/a" if not np.isfinite(a) else f"{a:.3g}" for a in v],
                         fontsize=7, padding=2)
        slant = len(categories) > 4 and not wide
        ax.set_xticks(x, categories, rotation=30 if slant else 0, ha="right" if slant else "center")
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(title, fontsize=11)
        ax.grid(True, axis="y", alpha=0.3)
        if len(groups) > 1:
            legend_beside(ax)
    return fig


def scatters(panels: list[tuple[str, np.ndarray]], title: str, ncols: int = 2):
    """2-D projections, one axes per (title, points [N, 2]), coloured by row (token id).

    Points are rasterized so that the SVG of a 50k-row vocabulary stays small."""
    with styled():
        fig, axes = _grid(len(panels), ncols, width=4.2, height=3.8)
        for ax, (name, xy) in zip(axes, panels):
            xy = np.asarray(xy, dtype=float)
            if xy.ndim != 2 or xy.shape[0] == 0:
                ax.set_title(f"{name}\n(no points)", fontsize=9)
                continue
            if xy.shape[1] < 2:
                xy = np.c_[xy, np.zeros(len(xy))]
            ax.scatter(xy[:, 0], xy[:, 1], c=np.arange(len(xy)), s=1, cmap="viridis", rasterized=True)
            ax.axhline(0, color="grey", lw=0.5)
            ax.axvline(0, color="grey", lw=0.5)
            ax.set_title(name, fontsize=9)
            ax.tick_params(labelsize=7)
            few_ticks(ax)
        fig.suptitle(title, fontsize=12)
    return fig


def _thin_ticks(n: int, most: int = 12) -> list[int]:
    """0, every k-th index and n - 1, k the smallest round step giving at most `most` ticks."""
    step = next((s for s in (1, 2, 4, 5, 10, 20, 25, 50, 100, 200, 500, 1000) if n / s <= most), 1000)
    ticks = [i for i in range(n) if i % step == 0 or i == n - 1]
    if len(ticks) > 2 and ticks[-1] - ticks[-2] < step / 2:
        del ticks[-2]
    return ticks


def heatmaps(panels: list[tuple[str, np.ndarray, list[str], list[str]]], xlabel: str, ylabel: str, title: str,
             ncols: int = 2, vmin: float = 0.0, vmax: float = 1.0):
    """One heatmap per (title, matrix [rows, cols], row layer names, column layer names), rows
    from the top, a shared colour bar; null cells (NaN) left white."""
    from isojax.plots.axes import layer_label
    with styled():
        fig, axes = _grid(len(panels), ncols, width=4.6, height=4.2)
        image = None
        for ax, (name, matrix, rows, cols) in zip(axes, panels):
            m = np.asarray(_finite(np.ravel(matrix)), dtype=float).reshape(len(rows), len(cols))
            image = ax.imshow(m, vmin=vmin, vmax=vmax, cmap="viridis", origin="upper", aspect="auto",
                              interpolation="nearest")
            ax.set(xlabel=xlabel, ylabel=ylabel)
            ax.set_title(name, fontsize=9)
            ticks = _thin_ticks(len(rows))
            ax.set_yticks(ticks, [layer_label(rows[i]) for i in ticks], fontsize=7)
        if image is not None:
            fig.colorbar(image, ax=axes, shrink=0.8)
        fig.suptitle(title, fontsize=12)
        for ax, (_, _, _, cols) in zip(axes, panels):
            layer_axis(ax, cols, fontsize=7)
    return fig
