"""Results as data: `isojax.load(path)` -> a pandas DataFrame, one row per run x layer.

    df = isojax.load("out/70m")             # a run: extract --out out/70m
    df = isojax.load("out/sweep")           # a sweep: OUT/<model>/<revision>/ (and OUT/sweep.csv)
    df.pivot(index=["model", "step"], columns="layer", values="inter_sim")

Columns: model, revision, step (the training step the revision names, else null), layer (its name,
an ordered categorical: embed, block_1, block_2, ..., final_ln, so sorting and pivoting keep the
model's order), layer_index (0 = embed), tokens, run (the run's folder relative to the path loaded,
"." for a run folder itself), the run's settings (SETTINGS: from its metrics.json and manifest.json;
null where they do not say), then every measure of the layer as layers.csv has it
(isojax.run.results.flat_layer: rogue_dim_1, rogue_share_1, ..., inter_sim_pos_0, ...) and, for the
checkpoints of a sweep, diff_erank, diff_erank_pooled and diff_erank_baseline (isojax.run.sweep_files;
a sweep read from its sweep.csv also has that file's NAME_to_final columns).
A measure a run lacks is NaN/None in its rows; a renamed one (results.RENAMED) is read under its new name.

A folder may hold several runs (OUT/a/, OUT/b/, or a sweep's OUT/<model>/<revision>/): each keeps
its own rows, told apart by `run` and the settings, never merged. The diff_erank columns compare checkpoints,
so only runs laid out as a sweep lays them out (OUT/<model>/<revision>/, the folder named by the
run's revision) get it, computed among the checkpoints of one model folder; a run elsewhere has
none. A sweep is read from its step folders' metrics.json (whole results only, as isojax's record
says); a sweep folder whose step folders are gone is read from its sweep.csv.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from isojax.errors import UserError
from isojax.run import outdir
from isojax.run.names import checkpoint_name, folder_name, revision_name
from isojax.run.results import BEFORE_FLOOR, RENAMED, flat_layer
from isojax.run.sweep_files import add_diff_erank, revision_order
from isojax.steps import step_of

HEAD = ["model", "revision", "step", "layer", "layer_index", "tokens", "run"]
# a run's settings that change its numbers: metrics.json's keys, then manifest.json's "settings"
SETTINGS = ["weights", "unit", "dtype", "skip_positions", "bos", "max_tokens", "corpus_fingerprint"]
_SKIP = {"plots", "tokens.zarr", "samples.zarr", "checkpoint", "figures", "__pycache__"}


def layer_order(name: str):
    """The model's order of state names: embed, block_1, block_2, ..., final_ln, then any other."""
    m = re.fullmatch(r"block_(\d+)", name)
    return (0, 0, "") if name == "embed" else (1, int(m.group(1)), "") if m else \
        (2, 0, "") if name == "final_ln" else (3, 0, name)


def _read_json(folder: Path, name: str):
    path = folder / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None


def _read_metrics(folder: Path) -> tuple[dict, dict]:
    """metrics.json and the manifest's settings ({} without a manifest)."""
    outdir.check_results(folder, reads=("metrics.json", "manifest.json"))
    doc = _read_json(folder, "metrics.json")
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list) or not all(
            isinstance(layer, dict) and "name" in layer for layer in doc["layers"]):
        raise UserError(f"{folder / 'metrics.json'}: not an isojax metrics.json "
                        "(needs a 'layers' list of named layers)")
    manifest = _read_json(folder, "manifest.json") if (folder / "manifest.json").is_file() else {}
    manifest = manifest if isinstance(manifest, dict) else {}
    settings = manifest.get("settings") if isinstance(manifest.get("settings"), dict) else {}
    return doc, {**settings, "corpus_fingerprint": manifest.get("corpus_fingerprint")}


def run_rows(folder: Path, run: str = ".") -> list[dict]:
    """The rows of one run folder (its metrics.json), `run` naming it."""
    doc, settings = _read_metrics(folder)
    model, revision = checkpoint_name(doc.get("model") or folder.name, doc.get("revision") or None)
    revision = revision_name(revision)
    setting = {k: doc.get(k, settings.get(k)) for k in SETTINGS}
    rows = []
    for i, layer in enumerate(doc["layers"]):
        measures = flat_layer(layer)
        name = measures.pop("name")
        rows.append({"model": model, "revision": revision, "step": step_of(revision), "layer": str(name),
                     "layer_index": i, "tokens": doc.get("tokens"), "run": run, **setting, **measures})
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


def _folder_rows(root: Path, folders: list[Path]) -> list[dict]:
    """Every run's rows; diff_erank_pooled among the checkpoints of one model folder of a sweep
    (OUT/<model>/<revision>/, each folder named by its run's revision)."""
    sweeps: dict[Path, list[dict]] = {}
    apart = []
    for folder in folders:
        rows = run_rows(folder, folder.relative_to(root).as_posix())
        in_sweep = rows and folder.parent != root and folder.name == rows[0]["revision"]
        (sweeps.setdefault(folder.parent, []) if in_sweep else apart).extend(rows)
    return [row for rows in sweeps.values() for row in add_diff_erank(rows, layer_key="layer")] + apart


def _from_sweep_csv(path: Path):
    import pandas as pd
    outdir.check_results(path.parent, reads=(path.name,))
    df = pd.read_csv(path).rename(columns={"name": "layer", **RENAMED})
    df["layer_index"] = df.groupby(["model", "revision"], sort=False).cumcount()
    df["run"] = [f"{folder_name(str(m))}/{revision_name(r)}" for m, r in zip(df["model"], df["revision"])]
    # rows written before the spectral floor (results.flat_layer): their changed measures are n/a, and
    # the older diff_erank (effective_rank from the first checkpoint) is not diff_erank_pooled
    before = df["null_eigenvalues"].isna() if "null_eigenvalues" in df.columns else pd.Series(True, index=df.index)
    for key in (*BEFORE_FLOOR, "diff_erank"):
        if key in df.columns:
            df[key] = df[key].where(~before)
    return df


def _frame(rows: list[dict]):
    import pandas as pd
    rows = sorted(rows, key=lambda r: (r["model"], revision_order(r["revision"]), r["run"], r["layer_index"]))
    return pd.DataFrame(rows)


def _ordered(df):
    import pandas as pd
    head = HEAD + [c for c in SETTINGS if c in df.columns]
    df = df[head + [c for c in df.columns if c not in head]].copy()
    df["step"] = df["step"].astype("Int64")
    names = sorted(set(df["layer"].astype(str)), key=layer_order)
    df["layer"] = pd.Categorical(df["layer"].astype(str), categories=names, ordered=True)
    return df


def load(path):
    """A run folder (metrics.json) or a folder of runs or a sweep (step folders OUT/<model>/<revision>/,
    or sweep.csv) -> pandas DataFrame, one row per run x layer (see the module's docstring)."""
    p = Path(path).expanduser()
    if p.is_file() and p.name in ("metrics.json", "sweep.csv"):
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{p}: no such folder" if not p.exists() else
                        f"{p}: expected a run folder (metrics.json) or a sweep folder (sweep.csv)")
    if (p / "metrics.json").exists():
        df = _frame(run_rows(p))
    elif steps := _step_folders(p):
        df = _frame(_folder_rows(p, steps))
    elif (p / "sweep.csv").exists():
        df = _from_sweep_csv(p / "sweep.csv")
    else:
        raise UserError(f"{p} holds no isojax results: expected metrics.json (a run) or a sweep's sweep.csv "
                        "and OUT/<model>/<revision>/metrics.json")
    return _ordered(df)
