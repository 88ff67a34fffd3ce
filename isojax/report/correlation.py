"""The report's correlation section (paper Table 1): entries of correlation.json files among the
inputs, or computed here from `--scores` with the correlate command's defaults."""

from __future__ import annotations

from isojax.report.correlate import EXACT_MAX_N
from isojax.report.document import Item, Section, Table

# Shown first when present: the paper's Table 1 metric, then InterSim / IntraSim of the last layers.
_PREFERRED = [("embed_out.isotropy", None), ("inter_sim", "final_ln"), ("intra_sim", "final_ln"),
              ("inter_sim", "block_L"), ("intra_sim", "block_L")]
_MAX_PIVOTS = 6


def _f(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def _stat(e: dict, name: str) -> tuple:
    """(coefficient, p) of one statistic of an entry, both null where either is: correlation.json
    files of earlier versions gave p = 0 beside a null coefficient when a score was NaN."""
    block = e.get(name) or {}
    c, p = block.get({"pearson": "r", "spearman": "rho", "kendall": "tau"}[name]), block.get("p")
    return (c, p) if c is not None and p is not None else (None, None)


def _n(e: dict):
    """The finite points of an entry (earlier versions' n counted NaN scores too, written as null)."""
    points = e.get("points")
    if not isinstance(points, list):
        return e.get("n")
    return sum(1 for pt in points if pt.get("value") is not None and pt.get("score") is not None)


ALPHA = 0.05  # a coefficient whose two-sided p is at least this is marked "ns" (not significant)
_SYMBOL = {"pearson": "r", "spearman": "ρ", "kendall": "τ"}


def _marked(c, p) -> str:
    return "–" if c is None else _f(c) + (" ns" if p >= ALPHA else "")


def _pivot(entries: list[dict]) -> Table:
    """Rows: tasks; columns: per group n, then Pearson, Spearman, Kendall each beside its p (the layout
    of Table 1, with what a reader needs to weigh each coefficient)."""
    groups = list(dict.fromkeys(e["group"] for e in entries))
    tasks = list(dict.fromkeys(e["task"] for e in sorted(entries, key=lambda e: e["task"])))
    cells = {(e["group"], e["task"]): e for e in entries}
    rows = []
    for task in tasks:
        row = [task]
        for g in groups:
            e = cells.get((g, task))
            row += [""] * 7 if e is None else [_n(e)] + [text for s in _SYMBOL for text in (
                _marked(*_stat(e, s)), _f(_stat(e, s)[1], ".2g"))]
        rows.append(row)
    columns = ["task"] + [f"{g} {c}" for g in groups for c in ("n", *(x for s in _SYMBOL.values() for x in (s, "p")))]
    return Table(columns, rows)


def _full(entries: list[dict]) -> Table:
    rows = [[e.get("by"), e.get("group"), e.get("task"), e["metric"], e.get("layer_name") or e.get("layer") or "",
             _n(e), *(text for s in ("pearson", "spearman", "kendall")
                           for text in (_f(_stat(e, s)[0]), _f(_stat(e, s)[1], ".2g")))]
            for e in entries]
    return Table(["by", "group", "task", "metric", "layer", "n", "pearson r", "p", "spearman ρ", "p", "kendall τ",
                  "p"], rows)


def section(entries: list[dict], sources: list[str]) -> Section:
    sec = Section("correlation", "Correlation with downstream scores",
                  "Pearson r, Spearman ρ and Kendall τ-b between a metric and a downstream score across "
                  "checkpoints of each model (paper §5.4, Table 1; step0 left out as there) or across models. "
                  f"From: {', '.join(sources)}.")
    if not entries:
        sec.note = ("No correlation.json among the inputs and no --scores given: section left out "
                    "(python -m isojax.correlate writes one).")
        return sec
    keys = list(dict.fromkeys((e["metric"], e.get("layer"), e.get("by")) for e in entries))
    preferred = [k for m, layer in _PREFERRED for k in keys if k[:2] == (m, layer)]
    for metric, layer, by in (preferred + [k for k in keys if k not in preferred])[:_MAX_PIVOTS]:
        chosen = [e for e in entries if (e["metric"], e.get("layer"), e.get("by")) == (metric, layer, by)]
        what = metric + (f" at {layer}" if layer else "")
        sec.items.append(Item(f"{what} vs downstream scores, by {by}: n, then r, ρ, τ each with its p, per "
                              f"{'model' if by == 'checkpoint' else 'revision'}; ns: not significant (p ≥ {ALPHA}, "
                              f"two-sided; exact over all n! orderings for n ≤ {EXACT_MAX_N}).", _pivot(chosen)))
    sec.items.append(Item(f"All {len(entries)} correlations with p-values.", _full(entries), fold=True))
    return sec
