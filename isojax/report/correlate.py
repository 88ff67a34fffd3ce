"""Correlation of isotropy metrics with downstream scores: `python -m isojax.correlate`.
Length: one command end to end (reading series, scores, the permutation tests, the table), read top down.

    python -m isojax.correlate out/sweep out/weights-sweep --scores lm-eval-out/ --out correlation.json

Series: any scalar layer metric of extract results at any layer (`--metric inter_sim --layer
final_ln`; `block_L` is the last block whatever the depth), or any weights metric as
`GROUP.METRIC` (`embed_out.isotropy`, `final_ln.avgnorm_b`). `--by checkpoint` (default, the
paper's Table 1) correlates each model's checkpoints; `--by model` the models at each revision.
As in the paper, step0 (random initialization) is left out unless `--include-step0`.

Scores: lm-evaluation-harness results files (`results_*.json`: `results` per task with keys
`METRIC,FILTER`; the model from `config.model_args` `pretrained=`/`revision=`, else
`model_name` and `config.model_revision`; each numeric metric becomes a task named
TASK/METRIC, plus [FILTER] unless the filter is `none` and @Nshot when few-shot:
`sciq/acc`, `sciq/acc_norm@5shot`, `gsm8k/exact_match[strict-match]@5shot`) or a CSV with the
columns model,revision,task,score (revision empty = main). Results and scores meet on
(model, revision), preset names matching hub ids; a result without its scores is an error
unless `--allow-missing`.

Output: a list of entries {metric, layer, layer_name, task, by, group, n, pearson: {r, p},
spearman: {rho, p}, kendall: {tau, p} (tau-b), p_method, points: [...]}. Only points whose
metric and score are both finite count (n; the log names a series that lost any); a coefficient
and its p are null together where undefined (fewer than 3 finite points, a constant series).
p is two-sided. For n <= 8, p_method is "permutation": the exact p, the share of all n!
orderings of the scores whose statistic is at least as far from 0, so the smallest possible p
is 1/n! for Pearson and 2/n! for Spearman and Kendall (the reversed ranks reach the same
|statistic|): at n = 3, 1/6 and 1/3. Above, "scipy": scipy.stats' values, asymptotic for
Pearson and Spearman (rough below n ~ 10; Kendall's is exact without ties up to n = 33).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import itertools
import json
import math
import pathlib
import sys
import warnings

import numpy as np

from isojax.log import log
from isojax.run import outdir
from isojax.errors import ArgumentParser, UserError, run_command
from isojax.report import collect
from isojax.report.collect import Results, Run, model_key
from isojax.run.names import checkpoint_name

CSV_COLUMNS = ("model", "revision", "task", "score")
DEFAULT_LAYERS = ("block_L", "final_ln")
WEIGHT_GROUPS = ("embed_in", "embed_out", "final_ln")
_NOT_METRICS = {"count", "intra_tokens", "rows", "dim", "pc_removed_D", "null_eigenvalues", "erank_sentences",
                "massive_dim", "massive_token", "massive_position", "rogue_dim_1", "rogue_dim_2", "rogue_dim_3"}  # ids
_MIN_POINTS = 3
EXACT_MAX_N = 8  # p by all n! orderings up to here (40,320 at 8: milliseconds); scipy's above


@dataclasses.dataclass(frozen=True)
class Score:
    model: str
    revision: str
    task: str
    value: float
    source: str


@dataclasses.dataclass(frozen=True)
class Spec:
    metric: str
    layer: str | None  # None: a weights metric GROUP.METRIC


# ---- scores ----------------------------------------------------------------------------------

def _model_args(args) -> dict:
    if isinstance(args, dict):
        return {str(k): v for k, v in args.items()}
    out = {}
    for part in str(args or "").split(","):
        key, eq, value = part.partition("=")
        if eq:
            out[key.strip()] = value.strip()
    return out


def _checkpoint(model, revision) -> tuple[str, str]:
    """(model, revision) of a score as every command names the checkpoint (isojax.run.names), so a
    local checkpoint's path (lm-eval's pretrained=/ckpts/tiny/step1000, where lm-eval says revision
    main) meets the run `tiny @ step1000`, and a hub id or preset its run as before."""
    revision = str(revision or "").strip()
    name, revision = checkpoint_name(str(model).strip(), None if revision in ("", "main") else revision)
    return name, collect.revision_name(revision)


def parse_lm_eval(doc, source: str) -> list[Score]:
    """Scores of one lm-evaluation-harness results document (one model, one revision)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        raise UserError(f"{source}: not an lm-evaluation-harness results file (no 'results' object)")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    args = _model_args(config.get("model_args"))
    model = args.get("pretrained") or args.get("model") or args.get("path") or doc.get("model_name")
    if not model:
        raise UserError(f"{source}: no model name (config.model_args pretrained=..., or model_name)")
    model, revision = _checkpoint(model, args.get("revision") or config.get("model_revision"))
    shots = doc.get("n-shot") if isinstance(doc.get("n-shot"), dict) else {}
    scores = {}
    for block in ("results", "groups"):
        for task, metrics in (doc.get(block) or {}).items():
            if not isinstance(metrics, dict):
                continue
            for key, value in metrics.items():
                name, _, filt = str(key).partition(",")
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or "_stderr" in name
                        or name in ("sample_len", "sample_count")):
                    continue
                label = f"{task}/{name}" + (f"[{filt}]" if filt and filt != "none" else "")
                if shots.get(task):
                    label += f"@{shots[task]}shot"
                scores[label] = Score(model, revision, label, float(value), source)
    return list(scores.values())


def parse_csv(path: pathlib.Path) -> list[Score]:
    """model,revision,task,score (header required; an empty revision is `main`)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise UserError(f"{path}: a scores CSV needs the columns {','.join(CSV_COLUMNS)} "
                                f"(missing {', '.join(missing)})")
            out = []
            for row in reader:
                where = f"{path}:{reader.line_num}"
                try:
                    value = float(row["score"])
                except (TypeError, ValueError):
                    raise UserError(f"{where}: score {row['score']!r} is not a number") from None
                if not (row["model"] or "").strip() or not (row["task"] or "").strip():
                    raise UserError(f"{where}: empty model or task")
                out.append(Score(*_checkpoint(row["model"], row["revision"]), row["task"].strip(), value, where))
            return out
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path}: unreadable CSV ({e})") from None


def load_scores(paths) -> list[Score]:
    """Scores from files (.json lm-eval results, .csv) and folders (their results*.json and .csv)."""
    files = []
    for given in paths:
        p = pathlib.Path(given).expanduser()
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file() and (
                q.suffix == ".csv" or (q.suffix == ".json" and q.name.startswith("results"))))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"--scores {p}: no such file or folder")
    if not files:
        raise UserError(f"no scores found in {', '.join(map(str, paths))} (lm-eval results_*.json or .csv)")
    scores, seen = [], {}
    for f in files:
        if f.suffix == ".csv":
            batch = parse_csv(f)
        else:
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise UserError(f"{f}: unreadable JSON ({e})") from None
            batch = parse_lm_eval(doc, str(f))
        for s in batch:
            key = (model_key(s.model), s.revision, s.task)
            if key in seen and seen[key].value != s.value:
                raise UserError(f"two scores for {s.model}@{s.revision} {s.task}: {seen[key].value} in "
                                f"{seen[key].source} and {s.value} in {s.source}")
            if key not in seen:
                seen[key] = s
                scores.append(s)
    return scores


# ---- series ----------------------------------------------------------------------------------

def _numeric_keys(blocks) -> list[str]:
    keys = {}
    for block in blocks:
        for k, v in block.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_METRICS:
                keys[k] = True
    return list(keys)


def layer_metrics(results: Results) -> list[str]:
    return _numeric_keys(layer for r in results.extract for layer in r.data.get("layers") or [])


def weights_metrics(results: Results) -> list[str]:
    names = {}
    for r in results.weights:
        groups = {g: collect.weights_group(r, g) for g in WEIGHT_GROUPS if collect.weights_group(r, g)}
        groups.update({t: m for t, m in (r.data.get("tensors") or {}).items() if isinstance(m, dict)})
        for g, block in groups.items():
            names.update({f"{g}.{k}": True for k in _numeric_keys([block])})
    return list(names)


def specs(results: Results, metrics=(), layers=()) -> list[Spec]:
    """(metric, layer) pairs: the defaults, or those asked for (validated against the results).

    Defaults: every layer metric at `layers` (default block_L and final_ln) and, unless layers
    were asked for, every weights metric."""
    have_layer, have_weights = layer_metrics(results), weights_metrics(results)
    for layer in layers:
        if not any(collect.resolve_layer(collect.layer_names(r), layer) for r in results.extract):
            raise UserError(f"no layer {layer!r} in the results (names such as embed, block_3, final_ln, "
                            "block_L for the last block, or an index)")
    at = list(layers) or list(DEFAULT_LAYERS)
    if not metrics:
        return [Spec(m, layer) for m in have_layer for layer in at] + (
            [] if layers else [Spec(m, None) for m in have_weights])
    out = []
    for m in metrics:
        if m in have_weights:
            out.append(Spec(m, None))
        elif m in have_layer:
            out += [Spec(m, layer) for layer in at]
        else:
            raise UserError(f"no metric {m!r} in the results; layer metrics: {', '.join(have_layer) or 'none'}; "
                            f"weights metrics: {', '.join(have_weights) or 'none'}")
    return out


def value(run: Run, spec: Spec) -> float:
    return collect.weights_value(run, spec.metric) if spec.layer is None else collect.layer_value(
        run, spec.metric, spec.layer)


# ---- correlation -----------------------------------------------------------------------------

def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


@functools.lru_cache(maxsize=None)
def _orderings(n: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(n))), dtype=np.int8)  # [n!, n]


def permutation_p(x, y) -> dict[str, float | None]:
    """Exact two-sided p-values of Pearson r, Spearman rho and Kendall tau-b: the share of all n!
    orderings of y whose statistic is at least as far from 0 as the observed one (ties and all).
    None where the statistic is undefined (a constant series)."""
    from scipy.stats import rankdata
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    perm = _orderings(len(x))
    i, j = np.triu_indices(len(x), 1)

    def share(stat_P: np.ndarray, scale: float):
        # each statistic is a fixed positive scale times stat_P (y's mean, spread and ties do not
        # move under reordering); the identity ordering (row 0) is the observed one
        if scale == 0:
            return None
        return float(np.mean(np.abs(stat_P) >= np.abs(stat_P[0]) * (1 - 1e-9)))

    def linear(a, b):
        a, b = a - a.mean(), b - b.mean()
        return share(b[perm] @ a, float(np.sqrt((a * a).sum() * (b * b).sum())))

    sx = np.sign(x[i] - x[j])
    sy_P = np.sign(y[perm][:, i] - y[perm][:, j])
    return {"pearson": linear(x, y), "spearman": linear(rankdata(x), rankdata(y)),
            "kendall": share(sy_P @ sx, float(np.abs(sx).sum() * np.abs(sy_P[0]).sum()))}


def statistics(x, y) -> dict:
    """Pearson r, Spearman rho, Kendall tau-b (scipy.stats), each with its two-sided p-value:
    exact (permutation_p, all n! orderings) for n <= EXACT_MAX_N, else scipy's, whose Pearson and
    Spearman values are asymptotic (rough below n ~ 10); `p_method` says which. Only finite
    pairs count: below _MIN_POINTS of them, or where a statistic is undefined (a constant
    series), its coefficient and p are null together."""
    from scipy import stats
    pairs = [(float(a), float(b)) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < _MIN_POINTS:
        return {"pearson": {"r": None, "p": None}, "spearman": {"rho": None, "p": None},
                "kendall": {"tau": None, "p": None}, "p_method": None}
    x, y = (np.array(v) for v in zip(*pairs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant series gives NaN (null), which says enough
        pr, sr, kt = stats.pearsonr(x, y), stats.spearmanr(x, y), stats.kendalltau(x, y)
    p = {"pearson": pr.pvalue, "spearman": sr.pvalue, "kendall": kt.pvalue}
    exact = len(x) <= EXACT_MAX_N
    if exact:
        p = {k: math.nan if v is None else v for k, v in permutation_p(x, y).items()}
    out = {"p_method": "permutation" if exact else "scipy"}
    for name, coef, stat in (("pearson", "r", pr), ("spearman", "rho", sr), ("kendall", "tau", kt)):
        c, pv = _num(stat.statistic), _num(p[name])
        out[name] = {coef: c, "p": pv} if c is not None and pv is not None else {coef: None, "p": None}
    return out


def _task_selected(task: str, wanted) -> bool:
    return not wanted or any(task == w or task.split("/")[0] == w for w in wanted)


def _score_table(scores: list[Score], tasks) -> dict[tuple, dict[str, Score]]:
    """(model key, revision) -> {task: score}, for the tasks asked for."""
    table: dict[tuple, dict[str, Score]] = {}
    for s in scores:
        if _task_selected(s.task, tasks):
            table.setdefault((model_key(s.model), s.revision), {})[s.task] = s
    return table


def _check_missing(runs: list[Run], table: dict, scores: list[Score], tasks, allow_missing: bool) -> None:
    """Every run needs a score for each task its model was scored on (else error, or warning)."""
    model_tasks: dict[str, set] = {}
    for (m, _), by_task in table.items():
        model_tasks.setdefault(m, set()).update(by_task)
    if not any(model_key(r.model) in model_tasks for r in runs):
        named = sorted({s.model for s in scores if _task_selected(s.task, tasks)})
        which = f" of the tasks {', '.join(tasks)}" if tasks else ""
        raise UserError(f"no score matches a result: the scores{which} name {', '.join(named[:6]) or 'no model'}; "
                        "the results are "
                        f"{', '.join(sorted({r.model for r in runs})[:6]) or 'none'}")
    missing = []
    for r in runs:
        lack = sorted(model_tasks.get(model_key(r.model), {"(any task)"}) - set(table.get(r.key, {})))
        if lack:
            more = " …" if len(lack) > 3 else ""
            missing.append(f"{r.model}@{r.revision} ({r.folder}): {', '.join(lack[:3])}{more}")
    if missing and not allow_missing:
        raise UserError(f"no downstream score for {len(missing)} result(s) (--allow-missing skips them): "
                        + "; ".join(missing[:5]) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for line in missing:
        log(f"warning: skipped, no score: {line}")


def _groups(runs: list[Run], by: str) -> list[tuple[str, list[Run]]]:
    """checkpoint: per model (by size), its revisions in training order; model: per revision
    (in training order), its models by size."""
    if by == "checkpoint":
        return [(model, rs) for model, rs in collect.by_model(runs).items()]
    groups: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (r.size, r.label)):
        groups.setdefault(r.revision, []).append(r)
    return sorted(groups.items(), key=lambda kv: collect.revision_order(kv[1][0]))


def correlate(results: Results, scores: list[Score], wanted_specs: list[Spec], tasks=(), by: str = "checkpoint",
              allow_missing: bool = False, include_step0: bool = False) -> list[dict]:
    """correlation.json entries: one per (spec, group, task) with at least 3 scored points; n and
    the statistics count the finite ones."""
    if by not in ("checkpoint", "model"):
        raise UserError(f"--by must be checkpoint or model, not {by!r}")
    kinds = {"weights" if s.layer is None else "extract" for s in wanted_specs}
    runs = [r for r in results.runs if r.kind in kinds and (include_step0 or r.step != 0)]
    table = _score_table(scores, tasks)
    _check_missing(runs, table, scores, tasks, allow_missing)
    entries, short = [], 0
    for spec in wanted_specs:
        kind = "weights" if spec.layer is None else "extract"
        for group, members in _groups([r for r in runs if r.kind == kind], by):
            for task in sorted(set().union(*(table.get(r.key, {}) for r in members))):
                scored = [(r, value(r, spec), table[r.key][task].value)
                          for r in members if task in table.get(r.key, {})]
                if len(scored) < _MIN_POINTS:
                    short += 1
                    continue
                # only finite pairs count (a NaN score; intra_sim of --no-token-stats runs)
                points = [p for p in scored if math.isfinite(p[1]) and math.isfinite(p[2])]
                if len(points) < len(scored):
                    what = spec.metric + (f" at {spec.layer}" if spec.layer else "")
                    log(f"{task} ~ {what} ({group}): {len(scored) - len(points)} of {len(scored)} points left out, "
                        "their score or metric is NaN or infinite" + ("" if len(points) >= _MIN_POINTS else
                        f"; fewer than {_MIN_POINTS} finite points, so every coefficient and p is null"))
                names = {collect.resolve_layer(collect.layer_names(r), spec.layer)
                         for r, _, _ in points} if spec.layer else set()
                entries.append({"metric": spec.metric, "layer": spec.layer,
                                "layer_name": names.pop() if len(names) == 1 else None,
                                "task": task, "by": by, "group": group, "n": len(points),
                                **statistics([p[1] for p in points], [p[2] for p in points]),
                                "points": [{"model": r.model, "revision": r.revision, "step": r.step, "value": v,
                                            "score": sc} for r, v, sc in points]})
    if short:
        log(f"{short} series with fewer than {_MIN_POINTS} points were left out")
    return entries


def format_table(entries: list[dict]) -> str:
    def f(x, spec=".3f"):
        return "–" if x is None else format(x, spec)
    head = ["by", "group", "task", "metric", "layer", "n", "pearson r (p)", "spearman rho (p)", "kendall tau (p)"]
    rows = [[e["by"], e["group"], e["task"], e["metric"], e.get("layer_name") or e.get("layer") or "", str(e["n"]),
             f"{f(e['pearson']['r'])} ({f(e['pearson']['p'], '.2g')})",
             f"{f(e['spearman']['rho'])} ({f(e['spearman']['p'], '.2g')})",
             f"{f(e['kendall']['tau'])} ({f(e['kendall']['p'], '.2g')})"] for e in entries]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + rows)


def write_json(path: pathlib.Path, entries: list[dict], overwrite: bool) -> None:
    """Written in one rename (temporary file, fsync, rename): a failure leaves the earlier file.
    An existing file is replaced only with overwrite. NaN and inf (a degenerate series) -> null."""
    from isojax.atomic import write_atomic
    from isojax.run.results import json_safe
    outdir.check_path(path, folder=False)
    outdir.refuse_earlier(path, path.exists(), overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, json.dumps(json_safe(entries), indent=1, allow_nan=False) + "\n")
    except OSError as e:
        if outdir.disk_full(e):
            raise UserError(f"disk full writing {path}; free some space and run again") from None
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def _split(values) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def run(args) -> None:
    from isojax import storage
    storage.local_only(args, "correlate")
    # before any work: --out a file name, writable, none of the inputs nor inside an input folder
    outdir.check_path(pathlib.Path(args.out), [*args.results, *args.scores], folder=False)
    results = collect.load(args.results)
    if not results.runs:
        raise UserError("no extract or weights results among the inputs")
    entries = correlate(results, load_scores(args.scores), specs(results, _split(args.metric), _split(args.layer)),
                        tasks=_split(args.task), by=args.by, allow_missing=args.allow_missing,
                        include_step0=args.include_step0)
    if not entries:
        raise UserError(f"nothing to correlate: every series has fewer than {_MIN_POINTS} points with scores")
    write_json(pathlib.Path(args.out), entries, args.overwrite)
    print(format_table(entries))
    log(f"{len(entries)} correlations written to {args.out}")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m isojax.correlate", description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", metavar="RESULTS",
                    help="result folders (searched recursively for metrics.json / weights.json)")
    ap.add_argument("--scores", action="append", required=True, metavar="FILE_OR_DIR",
                    help="lm-eval results JSON, a folder of them, or a CSV model,revision,task,score; repeatable")
    ap.add_argument("--metric", action="append", metavar="NAME",
                    help="layer metric (inter_sim, intra_sim, anisotropy, ...) or weights metric GROUP.METRIC "
                         "(embed_out.isotropy); repeatable or comma-separated; default: all")
    ap.add_argument("--layer", action="append", metavar="NAME",
                    help="layer of layer metrics: a name, block_L (last block) or an index; "
                         "default: block_L,final_ln")
    ap.add_argument("--task", action="append", metavar="NAME",
                    help="keep these tasks (a task name keeps all its metrics: sciq -> sciq/acc, sciq/acc_norm)")
    ap.add_argument("--by", choices=("checkpoint", "model"), default="checkpoint",
                    help="checkpoint: across each model's revisions (default); model: across models per revision")
    ap.add_argument("--include-step0", action="store_true", help="keep step0 (the paper leaves it out)")
    ap.add_argument("--allow-missing", action="store_true", help="skip results without scores (with a warning)")
    ap.add_argument("--out", default="correlation.json", metavar="FILE", help="default: correlation.json")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return ap


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
