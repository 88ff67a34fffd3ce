"""The figures of `python -m isojax.weights`: normalized singular values (Bis et al. Fig. 2b),
2-D SVD projections (Machina & Mercer Fig. 10) and metrics across revisions (Figs. 7 and 9)."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from matplotlib.ticker import LogFormatterSciNotation, LogLocator

from isojax.plots.axes import covered_lines, few_ticks, legend_beside, under
from isojax.plots.style import plt, styled


def _safe(name: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", name)


def _title(what: str, label: str, sub: str = "") -> str:
    """'<what> — <model label>' (as the run plots), then the tensor on a second line."""
    return f"{what} — {label}" + (f"\n{sub}" if sub else "")


def matrix_plots(rep, key: str, out: pathlib.Path, label: str, sub: str) -> None:
    """rep: isotropy.MatrixReport."""
    with styled():
        fig, ax = plt.subplots(figsize=(6, 4))
        k = np.arange(1, len(rep.singular_values) + 1)
        # the two often coincide but for sigma_1: uncentered is a wide pale band under the thin line
        ax.plot(k, rep.singular_values, label="uncentered", color="C0", lw=4, alpha=0.45, zorder=2)
        ax.plot(k, rep.singular_values_centered, label="centered", color="C1", lw=1.2, zorder=3)
        _singular_value_axis(ax, np.concatenate([rep.singular_values, rep.singular_values_centered]))
        ax.set(xlabel="index k", ylabel=r"$\sigma_k / \sigma_1$",
               title=_title("normalized singular values", label, sub))
        ax.title.set_fontsize(10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{key}_singular_values.png", dpi=120)
        plt.close(fig)
        fig, axes = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
        ids = np.arange(len(rep.proj2d))
        for ax, p, name in ((axes[0], rep.proj2d, "uncentered"), (axes[1], rep.proj2d_centered, "centered")):
            if p.shape[1] < 2:
                p = np.c_[p, np.zeros(len(p))]
            sc = ax.scatter(p[:, 0], p[:, 1], c=ids, s=1, cmap="viridis", rasterized=True)
            ax.set(xlabel="singular direction 1", ylabel="singular direction 2", title=name)
            few_ticks(ax)
            ax.axhline(0, color="grey", lw=0.5)
            ax.axvline(0, color="grey", lw=0.5)
        fig.colorbar(sc, ax=axes, label="token id (row)")
        fig.suptitle(_title("2-D SVD projection", label, sub))
        fig.savefig(out / f"{key}_svd2d.png", dpi=120)
        plt.close(fig)


def _singular_value_axis(ax, values: np.ndarray) -> None:
    """Log scale when the values span more than a decade, with 2x and 5x ticks labelled over
    up to three decades; a linear 0-1 scale otherwise (a log axis there shows one or two ticks)."""
    positive = values[np.isfinite(values) & (values > 0)]
    low = positive.min() if positive.size else 1.0
    if low >= 0.1:
        ax.set_ylim(0, 1.05)
        return
    ax.set_yscale("log")
    if np.log10(1 / low) <= 3:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(4, 4)))
    ax.grid(True, which="both", alpha=0.2)


def sweep_plots(rows: list[dict], groups: list[str], matrix_metrics, ln_metrics, out: pathlib.Path, label: str):
    """One PNG per metric across revisions."""
    steps = [r["step"] for r in rows]
    by_step = all(s is not None for s in steps)
    x = steps if by_step else list(range(len(rows)))
    series = [(m, [f"{g}.{m}" for g in groups]) for m in matrix_metrics]
    series += [("final_ln_" + "_".join(ms), [f"final_ln.{m}" for m in ms]) for ms in ln_metrics]
    with styled():
        for name, cols in series:
            fig, ax = plt.subplots(figsize=(8.5, 4))  # 2 inches of it for the legend
            ys = [np.array([np.nan if r.get(c) is None else r[c] for r in rows], dtype=float) for c in cols]
            covered = covered_lines([(c, x, y, {}) for c, y in zip(cols, ys)])
            for i, (c, y) in enumerate(zip(cols, ys)):
                text, style = under(c, {"marker": "o", "markersize": 3}, covered.get(i))
                ax.plot(x, y, label=text, **style)
            ax.set(xlabel="training step" if by_step else "revision", ylabel=name, title=_title(name, label))
            if not by_step:
                ax.set_xticks(x, [r["revision"] for r in rows], rotation=45, ha="right")
            legend_beside(ax)
            fig.tight_layout()
            fig.savefig(out / f"sweep_{_safe(name)}.png", dpi=120)
            plt.close(fig)
