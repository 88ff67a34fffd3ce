"""Results as data: `isojax.load(path)` -> a pandas DataFrame, one row per checkpoint x layer.

    df = isojax.load("out/70m")             # a run: extract --out out/70m
    df = isojax.load("out/sweep")           # a sweep: OUT/<model>/<revision>/ (and OUT/sweep.csv)
    df.pivot(index="step", columns="layer", values="inter_sim")

Columns: model, revision, step (the training step the revision names, else null), layer (its
name), layer_index (0 = embed), tokens, then every measure of the layer as layers.csv has it
(isojax.run.results.flat_layer: rogue_dim_1, rogue_share_1, ..., inter_sim_pos_0, ...) and, for
a sweep, diff_erank_pooled (isojax.run.sweep_files). A measure a run lacks is NaN/None in its rows.
A sweep is read from its step folders' metrics.json (whole results only, as isojax's record says);
a sweep folder whose step folders are gone is read from its sweep.csv.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from isojax.errors import UserError
from isojax.run import outdir
from isojax.run.names import checkpoint_name, revision_name
from isojax.run.results import BEFORE_FLOOR, flat_layer
from isojax.run.sweep_files import add_diff_erank, revision_order
from isojax.steps import step_of

HEAD = ["model", "revision", "step", "layer", "layer_index", "tokens"]
_SKIP = {"plots", "tokens.zarr", "samples.zarr", "checkpoint", "figures", "__pycache__"}


def _read_metrics(folder: Path) -> dict:
    outdir.check_results(folder, reads=("metrics.json",))
    path = folder / "metrics.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list) or not all(
            isinstance(layer, dict) and "name" in layer for layer in doc["layers"]):
        raise UserError(f"{path}: not an isojax metrics.json (needs a 'layers' list of named layers)")
    return doc


def run_rows(folder: Path) -> list[dict]:
    """The rows of one run folder (its metrics.json)."""
    doc = _read_metrics(folder)
    model, revision = checkpoint_name(doc.get("model") or folder.name, doc.get("revision") or None)
    revision = revision_name(revision)
    rows = []
    for i, layer in enumerate(doc["layers"]):
        measures = flat_layer(layer)
        name = measures.pop("name")
        rows.append({"model": model, "revision": revision, "step": step_of(revision), "layer": str(name),
                     "layer_index": i, "tokens": doc.get("tokens"), **measures})
    return rows


def _step_folders(root: Path) -> list[Path]:
    """Folders holding metrics.json below `root`, at most two levels down (OUT/<model>/<revision>/)."""
    found = []
    for here, dirs, files in os.walk(root):
        depth = len(Path(here).relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP) if depth < 2 else []
        if depth and "metrics.json" in files:
            found.append(Path(here))
    return found


def _from_sweep_csv(path: Path):
    import pandas as pd
    outdir.check_results(path.parent, reads=(path.name,))
    df = pd.read_csv(path).rename(columns={"name": "layer"})
    df["layer_index"] = df.groupby(["model", "revision"], sort=False).cumcount()
    # rows written before the spectral floor (results.flat_layer): their changed measures are n/a, and
    # the older diff_erank (effective_rank from the first checkpoint) is not diff_erank_pooled
    before = df["null_eigenvalues"].isna() if "null_eigenvalues" in df.columns else pd.Series(True, index=df.index)
    for key in (*BEFORE_FLOOR, "diff_erank"):
        if key in df.columns:
            df[key] = df[key].where(~before)
    return df


def _frame(rows: list[dict]):
    import pandas as pd
    rows = sorted(rows, key=lambda r: (r["model"], revision_order(r["revision"]), r["layer_index"]))
    df = pd.DataFrame(rows)
    return df[HEAD + [c for c in df.columns if c not in HEAD]]


def load(path):
    """A run folder (metrics.json) or a sweep folder (step folders OUT/<model>/<revision>/, or
    sweep.csv) -> pandas DataFrame, one row per checkpoint x layer (see the module's docstring)."""
    p = Path(path).expanduser()
    if p.is_file() and p.name in ("metrics.json", "sweep.csv"):
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{p}: no such folder" if not p.exists() else
                        f"{p}: expected a run folder (metrics.json) or a sweep folder (sweep.csv)")
    if (p / "metrics.json").exists():
        df = _frame(run_rows(p))
    elif steps := _step_folders(p):
        df = _frame(add_diff_erank([row for folder in steps for row in run_rows(folder)], layer_key="layer"))
    elif (p / "sweep.csv").exists():
        df = _from_sweep_csv(p / "sweep.csv")
    else:
        raise UserError(f"{p} holds no isojax results: expected metrics.json (a run) or a sweep's sweep.csv "
                        "and OUT/<model>/<revision>/metrics.json")
    df["step"] = df["step"].astype("Int64")
    return df
