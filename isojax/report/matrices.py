"""Report sections from weights results (weights.json, arrays.npz): I(W) of the embedding and
unembedding across sizes and training (Figs 5-7), the final LayerNorm's norms (Figs 8-9) and
2-D SVD projections of the unembedding (Fig 10). Models of every family are drawn together,
labelled by model; a tied embedding, measured once, stands for both matrices and says "tied"."""

from __future__ import annotations

import math
import zipfile

import numpy as np

from isojax.errors import UserError
from isojax.plots import paper
from isojax.report.collect import Results, Run, finals, trainings, weights_value
from isojax.report.document import Figures, Item, Section, Table
from isojax.report.states import run_label, titled

_ISO = [("isotropy", "I(W)"), ("isotropy_centered", "I(W − mean)"), ("isotropy_pc_removed", "I, top PCs removed")]
_ISO_TABLE = ["isotropy", "isotropy_centered", "isotropy_pc_removed", "isotropy_scaled_centered", "mean_norm",
              "mean_vector_norm"]
_LN_TABLE = ["avgnorm_g", "avgnorm_b", "b_over_g", "gao_sum", "b_parallel_norm", "b_perp_norm"]


def _finite(runs: list[Run], dotted: str) -> list[Run]:
    return [r for r in runs if math.isfinite(weights_value(r, dotted))]


def _label(run: Run) -> str:
    return run_label(run) + (" (tied)" if run.tied else "")


def _family(run: Run) -> str:
    return str(run.data.get("family") or "")


def isotropy(res: Results, figs: Figures) -> Section:
    sec = Section("isotropy", "Isotropy I(W) of the embedding and unembedding",
                  "I(W) = min Z(c) / max Z(c), Z(c) = Σᵢ exp⟨c, Wᵢ⟩ over the eigenvectors c of WᵀW and their "
                  "negations (1 = isotropic); centered: the same for W minus its mean row; paper §4.2.")
    runs = finals(res.weights)
    for matrix, no in (("embed_out", "5"), ("embed_in", "6")):
        rs = _finite(runs, f"{matrix}.isotropy")
        if not rs:
            continue
        fig = paper.bars([_label(r) for r in rs],
                         [(label, [weights_value(r, f"{matrix}.{k}") for r in rs]) for k, label in _ISO],
                         "I(W)", titled(f"Isotropy of {matrix}", rs, final=True), ylim=(0, 1.08))
        rows = [[r.label, r.revision, _family(r), r.tied] + [weights_value(r, f"{matrix}.{k}") for k in _ISO_TABLE]
                for r in rs]
        tied = " Tied models (embedding = unembedding, measured once) are marked (tied)." if any(
            r.tied for r in rs) else ""
        sec.items.append(figs.add(fig, f"isotropy_{matrix}_sizes",
                                  f"I(W) of {matrix} uncentered, centered and with the top principal components "
                                  f"removed, per model (paper Fig. {no}).{tied}",
                                  Table(["model", "revision", "family", "tied"] + _ISO_TABLE, rows)))
    series = {m: _finite(rs, "embed_out.isotropy") for m, rs in trainings(res.weights).items()}
    series = {m: rs for m, rs in series.items() if len(rs) >= 2}
    if series:
        lines, rows = [], []
        for i, rs in enumerate(series.values()):
            steps = [r.step for r in rs]
            matrices = [("embed (tied)", "embed_in", ":")] if all(r.tied for r in rs) else \
                [("embed_out", "embed_out", "-"), ("embed_in", "embed_in", "--")]
            for name, matrix, dash in matrices:
                lines.append(paper.Line(f"{rs[0].label} {name}", steps,
                                        [weights_value(r, f"{matrix}.isotropy") for r in rs],
                                        {"color": f"C{i}", "linestyle": dash}))
            rows += [[r.label, r.revision, r.step] + [weights_value(r, k) for k in
                     ("embed_out.isotropy", "embed_out.isotropy_centered", "embed_in.isotropy")] for r in rs]
        fig = paper.lines([paper.Panel("", lines)], "training step", "I(W)",
                          titled("Isotropy during training", [r for rs in series.values() for r in rs]),
                          ncols=1, width=7.5)
        sec.items.append(figs.add(fig, "isotropy_training", "I(W) of the unembedding (solid) and embedding (dashed; "
                                  "dotted: one tied matrix) across training checkpoints (paper Fig. 7).",
                                  Table(["model", "revision", "step", "embed_out.isotropy",
                                         "embed_out.isotropy_centered", "embed_in.isotropy"], rows)))
    tensor_rows = [[r.label, r.revision, name] + [m.get(k) for k in _ISO_TABLE] for r in res.weights
                   for name, m in sorted((r.data.get("tensors") or {}).items()) if isinstance(m, dict)]
    if tensor_rows:
        sec.items.append(Item("Tensors measured with `--tensor`.",
                              Table(["model", "revision", "tensor"] + _ISO_TABLE, tensor_rows)))
    if not sec.items:
        sec.note = "No weights results (weights.json) with embed_in / embed_out: section left out."
    return sec


def _norm(run: Run) -> str:
    """The final norm's kind (weights.json before families: GPT-NeoX's LayerNorm)."""
    return str((run.data.get("final_ln") or {}).get("norm") or "layernorm")


def _norm_note(runs: list[Run], drawn: list[Run]) -> str:
    """What the figure cannot show: norms without a bias, models without final-norm weights."""
    no_bias = [r for r in drawn if not math.isfinite(weights_value(r, "final_ln.avgnorm_b"))]
    no_weights = [r for r in runs if r not in drawn and isinstance(r.data.get("final_ln"), dict)]
    return ((f" No bias b (n/a): {', '.join(f'{run_label(r)} ({_norm(r)})' for r in no_bias)}." if no_bias else "")
            + (f" No final-norm weights, not drawn: {', '.join(f'{run_label(r)} ({_norm(r)})' for r in no_weights)}."
               if no_weights else ""))


def layer_norm(res: Results, figs: Figures) -> Section:
    sec = Section("layernorm", "The final LayerNorm", "avgnorm(v) = ‖v‖/√d of the final LayerNorm's gain g and "
                  "bias b; b_over_g = ‖b‖/‖g‖, gao_sum = Σ bᵢ/gᵢ (Gao et al.'s condition); paper §4.3. An RMSNorm "
                  "(Llama, Mistral, Qwen2, OLMo-2) has g and no b; OLMo's final LayerNorm has neither.")
    rs = _finite(finals(res.weights), "final_ln.avgnorm_g")
    if rs:
        fig = paper.bars([run_label(r) for r in rs], [(k, [weights_value(r, f"final_ln.{k}") for r in rs])
                                                      for k in ("avgnorm_g", "avgnorm_b")],
                         "avgnorm", titled("Final LayerNorm g and b", rs, final=True))
        rows = [[r.label, r.revision, _norm(r)] + [weights_value(r, f"final_ln.{k}") for k in _LN_TABLE] for r in rs]
        sec.items.append(figs.add(fig, "layernorm_sizes", "avgnorm of g and b per model (paper Fig. 8)."
                                  + _norm_note(finals(res.weights), rs),
                                  Table(["model", "revision", "norm"] + _LN_TABLE, rows)))
    series = {m: _finite(rs, "final_ln.avgnorm_g") for m, rs in trainings(res.weights).items()}
    series = {m: rs for m, rs in series.items() if len(rs) >= 2}
    if series:
        lines, rows = [], []
        for i, rs in enumerate(series.values()):
            steps = [r.step for r in rs]
            lines.append(paper.Line(f"{rs[0].label} g", steps, [weights_value(r, "final_ln.avgnorm_g") for r in rs],
                                    {"color": f"C{i}"}))
            b = [weights_value(r, "final_ln.avgnorm_b") for r in rs]
            if any(math.isfinite(v) for v in b):  # an RMSNorm has no b
                lines.append(paper.Line(f"{rs[0].label} b", steps, b, {"color": f"C{i}", "linestyle": "--"}))
            rows += [[r.label, r.revision, r.step] + [weights_value(r, f"final_ln.{k}") for k in
                     ("avgnorm_g", "avgnorm_b", "b_over_g")] for r in rs]
        fig = paper.lines([paper.Panel("", lines)], "training step", "avgnorm",
                          titled("Final LayerNorm during training", [r for rs in series.values() for r in rs]),
                          ncols=1, width=7.5)
        sec.items.append(figs.add(fig, "layernorm_training", "avgnorm of g (solid) and b (dashed) across training "
                                  "checkpoints (paper Fig. 9).",
                                  Table(["model", "revision", "step", "avgnorm_g", "avgnorm_b", "b_over_g"], rows)))
    if not sec.items:
        sec.note = "No weights results with final LayerNorm statistics: section left out."
    return sec


def _proj(run: Run, key: str):
    path = run.folder / "arrays.npz"
    if not path.exists():
        return None
    try:
        with np.load(path) as arrays:
            return np.asarray(arrays[key]) if key in arrays.files else None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: unreadable ({e})") from None


def _svd_figure(figs: Figures, runs: list[Run], name: str, title: str, caption: str, ncols: int,
                final: bool = False):
    panels, rows, cells = [], [], []
    for variant in ("", "_centered"):
        for r in runs:
            xy = _proj(r, f"{'embed_in' if r.tied else 'embed_out'}_proj2d{variant}")  # tied: the one matrix
            cells.append((r, variant, xy))
    cells = [c for c in cells if c[2] is not None]
    if not cells:
        return None
    if ncols == 2:  # one model per row: uncentered beside centered
        cells.sort(key=lambda c: (runs.index(c[0]), c[1]))
    for r, variant, xy in cells:
        kind = "centered" if variant else "uncentered"
        panels.append((f"{_label(r)} — {kind}", xy))
        xy2 = np.asarray(xy, dtype=float).reshape(len(xy), -1)
        rows.append([r.label, r.revision, kind, len(xy2)] + [float(v) for v in xy2.mean(0)[:2]]
                    + [float(v) for v in xy2.std(0)[:2]])
    drawn = [r for r in runs if any(c[0] is r for c in cells)]
    fig = paper.scatters(panels, titled(title, drawn, final=final), ncols=ncols)
    return figs.add(fig, name, caption, Table(["model", "revision", "variant", "rows", "mean x", "mean y", "std x",
                                               "std y"], rows))


def svd(res: Results, figs: Figures) -> Section:
    sec = Section("svd", "2-D SVD projections of the unembedding",
                  "Rows of embed_out projected on its first two singular directions, coloured by token id; "
                  "centered: after subtracting the mean row; paper §4.4.")
    item = _svd_figure(figs, finals(res.weights), "svd2d_embed_out", "embed_out",
                       "2-D SVD projections of the unembedding of each model (paper Fig. 10).", 2, final=True)
    if item:
        sec.items.append(item)
    for model, rs in trainings(res.weights).items():
        picks = sorted({round(i * (len(rs) - 1) / 5) for i in range(6)}) if len(rs) > 6 else range(len(rs))
        chosen = [rs[i] for i in picks]
        item = _svd_figure(figs, chosen, f"svd2d_embed_out_training_{rs[0].label}", f"{rs[0].label}: embed_out "
                           "during training", f"2-D SVD projections of {rs[0].label}'s unembedding across training "
                           "(top: uncentered, bottom: centered).", len(chosen))
        if item:
            sec.items.append(item)
    if not sec.items:
        sec.note = "No weights results with arrays.npz projections: section left out."
    return sec
