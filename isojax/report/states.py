"""Report sections from extract results (metrics.json): InterSim / IntraSim per layer across
sizes (Figs 1-2), the last layer across training (Figs 3-4), IntraSim by token-frequency band,
and per-source panels."""

from __future__ import annotations

import math
import re

from isojax.plots import paper
from isojax.plots.axes import layer_label
from isojax.report.collect import Results, Run, finals, layer_names, layer_value, number, resolve_layer, trainings
from isojax.report.document import Figures, Section, Table
from isojax.stats import measures

_LABELS = {"inter_sim": "InterSim", "intra_sim": "IntraSim (mean over token types)",
           "anisotropy": "anisotropy σ₁²/Σσ² (centered)",
           "anisotropy_batch_mean": "anisotropy over batches of 4096 (mean)",
           "intrinsic_dimension_twonn": "intrinsic dimension (TwoNN)",
           # report/measures.py
           "isoscore": "IsoScore", "isoscore_star": "IsoScore*",
           "rogue_share_top3": "InterSim share of the top 3 rogue dimensions",
           "inter_sim_standardized": "InterSim, standardized dimensions", "massive_max": "largest |activation|",
           "massive_max_over_sample_median": "largest |activation| / the sample's median |x|",
           "massive_count": "massive activations (Sun et al.) in the probe's sentences",
           "massive_top1": "largest |activation| per sentence (mean)", "feature_kurtosis": "feature kurtosis",
           "alpha_req": "α-ReQ", "effective_rank": "effective rank",
           "erank": "eRank (Diff-eRank's, per sentence)", "erank_pooled": "eRank of the unit vectors, pooled",
           "diff_erank": "Diff-eRank (step0 − this one)",
           "diff_erank_pooled": "pooled Diff-eRank (step0 − this one)", **measures.labels()}


def _layer_order(name: str):
    m = re.fullmatch(r"block_(\d+)", name)
    return (0, 0) if name == "embed" else (1, int(m.group(1))) if m else (2, 0) if name == "final_ln" else (3, 0)


def run_label(run: Run) -> str:
    return run.label + ("" if run.revision == "main" else f" @ {run.revision}")


def titled(text: str, runs: list[Run], final: bool = False) -> str:
    """A figure title: `text` (+ ", final checkpoints"), and RANDOM WEIGHTS when runs drawn in it
    have random weights (named unless all have: then they are no checkpoints either)."""
    rand = [r for r in runs if r.random]
    if rand and len(rand) == len(runs):
        return f"{text} — RANDOM WEIGHTS"
    text += ", final checkpoints" if final else ""
    return text + (f" — RANDOM WEIGHTS: {', '.join(run_label(r) for r in rand)}" if rand else "")


def _layer_axis(runs: list[Run]) -> tuple[list[str], list[str], str]:
    """(names, tick labels, x label) of a layer axis shared by runs: their names when all have the
    same layers; else the deepest run's, its final_ln shown as the number L + 1 (the shallower
    models' final_ln stand at their own L + 1)."""
    deepest = max((layer_names(r) for r in runs), key=len)
    if all(layer_names(r) == deepest for r in runs):
        return deepest, [layer_label(n) for n in deepest], "layer"
    labels = [layer_label(n) for n in deepest[:-1]] + [str(len(deepest) - 1)]
    return deepest, labels, "layer (embed = 0, block i = i, final_ln = L + 1 of each model)"


def _has(run: Run, metric: str, layers=None) -> bool:
    return any(math.isfinite(number(layer.get(metric))) for layer in (layers or run.data.get("layers") or []))


def _by_layer(figs: Figures, runs: list[Run], metric: str, fig_no: str):
    runs = [r for r in runs if _has(r, metric)]
    if not runs:
        return None
    lines = [paper.Line(run_label(r), range(len(r.data["layers"])),
                        [number(layer.get(metric)) for layer in r.data["layers"]]) for r in runs]
    what = _LABELS.get(metric, metric)
    names, labels, xlabel = _layer_axis(runs)
    fig = paper.lines([paper.Panel("", lines, names, labels)], xlabel, what,
                      titled(f"{what} per layer", runs, final=True), ncols=1, width=7.5)
    names = sorted({n for r in runs for n in layer_names(r)}, key=_layer_order)
    rows = [[n] + [layer_value(r, metric, n) for r in runs] for n in names]
    caption = (f"{what} of every layer{fig_no}. Each model at its final checkpoint "
               f"({', '.join(run_label(r) for r in runs)}).")
    return figs.add(fig, f"{metric}_by_layer", caption, Table(["layer"] + [run_label(r) for r in runs], rows))


def _training(figs: Figures, series: dict[str, list[Run]], metric: str, fig_no: str):
    series = {m: rs for m, rs in series.items() if any(_has(r, metric) for r in rs)}
    if not series:
        return None
    what = _LABELS.get(metric, metric)
    lines, rows = [], []
    for i, rs in enumerate(series.values()):
        steps = [r.step for r in rs]
        last = [layer_value(r, metric, "block_L") for r in rs]
        ln = [layer_value(r, metric, "final_ln") for r in rs]
        lines += [paper.Line(f"{rs[0].label} block_L", steps, last, {"color": f"C{i}"}),
                  paper.Line(f"{rs[0].label} final_ln", steps, ln, {"color": f"C{i}", "linestyle": "--"})]
        rows += [[r.label, r.revision, r.step, resolve_layer(layer_names(r), "block_L"), a, b]
                 for r, a, b in zip(rs, last, ln)]
    fig = paper.lines([paper.Panel("", lines)], "training step", what,
                      titled(f"{what} of the last layer during training", [r for rs in series.values() for r in rs]),
                      ncols=1, width=7.5)
    caption = f"{what} of the last block (solid) and the final LayerNorm (dashed) across training checkpoints{fig_no}."
    return figs.add(fig, f"{metric}_last_layer_training", caption,
                    Table(["model", "revision", "step", "last block", "block_L", "final_ln"], rows))


def contextualization(res: Results, figs: Figures) -> Section:
    sec = Section("layers", "InterSim and IntraSim per layer across model sizes",
                  "The mean cosine similarity of all pairs of states of a layer (InterSim) and of the states "
                  "of one token type, averaged over token types seen at least twice (IntraSim); paper §4.1.1.")
    runs = finals(res.extract)
    for metric, no in (("inter_sim", " (paper Fig. 1)"), ("intra_sim", " (paper Fig. 2)"), ("anisotropy", "")):
        item = _by_layer(figs, runs, metric, no)
        if item:
            sec.items.append(item)
    if not sec.items:
        sec.note = "No extract results (metrics.json) with per-layer InterSim or IntraSim: section left out."
    return sec


def training(res: Results, figs: Figures) -> Section:
    sec = Section("training", "The last layer during training",
                  "InterSim and IntraSim of block_L and final_ln against the training step parsed from "
                  "revision names (`stepN`; OLMo's `stepN-tokensM` and `stage1-stepN-tokensM`); paper §4.1.2.")
    series = trainings(res.extract)
    for metric, no in (("inter_sim", " (paper Fig. 3)"), ("intra_sim", " (paper Fig. 4)")):
        item = _training(figs, series, metric, no)
        if item:
            sec.items.append(item)
    if not sec.items:
        sec.note = "No model has extract results at two or more revisions naming a training step: section left out."
    return sec


def _mean_over_layers(run: Run, metric: str) -> float:
    values = [number(layer.get(metric)) for layer in run.data.get("layers") or [] if layer.get("name") != "embed"]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def shape_of_learning(res: Results, figs: Figures) -> Section:
    sec = Section("shape", "Intrinsic dimension and the anisotropy profile",
                  "*The Shape of Learning*: the anisotropy of batches of 4096 sampled tokens per layer, and the "
                  "intrinsic dimension (TwoNN) of each layer's sampled states (extract --sample-states), per "
                  "layer at the final checkpoints and averaged over the layers (embed left out) across training "
                  "(its Fig. 4).")
    runs = finals(res.extract)
    for metric in ("anisotropy_batch_mean", "intrinsic_dimension_twonn"):
        item = _by_layer(figs, runs, metric, "")
        if item:
            sec.items.append(item)
    series = {m: rs for m, rs in trainings(res.extract).items()
              if any(_has(r, "intrinsic_dimension_twonn") for r in rs)}
    if series:
        lines, rows = [], []
        for i, rs in enumerate(series.values()):
            means = [_mean_over_layers(r, "intrinsic_dimension_twonn") for r in rs]
            lines.append(paper.Line(rs[0].label, [r.step for r in rs], means, {"color": f"C{i}"}))
            rows += [[r.label, r.revision, r.step, m] for r, m in zip(rs, means)]
        fig = paper.lines([paper.Panel("", lines)], "training step", "mean intrinsic dimension (TwoNN)",
                          titled("Intrinsic dimension averaged over layers during training",
                                 [r for rs in series.values() for r in rs]), ncols=1, width=7.5)
        sec.items.append(figs.add(fig, "intrinsic_dimension_training",
                                  "TwoNN intrinsic dimension averaged over the layers (embed left out) across "
                                  "training checkpoints (The Shape of Learning, Fig. 4).",
                                  Table(["model", "revision", "step", "mean TwoNN"], rows)))
    if not sec.items:
        sec.note = ("No extract results with a sample (extract --sample-states K; on accelerators the batch "
                    "anisotropy comes by default): section left out.")
    return sec


def _band_layers(names: list[str]) -> list[str]:
    blocks = [n for n in names if n.startswith("block_")]
    picks = [n for n in ("embed", blocks[(len(blocks) - 1) // 2] if blocks else None,
                         blocks[-1] if blocks else None, "final_ln") if n in names]
    return list(dict.fromkeys(picks))


def bands(res: Results, figs: Figures) -> Section:
    sec = Section("bands", "IntraSim by token frequency",
                  "Mean IntraSim of the token types whose count lies in [lo, 2·lo), per band: do rare tokens "
                  "drift apart (Biś et al., *Too Much in Common*)?")
    panels, rows, drawn = [], [], []
    for run in finals(res.extract):
        by_name = {str(layer.get("name")): layer for layer in run.data["layers"]}
        lines = []
        for name in _band_layers(list(by_name)):
            band = [b for b in by_name[name].get("intra_sim_by_band") or [] if isinstance(b, dict)]
            if not any(math.isfinite(number(b.get("intra_sim"))) for b in band):
                continue
            lines.append(paper.Line(name, [b.get("lo") for b in band], [number(b.get("intra_sim")) for b in band]))
            rows += [[run.label, name, b.get("lo"), b.get("hi"), b.get("tokens"), number(b.get("intra_sim"))]
                     for b in band]
        if lines:
            panels.append(paper.Panel(run_label(run), lines))
            drawn.append(run)
    if not panels:
        sec.note = "No extract results with `intra_sim_by_band` (runs with token statistics): section left out."
        return sec
    fig = paper.lines(panels, "token count (band lower bound)", "IntraSim",
                      titled("IntraSim by token-frequency band", drawn, final=True), xscale="log2")
    sec.items.append(figs.add(fig, "intra_sim_by_band", "IntraSim per frequency band of the token count, for the "
                              "embedding, a middle block, the last block and the final LayerNorm; final checkpoints.",
                              Table(["model", "layer", "band lo", "band hi", "token types", "intra_sim"], rows)))
    return sec


def _source_panel(run: Run, metric: str, sources: dict[str, dict]) -> paper.Panel:
    names = layer_names(run)
    x = range(len(names))
    lines = [paper.Line("all", x, [layer_value(run, metric, n) for n in names],
                        {"color": "0.35", "linewidth": 3.5, "alpha": 0.6, "zorder": 1})]
    for i, (src, entry) in enumerate(sources.items()):
        tokens = entry.get("tokens")
        label = f"{src} ({tokens:,} tok)" if isinstance(tokens, int) else src
        lines.append(paper.Line(label, x, [layer_value(run, metric, n, entry.get("layers") or []) for n in names],
                                {"color": f"C{i % 10}"}))
    return paper.Panel(run_label(run), lines, names)


def sources(res: Results, figs: Figures) -> Section:
    sec = Section("sources", "Per source", "Metrics of each text source of the corpus measured in the same pass "
                  "(paper §4.1.1 found no significant differences between sources).")
    runs = [r for r in finals(res.extract) if isinstance(r.data.get("sources"), dict) and r.data["sources"]]
    for metric in ("inter_sim", "anisotropy"):
        panels, table, drawn = [], [], []  # table: (model, layer, {column: value})
        for run in runs:
            srcs = {str(k): v for k, v in sorted(run.data["sources"].items()) if isinstance(v, dict)}
            if not any(_has(run, metric, s.get("layers")) for s in srcs.values()):
                continue
            panels.append(_source_panel(run, metric, srcs))
            drawn.append(run)
            for n in layer_names(run):
                table.append((run.label, n, {"all": layer_value(run, metric, n), **{
                    src: layer_value(run, metric, n, e.get("layers") or []) for src, e in srcs.items()}}))
        if not panels:
            continue
        what = _LABELS.get(metric, metric)
        columns = list(dict.fromkeys(c for _, _, vals in table for c in vals))
        rows = [[model, layer] + [vals.get(c, math.nan) for c in columns] for model, layer, vals in table]
        fig = paper.lines(panels, "layer", what, titled(f"{what} by source", drawn, final=True), ncols=2, width=6.5)
        sec.items.append(figs.add(fig, f"sources_{metric}", f"{what} per layer for each source (thick grey: all "
                                  "sources together); final checkpoints.", Table(["model", "layer"] + columns, rows)))
    if not sec.items:
        sec.note = "No extract results with per-source metrics (metrics.json `sources`): section left out."
    return sec
