"""Finding and loading result folders, for `isojax.report` and `isojax.correlate`.

A result folder is any folder holding `metrics.json` (an extract run, `manifest.json` beside
it) and/or `weights.json` (a weights run, `arrays.npz` beside it), at any depth below the
paths given: single runs, sweeps of extract and weights (OUT/<model>/<revision>/; weights sweeps
before it wrote OUT/<revision>/, read too), or a mix. `correlation.json` files found the same way are kept too. A folder
whose results isojax is still moving in, or whose files differ from isojax's record of them, is
refused (isojax.run.outdir.check_results).

A run is identified by (model, revision) as every command names a checkpoint
(isojax.run.names.checkpoint_name: a preset name such as `pythia-70m` becomes its hub id
`EleutherAI/pythia-70m`; a local folder its name, a local revision folder DIR/step1000 (DIR's
name, step1000); names compare without case, as the hub does) and a missing revision is `main`. Extract runs must all come
from one corpus (the same `corpus_fingerprint` in their manifests): IntraSim and InterSim of
different text are not comparable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re

from isojax.log import log
from isojax.steps import RANDOM, step_of, weights_read
from isojax.run import outdir
from isojax.run.names import canonical_model, checkpoint_name, revision_name
from isojax.run.results import flat_layer
from isojax.errors import UserError

# Folders that never hold results; hidden ones (staging folders .partial-*, .tmp-*) are skipped too.
_SKIP = {"plots", "tokens.zarr", "figures", "checkpoint", "__pycache__"}
_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([mb])(?![a-z])", re.IGNORECASE)


def model_key(model: str) -> str:
    return canonical_model(model).lower()


def _named(data: dict, folder: pathlib.Path) -> tuple[str, str]:
    """(model, revision) of a result document, named as the commands name them now (results
    written before by a path, `weights --model DIR/step1000`, get DIR's name at step1000)."""
    model, revision = checkpoint_name(data.get("model") or folder.name, data.get("revision") or None)
    return model, revision_name(revision)


@dataclasses.dataclass
class Run:
    kind: str                  # "extract" (metrics.json) or "weights" (weights.json)
    folder: pathlib.Path
    data: dict                 # the metrics.json or weights.json document
    manifest: dict | None      # extract only
    model: str                 # canonical model name
    revision: str              # "main" when none was given
    label: str = ""            # short display name, unique within one Results

    @property
    def key(self) -> tuple[str, str]:
        return model_key(self.model), self.revision

    @property
    def step(self) -> int | None:
        return step_of(self.revision)

    @property
    def tied(self) -> bool:
        """A weights run of a model whose embedding is its unembedding (measured once)."""
        return self.data.get("tied") is True

    @property
    def random(self) -> bool:
        return self.data.get("weights") == RANDOM or self.model.startswith("random:")

    @property
    def weights_label(self) -> str:
        """random, initialization (step 0) or trained (isojax.steps); results written before say
        "pretrained" for every checkpoint (isojax.steps.weights_read); "" where the document says nothing."""
        return RANDOM if self.random else weights_read(self.data.get("weights"), self.revision) or ""

    @property
    def size(self) -> float:
        """Parameters, for ordering models: from the name ('1.4b'), else from the config."""
        m = _SIZE.search(self.model.split("/")[-1])
        if m:
            return float(m.group(1)) * (1e6 if m.group(2).lower() == "m" else 1e9)
        cfg = (self.manifest or {}).get("config") or {}
        try:
            L, d, V = int(cfg["num_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
            return 12.0 * L * d * d + 2.0 * V * d
        except (KeyError, TypeError, ValueError):
            return math.inf


@dataclasses.dataclass
class Results:
    extract: list[Run]
    weights: list[Run]
    correlations: list[tuple[pathlib.Path, list]]

    @property
    def runs(self) -> list[Run]:
        return self.extract + self.weights


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: unreadable JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None


def find(paths) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(result folders, correlation.json files) under `paths`, sorted, without duplicates."""
    folders, correlations = set(), set()
    for given in paths:
        p = pathlib.Path(given).expanduser()
        if not p.exists():
            raise UserError(f"{p}: no such file or folder")
        if p.is_file():
            if p.name in ("metrics.json", "weights.json"):
                folders.add(p.parent.resolve())
            elif p.suffix == ".json":
                correlations.add(p.resolve())
            else:
                raise UserError(f"{p}: expected a result folder, metrics.json, weights.json or a "
                                "correlation.json")
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP)
            if "metrics.json" in files or "weights.json" in files or outdir.JOURNAL in files:
                folders.add(pathlib.Path(root).resolve())  # a journal: a commit cut short, refused in load
            if "correlation.json" in files:
                correlations.add((pathlib.Path(root) / "correlation.json").resolve())
    return sorted(folders), sorted(correlations)


def _extract_run(folder: pathlib.Path) -> Run:
    path = folder / "metrics.json"
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list) or not all(
            isinstance(layer, dict) and "name" in layer for layer in data["layers"]):
        raise UserError(f"{path}: not an isojax metrics.json (needs a 'layers' list of named layers)")
    for layer in data["layers"]:  # nested metrics as flat keys, as layers.csv has them (rogue_share_1, ...)
        layer.update(flat_layer(layer))
    manifest = _read_json(folder / "manifest.json") if (folder / "manifest.json").exists() else None
    if manifest is not None and not isinstance(manifest, dict):
        raise UserError(f"{folder / 'manifest.json'}: not a JSON object")
    return Run("extract", folder, data, manifest, *_named(data, folder))


def _weights_run(folder: pathlib.Path) -> Run:
    path = folder / "weights.json"
    data = _read_json(path)
    if not isinstance(data, dict) or not any(k in data for k in ("embed_in", "embed_out", "final_ln", "tensors")):
        raise UserError(f"{path}: not an isojax weights.json (no embed_in, embed_out, final_ln or tensors)")
    return Run("weights", folder, data, None, *_named(data, folder))


def _check_unique(runs: list[Run]) -> None:
    seen: dict = {}
    for run in runs:
        if run.key in seen:
            raise UserError(f"two {run.kind} results for {run.model}@{run.revision}: {seen[run.key].folder} and "
                            f"{run.folder}; pass only one of them")
        seen[run.key] = run


def _check_corpora(runs: list[Run]) -> None:
    by_fp: dict[str, list[Run]] = {}
    unknown = []
    for run in runs:
        fp = (run.manifest or {}).get("corpus_fingerprint")
        (by_fp.setdefault(fp, []) if fp else unknown).append(run)
    if len(by_fp) > 1:
        parts = []
        groups = sorted(by_fp.items(), key=lambda kv: -len(kv[1]))
        said = [_corpus_said(rs[0].manifest or {}) for _, rs in groups]
        differ = [k for k in said[0] if len({repr(s.get(k)) for s in said}) > 1]
        for (fp, rs), s in zip(groups, said):
            what = ", ".join(f"{k} {_shown(s.get(k))}" for k in differ)
            names = ", ".join(str(r.folder) for r in rs[:4]) + (f" and {len(rs) - 4} more" if len(rs) > 4 else "")
            parts.append(f"corpus {fp}{f' ({what})' if what else ''}: {names}")
        why = f"they differ in {', '.join(differ)}" if differ else \
            "the same data and options: the files changed between the runs, or the tokenizers differ"
        raise UserError("extract results measured on different corpora (corpus_fingerprint in manifest.json) "
                        f"cannot be compared ({why}); " + "; ".join(parts))
    if unknown and by_fp:
        log(f"warning: no corpus_fingerprint in {len(unknown)} result(s) (e.g. {unknown[0].folder}); "
              "their corpus could not be checked")


def _corpus_said(manifest: dict) -> dict:
    """What a run's manifest says of its corpus, by the option that sets it (a manifest written
    before corpus_options: its data and max_tokens only)."""
    options = manifest.get("corpus_options") or {}
    settings = manifest.get("settings") or {}
    return {"--data": manifest.get("corpus"), "--unit": options.get("unit"), "--source": options.get("sources"),
            "--max-tokens": options.get("max_tokens", settings.get("max_tokens")), "--bos": settings.get("bos"),
            "--max-tokens-per-source": options.get("max_tokens_per_source")}


def _shown(value) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, int):
        return f"{value:,}"
    return ",".join(value) if isinstance(value, list) else str(value)


def _labels(runs: list[Run]) -> None:
    """Short labels ('pythia-70m'); the full name where two models would share one."""
    short = {}
    for run in runs:
        short.setdefault(run.model.rstrip("/").split("/")[-1] if not run.model.startswith("random:")
                         else run.model, set()).add(model_key(run.model))
    for run in runs:
        s = run.model.rstrip("/").split("/")[-1] if not run.model.startswith("random:") else run.model
        run.label = s if len(short[s]) == 1 else run.model


def load(paths) -> Results:
    """Every result under `paths`; UserError when none, unreadable, duplicated or of mixed corpora."""
    folders, corr_files = find(paths)
    if not folders and not corr_files:
        raise UserError(f"no results found in {', '.join(map(str, paths))}: expected folders holding "
                        "metrics.json (python -m isojax.extract) or weights.json (python -m isojax.weights)")
    extract, weights = [], []
    for folder in folders:
        # only whole results: no commit cut short, files as isojax's record names them (outdir)
        outdir.check_results(folder, reads=("metrics.json", "manifest.json", "weights.json"))
        if (folder / "metrics.json").exists():
            extract.append(_extract_run(folder))
        if (folder / "weights.json").exists():
            weights.append(_weights_run(folder))
    _check_corpora(extract)
    _check_unique(extract)
    _check_unique(weights)
    _labels(extract + weights)
    correlations = []
    for path in corr_files:
        doc = _read_json(path)
        if not isinstance(doc, list) or not all(isinstance(e, dict) and "metric" in e and "pearson" in e
                                                for e in doc):
            raise UserError(f"{path}: not a correlation.json of python -m isojax.correlate "
                            "(a list of entries with metric, pearson, spearman, kendall)")
        correlations.append((path, doc))
    return Results(extract, weights, correlations)


# ---- choosing runs and reading values ------------------------------------------------------

def revision_order(run: Run):
    """Training order: revisions naming a step (isojax.steps) by step, then other revisions by
    name, `main` (the final one) last."""
    return (0, run.step, "") if run.step is not None else (1, run.revision == "main", run.revision)


def by_model(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs grouped by model (ordered by size, then name), each group in training order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(model_key(run.model), []).append(run)
    ordered = sorted(groups.values(), key=lambda rs: (rs[0].size, rs[0].label))
    return {rs[0].model: sorted(rs, key=revision_order) for rs in ordered}


def finals(runs: list[Run]) -> list[Run]:
    """One run per model, the final checkpoint (`main`, else the last step), ordered by size."""
    return [rs[-1] for rs in by_model(runs).values()]


def trainings(runs: list[Run]) -> dict[str, list[Run]]:
    """Models with at least two revisions naming a step: those runs in step order (revisions that
    name none, such as main or OLMo-2's stage2-..., are not on the axis)."""
    out = {}
    for model, rs in by_model(runs).items():
        steps = [r for r in rs if r.step is not None]
        if len(steps) >= 2:
            out[model] = steps
    return out


def number(value) -> float:
    """A JSON value as float; NaN for null, missing, booleans and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def layer_names(run: Run) -> list[str]:
    return [str(layer.get("name")) for layer in run.data.get("layers") or []]


def resolve_layer(names: list[str], spec: str) -> str | None:
    """A layer by name, `block_L` (the last block), or index (negative from the end)."""
    if spec in names:
        return spec
    if spec == "block_L":
        blocks = [n for n in names if n.startswith("block_")]
        return blocks[-1] if blocks else None
    try:
        return names[int(spec)]
    except (ValueError, IndexError):
        return None


def layer_value(run: Run, metric: str, spec: str, layers: list[dict] | None = None) -> float:
    layers = (run.data.get("layers") or []) if layers is None else layers
    name = resolve_layer([str(layer.get("name")) for layer in layers], spec)
    for layer in layers:
        if name is not None and str(layer.get("name")) == name:
            return number(layer.get(metric))
    return math.nan


def weights_group(run: Run, group: str) -> dict | None:
    """A group of a weights.json ('embed_out', 'final_ln', or a --tensor NAME); a tied group
    ({"tied_to": "embed_in"}) is the group it names."""
    block = run.data.get(group)
    if isinstance(block, dict) and block.get("tied_to") in ("embed_in", "embed_out"):
        block = run.data.get(block["tied_to"])
    if not isinstance(block, dict):
        block = (run.data.get("tensors") or {}).get(group)
    return block if isinstance(block, dict) else None


def weights_value(run: Run, dotted: str) -> float:
    """'embed_out.isotropy' (of embed_in where tied; or 'NAME.metric' for --tensor runs)."""
    group, _, metric = dotted.rpartition(".")
    block = weights_group(run, group)
    return number(block.get(metric)) if block is not None else math.nan
