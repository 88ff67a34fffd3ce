"""PNG plots of one run's metrics.json dict (the `plots/` folder of an extract result):
per-layer similarity, anisotropy, norms, and per-source comparisons."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from isojax.plots.axes import covered_lines, layer_axis, legend_beside, under
from isojax.plots.style import DPI, plt, styled
from isojax.steps import INITIAL, RANDOM, weights_read


def _value(layer: dict, key: str) -> float:
    """layer[key] as a float; NaN when missing, None or not a number."""
    v = layer.get(key)
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _series(layers: list[dict], key: str) -> np.ndarray:
    return np.array([_value(layer, key) for layer in layers], dtype=float)


def title_for(metrics: dict, what: str) -> str:
    """Figure title: '<what> — <model> @ <revision> [— RANDOM WEIGHTS | — INITIALIZATION (STEP 0)]'
    plus a details line."""
    head = f"{what} — {metrics.get('model', '?')}"
    if metrics.get("revision"):
        head += f" @ {metrics['revision']}"
    weights = weights_read(metrics.get("weights"), metrics.get("revision"))
    if weights == RANDOM:
        head += " — RANDOM WEIGHTS"
    elif weights == INITIAL:
        head += " — INITIALIZATION (STEP 0)"
    details = []
    if metrics.get("unit"):
        details.append(f"unit: {metrics['unit']}")
    for key in ("tokens", "sequences"):
        if isinstance(metrics.get(key), (int, float)):
            details.append(f"{metrics[key]:,} {key}")
    return head + ("\n" + " · ".join(details) if details else "")


def _plot(metrics: dict, names: list[str], lines: list[tuple], ylabel: str, what: str, path: pathlib.Path,
          log_if_wide: bool = False) -> pathlib.Path | None:
    """Draw `lines` = [(label, values, style_kwargs), ...]; all-NaN lines are skipped. None when nothing to draw."""
    lines = [(label, vals, kw) for label, vals, kw in lines if len(vals) and np.isfinite(vals).any()]
    if not lines:
        return None
    with styled():
        return _draw(metrics, names, lines, ylabel, what, path, log_if_wide)


def _draw(metrics, names, lines, ylabel, what, path, log_if_wide) -> pathlib.Path:
    legend = len(lines) > 1  # beside the axes, never over the data: the figure widens for it
    width = max(7.0, min(14.0, 0.25 * len(names) + 5)) + (2.4 if legend else 0.0)
    fig, ax = plt.subplots(figsize=(width, 4.8), layout="constrained")
    try:
        x = np.arange(len(names))
        covered = covered_lines([(label, x, vals, kw) for label, vals, kw in lines])
        for i, (label, vals, kw) in enumerate(lines):
            label, style = under(label, {"marker": "o" if len(names) <= 40 else None, "markersize": 4, **kw},
                                 covered.get(i))
            ax.plot(x, vals, label=label, **style)
        if log_if_wide:
            finite = np.concatenate([v[np.isfinite(v) & (v > 0)] for _, v, _ in lines])
            if finite.size and finite.max() > 100 * finite.min():
                ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_xlabel("layer")
        ax.set_title(title_for(metrics, what), fontsize=11)
        ax.grid(True, alpha=0.3)
        if ax.get_yscale() == "log":
            ax.grid(True, which="minor", alpha=0.12)
        if legend:
            legend_beside(ax, fontsize=9)
        layer_axis(ax, names, fontsize=9)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def _aligned(layers: list[dict], names: list[str], key: str) -> np.ndarray:
    """Values of `key` in `layers` placed at the positions of `names` (NaN where a name is absent)."""
    by_name = {layer.get("name"): layer for layer in layers}
    return np.array([_value(by_name.get(name, {}), key) for name in names], dtype=float)


def plot_metrics(metrics: dict, out_dir: pathlib.Path, *, layers: bool = True,
                 sources: bool = True) -> list[pathlib.Path]:
    """Write the PNG plots of `metrics` into `out_dir` (created if needed); return the paths written.
    layers / sources: the figures of the whole population / those by source (metrics["sources"]),
    so that the first can be drawn before the per-source metrics are in (run/results.py)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    whole = list(metrics.get("layers") or [])
    names = [str(layer.get("name", i)) for i, layer in enumerate(whole)]
    written = []

    if whole and layers:
        written.append(_plot(metrics, names, [
            ("InterSim (all pairs of states)", _series(whole, "inter_sim"), {"color": "C0"}),
            ("IntraSim (mean over token types)", _series(whole, "intra_sim"), {"color": "C1"}),
            ("IntraSim (occurrence-weighted)", _series(whole, "intra_sim_weighted"),
             {"color": "C1", "linestyle": "--"}),
        ], "mean cosine similarity", "InterSim / IntraSim", out_dir / "similarity.png"))
        written.append(_plot(metrics, names, [
            ("anisotropy (centered)", _series(whole, "anisotropy"), {"color": "C2"}),
            ("anisotropy (uncentered)", _series(whole, "anisotropy_uncentered"), {"color": "C3", "linestyle": "--"}),
            ("centered, mean over batches of 4096", _series(whole, "anisotropy_batch_mean"),
             {"color": "C2", "linestyle": ":"}),
        ], "σ₁² / Σσ²", "Anisotropy", out_dir / "anisotropy.png"))
        ids = [layer.get("intrinsic_dimension") or {} for layer in whole]
        written.append(_plot(metrics, names, [
            (label, np.array([_value(i, key) for i in ids], dtype=float), {"color": f"C{c}"})
            for c, (key, label) in enumerate((("twonn", "TwoNN"), ("mle", "MLE (k neighbours)"),
                                              ("mom", "method of moments")))
        ], "intrinsic dimension", "Intrinsic dimension (sampled states)", out_dir / "intrinsic_dimension.png"))
        written.append(_plot(metrics, names, [
            ("mean ‖h‖", _series(whole, "mean_norm"), {"color": "C4"}),
            ("‖mean h‖", _series(whole, "norm_of_mean"), {"color": "C5", "linestyle": "--"}),
        ], "L2 norm", "Norms", out_dir / "norms.png", log_if_wide=True))

    by_source = metrics.get("sources") or {}
    if isinstance(by_source, dict) and by_source and sources:
        if not names:
            first = next(iter(by_source.values())) or {}
            names = [str(layer.get("name", i)) for i, layer in enumerate(first.get("layers") or [])]
        for key, what, ylabel, fname in (
                ("inter_sim", "InterSim by source", "mean cosine similarity", "sources_inter_sim.png"),
                ("anisotropy", "Anisotropy (centered) by source", "σ₁² / Σσ²", "sources_anisotropy.png")):
            lines = []
            for i, (src, entry) in enumerate(sorted(by_source.items())):
                entry = entry or {}
                label = f"{src} ({entry['tokens']:,} tok)" if isinstance(entry.get("tokens"), int) else str(src)
                lines.append((label, _aligned(entry.get("layers") or [], names, key), {"color": f"C{(i + 1) % 10}"}))
            if whole:
                lines.insert(0, ("all", _aligned(whole, names, key),
                                     {"color": "0.35", "linewidth": 3.5, "alpha": 0.6, "zorder": 1}))
            written.append(_plot(metrics, names, lines, ylabel, what, out_dir / fname))

    return [p for p in written if p is not None]
