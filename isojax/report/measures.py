"""The report's section of the geometry measures beyond the paper's (README "Measures"): each
scalar measure per layer at the final checkpoints and at the last layer across training
(states._by_layer / states._training), InterSim by position band, Diff-eRank across training,
tables of the rogue dimensions and massive activations, and heatmaps of linear CKA (a run's
cka.json between its layers; a sweep's sweep_cka.json across training, and its to_final measures).
A measure absent from every result (results of older isojax) is left out without a word; the
section says so only when it has nothing at all."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from isojax.log import log
from isojax.plots import paper
from isojax.stats import measures as registered
from isojax.report.collect import Results, Run, finals, layer_names, number, trainings
from isojax.report.document import Figures, Item, Section, Table
from isojax.report.states import _band_layers, _by_layer, _has, _training, run_label, titled

# every scalar measure drawn over layers and over checkpoints (its label: states._LABELS)
SCALARS = ["inter_sim_standardized", "massive_max", "massive_max_over_sample_median", "massive_count", "massive_top1",
           "erank", *(n for n in registered.drawn()  # the registered ones (a dict-valued one's: _registered_keyed)
                      if n not in registered.default_step_nulls())]  # massive_*: drawn as above, tabled below
BANDS = [("inter_sim_pos_0", "position 0"), ("inter_sim_pos_1_16", "positions 1–15"),
         ("inter_sim_pos_16_128", "positions 16–127"), ("inter_sim_pos_128_", "positions 128+")]


def _keyed(figs: Figures, runs: list[Run], keys: list[tuple[str, str]], ylabel: str, what: str, name: str,
           caption: str, heads: tuple[str, str], by_layer: bool, series=None):
    """Several keys of a layer, a line each: over layers (one panel per final run) or, with `series`,
    at the last block across training (one panel per model). keys: (column, its line's label);
    heads: the table's columns of the line and of the value."""
    panels, rows, drawn = [], [], []
    groups = series.values() if series is not None else [[r] for r in runs]
    for rs in groups:
        lines = []
        for i, (key, label) in enumerate(keys):
            if by_layer:
                run = rs[0]
                ys = [number(layer.get(key)) for layer in run.data["layers"]]
                xs = range(len(ys))
                rows += [[run_label(run), n, label, y] for n, y in zip(layer_names(run), ys)]
            else:
                from isojax.report.collect import layer_value
                xs, ys = [r.step for r in rs], [layer_value(r, key, "block_L") for r in rs]
                rows += [[r.label, r.revision, r.step, label, y] for r, y in zip(rs, ys)]
            if any(math.isfinite(y) for y in ys):
                lines.append(paper.Line(label, xs, ys, {"color": f"C{i}"}))
        if lines:
            panels.append(paper.Panel(run_label(rs[0]) if by_layer else rs[0].label, lines,
                                      layer_names(rs[0]) if by_layer else None))
            drawn += rs
    if not panels:
        return None
    where = "per layer" if by_layer else "of the last block during training"
    fig = paper.lines(panels, "layer" if by_layer else "training step", ylabel,
                      titled(f"{what}, {where}", drawn, final=by_layer), ncols=2, width=6.0)
    head = ["model", "layer", *heads] if by_layer else ["model", "revision", "step", heads[0], f"{heads[1]} (block_L)"]
    return figs.add(fig, name + ("" if by_layer else "_training"), f"{caption}, {where}.", Table(head, rows))


def _position_bands(figs: Figures, runs: list[Run], by_layer: bool, series=None):
    """InterSim by position band: over layers (one panel per final run) or, with `series`, at the
    last block across training (one panel per model)."""
    return _keyed(figs, runs, BANDS, "InterSim", "InterSim by position in the sequence", "inter_sim_by_position",
                  "InterSim of the states at positions 0, 1–15, 16–127 and 128+ of their sequence "
                  "(`inter_sim_by_position`)", ("positions", "inter_sim"), by_layer, series)


# the similarity of each layer with the one before it, on the sample, drawn together
SIMILARITIES = [("cka_debiased", "debiased linear CKA"), ("svcca", "SVCCA (99% of the variance)"),
                ("procrustes_distance", "Procrustes distance (0 to 2)")]


def _registered_keyed(figs: Figures, runs: list[Run], series: dict[str, list[Run]]) -> list:
    """Each dict-valued registered measure (gride: a line per scale) and the similarities of consecutive
    layers (SIMILARITIES: a line each), per layer and across training."""
    items = []
    for name, metric in registered.dict_valued().items():
        keys = [(f"{name}_{key}", f"{name} {key}") for key in metric.keys]
        items += [_keyed(figs, runs, keys, metric.unit, metric.label, name, f"{metric.label} (`{name}`) at each "
                         "of its keys", ("key", name), by_layer, None if by_layer else series)
                  for by_layer in (True, False)]
    items += [_keyed(figs, runs, SIMILARITIES, "similarity / distance", "Similarity with the previous layer",
                     "similarity_consecutive", "Debiased linear CKA, SVCCA and the Procrustes distance of each layer "
                     "with the one before it, on the sampled tokens", ("measure", "value"), by_layer,
                     None if by_layer else series)
              for by_layer in (True, False)]
    return [i for i in items if i]


def _with_diff_erank(series: dict[str, list[Run]]) -> dict[str, list[Run]]:
    """Each run's layers get diff_erank and diff_erank_pooled: erank (erank_pooled) at the model's step0
    minus its own; without a step0, diff_erank from the layer's erank_init and diff_erank_pooled null
    (isojax.run.sweep_files.add_diff_erank)."""
    for rs in series.values():
        base = next((r for r in rs if r.step == 0), None)
        for measure in ("erank", "erank_pooled"):
            first = {} if base is None else {str(layer.get("name")): number(layer.get(measure))
                                             for layer in base.data["layers"]}
            for run in rs:
                for layer in run.data["layers"]:
                    if base is not None:
                        start = first.get(str(layer.get("name")), math.nan)
                    else:
                        start = number(layer.get("erank_init")) if measure == "erank" else math.nan
                    d = start - number(layer.get(measure))
                    layer[f"diff_{measure}"] = d if math.isfinite(d) else None
    return series


def _tables(runs: list[Run]) -> list[Item]:
    items = []
    rogue = [[r.label, n, *[layer.get(f"rogue_{k}_{i}") for i in (1, 2, 3) for k in ("dim", "share")],
              layer.get("rogue_share_top3")] for r in runs for n, layer in
             zip(layer_names(r), r.data["layers"]) if layer.get("rogue_dims")]
    if rogue:
        items.append(Item("The top 3 rogue dimensions of each layer (Timkey & van Schijndel 2021): the dimension and "
                          "its share of InterSim; final checkpoints.",
                          Table(["model", "layer", "dim 1", "share 1", "dim 2", "share 2", "dim 3", "share 3",
                                 "top 3"], rogue), fold=True))
    keys = ("massive_max", "massive_dim", "massive_token", "massive_position", "massive_max_over_sample_median")
    massive = [[r.label, n, *[layer.get(k) for k in keys]] for r in runs
               for n, layer in zip(layer_names(r), r.data["layers"]) if layer.get("massive_max") is not None]
    if massive:
        items.append(Item("The largest |activation| of each layer (Sun et al. 2024): its dimension, token id and "
                          "position in its sequence, and its ratio to the sample's median |x|; final checkpoints.",
                          Table(["model", "layer", *keys], massive), fold=True))
    keys = ("massive_count", "massive_sequences", "massive_dims", "massive_first_share", "massive_delimiter_share",
            "massive_top1", "massive_top2", "massive_top3", "massive_median")
    per_sequence = [[r.label, n, *[layer.get(k) for k in keys]] for r in runs
                    for n, layer in zip(layer_names(r), r.data["layers"]) if layer.get("massive_count") is not None]
    if per_sequence:
        items.append(Item("Massive activations as Sun et al. 2024 define them, on the sentence probe's sentences: "
                          "|x| > 100 and at least 1000x its sequence's median |x|; their count, the sequences having "
                          "one, their dimensions (dim:count), their shares at the first position and at delimiters, "
                          "and the top-3 and median |x| averaged over sequences; final checkpoints.",
                          Table(["model", "layer", *keys], per_sequence), fold=True))
    return items


def _read(path: pathlib.Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log(f"report: {path} left out: unreadable ({e})")
        return None


def _cka_runs(figs: Figures, runs: list[Run]):
    panels, rows, drawn = [], [], []
    for run in runs:
        doc = _read(run.folder / "cka.json") if run.folder and (run.folder / "cka.json").exists() else None
        if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list) or not doc.get("matrix"):
            continue
        names = [str(n) for n in doc["layers"]]
        panels.append((f"{run_label(run)} ({doc.get('tokens')} tokens)", doc["matrix"], names, names))
        rows += [[run.label, a, b, number(v)] for a, row in zip(names, doc["matrix"]) for b, v in zip(names, row)]
        drawn.append(run)
    if not panels:
        return None
    fig = paper.heatmaps(panels, "layer", "layer", titled("Linear CKA between layers", drawn, final=True))
    return figs.add(fig, "cka_layers", "Linear CKA (Kornblith et al. 2019) between every pair of layers, on the "
                    "sampled states (`cka.json`); final checkpoints.", Table(["model", "layer", "layer", "cka"], rows))


def _sweep_cka(series: dict[str, list[Run]]) -> dict[str, dict]:
    """Each model's entry of the sweep_cka.json at the top of its sweep (OUT/<model>/<revision>/), by model."""
    docs = {}
    for rs in series.values():
        for run in rs:
            path = run.folder.parent.parent / "sweep_cka.json" if run.folder else None
            if path is not None and path.exists() and path not in docs:
                docs[path] = _read(path)
    entries = {}
    for rs in series.values():
        entry = next((d[m] for d in docs.values() if isinstance(d, dict) for m in d
                      if m.lower() == rs[0].model.lower() and isinstance(d[m], dict)), None)
        if entry is not None:
            entries[rs[0].model] = entry
    return entries


def _against_final(figs: Figures, series: dict[str, list[Run]], entries: dict[str, dict], value, ylabel: str,
                   column: str, name: str, caption: str):
    """A few layers of each model across training against themselves at its final checkpoint, from its
    sweep_cka.json entry: value(entry, revision, j) of layer j (None where absent); `column` its table's."""
    panels, rows, drawn = [], [], []
    for rs in series.values():
        entry = entries.get(rs[0].model)
        if entry is None:
            continue
        names = [str(n) for n in entry.get("layers") or []]
        lines = []
        for i, layer in enumerate(_band_layers(names)):
            j = names.index(layer)
            ys = [number(value(entry, r.revision, j)) for r in rs]
            lines.append(paper.Line(layer, [r.step for r in rs], ys, {"color": f"C{i}"}))
            rows += [[rs[0].label, r.revision, r.step, layer, y] for r, y in zip(rs, ys)]
        if any(math.isfinite(number(y)) for line in lines for y in line.y):
            panels.append(paper.Panel(f"{rs[0].label} against {entry.get('final')}", lines))
            drawn += rs
    if not panels:
        return None
    fig = paper.lines(panels, "training step", ylabel, titled("Each layer against itself at the final "
                      "checkpoint", drawn), ncols=2, width=6.0)
    return figs.add(fig, name, caption, Table(["model", "revision", "step", "layer", column], rows))


def _cka_training(figs: Figures, series: dict[str, list[Run]]) -> list:
    """Across training, from sweep_cka.json: linear CKA, then each to_final measure (its "to_final")."""
    entries = _sweep_cka(series)

    def linear(entry, revision, j):
        m = entry["checkpoints"].get(revision) or []
        return m[j][j] if len(m) > j else None
    items = [_against_final(figs, series, entries, linear, "linear CKA", "cka", "cka_training",
                            "Linear CKA of a layer at each checkpoint with the same layer at the final checkpoint, on "
                            "the same sampled tokens (`sweep_cka.json`).")]
    for name in registered.to_final():
        def value(entry, revision, j, name=name):
            values = ((entry.get("to_final") or {}).get(name) or {}).get(revision) or []
            return values[j] if len(values) > j else None
        items.append(_against_final(figs, series, entries, value, dict(SIMILARITIES).get(name, name), name,
                                    f"{name}_to_final_training",
                                    f"`{name}` ({registered.MEASURES[name].paper}) of a layer at each checkpoint with "
                                    "the same layer at the final checkpoint, on the same sampled tokens "
                                    f"(`{name}_to_final` of `sweep.csv`; `sweep_cka.json`'s `to_final`)."))
    return [i for i in items if i]


def _tokens_array(run: Run, name: str):
    """tokens.zarr/<name> of a run's folder as numpy; None where it has none or it cannot be read."""
    path = run.folder / "tokens.zarr" / name if run.folder else None
    if path is None or not path.is_dir():
        return None
    from isojax.run.sweep_files import _read_small
    try:
        return _read_small(path)
    except Exception as e:  # noqa: BLE001 - a damaged array leaves its figure out, not the report
        log(f"report: {path} left out: unreadable ({type(e).__name__}: {e})")
        return None


def _per_token(figs: Figures, runs: list[Run]) -> list:
    """Each registered per-token metric (tokens.zarr [S, V]) against the token's frequency: its mean over
    the token types whose count lies in [lo, 2·lo), for the embedding, a middle block, the last block
    and the final LayerNorm (as Macocco et al. 2025 draw the norm against frequency); final checkpoints."""
    items = []
    for metric in registered.per_token():
        panels, rows, drawn = [], [], []
        for run in runs:
            names, values, count = layer_names(run), _tokens_array(run, metric.name), _tokens_array(run, "count")
            if values is None or count is None or values.shape != (len(names), len(count)) or not count.any():
                continue
            los = [1 << k for k in range(int(count.max()).bit_length())]
            lines = []
            for i, name in enumerate(_band_layers(names)):
                v = values[names.index(name)]
                ys = []
                for lo in los:
                    sel = (count >= lo) & (count < 2 * lo) & np.isfinite(v)
                    ys.append(float(v[sel].mean()) if sel.any() else math.nan)
                    rows.append([run.label, name, lo, 2 * lo, int(sel.sum()), ys[-1]])
                lines.append(paper.Line(name, los, ys, {"color": f"C{i}"}))
            panels.append(paper.Panel(run_label(run), lines))
            drawn.append(run)
        if panels:
            fig = paper.lines(panels, "token count (band lower bound)", f"{metric.label} ({metric.unit})",
                              titled(f"{metric.label} against token frequency", drawn, final=True), xscale="log2")
            items.append(figs.add(fig, f"{metric.name}_by_frequency", f"{metric.label} (`tokens.zarr/{metric.name}`) "
                                  "averaged over the token types whose count lies in [lo, 2·lo), for the embedding, "
                                  "a middle block, the last block and the final LayerNorm; final checkpoints.",
                                  Table(["model", "layer", "band lo", "band hi", "token types", metric.name], rows)))
    return items


def section(res: Results, figs: Figures) -> Section:
    sec = Section("measures", "Isotropy, outliers, spectrum and similarity of representations",
                  "Standardized InterSim (Timkey & van Schijndel 2021), massive activations (Sun et al. 2024), "
                  "Diff-eRank's eRank on the sentence probe's sentences, and the pooled eRank, each with its difference "
                  "from step0 (Wei et al. 2024), InterSim by position, linear CKA (Kornblith et al. 2019), "
                  + "; ".join(f"{', '.join(m.name for m in r.metrics)} ({r.paper})" for r in registered.MEASURES.values()
                            # massive activations, by position: named above; the sample: no metric of its own;
                            # those the paper's figures draw (InterSim, IntraSim, anisotropy): not here
                            if any(m.drawn for m in r.metrics) and not (r.step and r.step.layer_part))
                  + "; README \"Measures\" defines each.")
    runs = finals(res.extract)
    series = _with_diff_erank(trainings(res.extract))
    for key in SCALARS:
        sec.items += [i for i in (_by_layer(figs, runs, key, ""), _training(figs, series, key, "")) if i]
    has = lambda key: any(_has(r, key) for rs in series.values() for r in rs)
    sec.items += [i for i in (_training(figs, series, "diff_erank", "") if has("erank") else None,
                              _training(figs, series, "diff_erank_pooled", "") if has("erank_pooled") else None,
                              _position_bands(figs, runs, True),
                              _position_bands(figs, runs, False, series) if series else None,
                              _cka_runs(figs, runs)) if i]
    sec.items += _cka_training(figs, series)
    sec.items += _registered_keyed(figs, runs, series)
    sec.items += _per_token(figs, runs)
    sec.items += _tables(runs)
    if not sec.items:
        sec.note = "No extract results with these measures (results of an older isojax): section left out."
    return sec
