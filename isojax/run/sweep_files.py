"""The files at a sweep's top, beside its step folders: sweep.csv (and sweep.parquet with
--format parquet), one row per (model, revision, layer) with every scalar layer measure,
`diff_erank` and `diff_erank_pooled`; sweep_cka.json, each checkpoint's layers against the final
checkpoint's on the same sampled tokens. Plain data: no JAX here (isojax.load reads sweeps with it too).

diff_erank (Wei et al. 2024, *Diff-eRank*: the effective rank of the untrained model's
representations minus the trained model's; positive: training removed redundant dimensions):
`erank` (the sentence probe's, stats/sentences.py) of the model's step0 checkpoint minus this
checkpoint's, per layer, on the same sentences (the probe's subset depends on the token cache and
row length alone); diff_erank_pooled the same of `erank_pooled`. The paper's baseline is the
untrained model: where the sweep has no step0 of a model, diff_erank is taken from the row's own
`erank_init` (the same sentences through a random initialization of the config, seed recorded in
metrics.json: run/measure.py) and diff_erank_pooled is null (a random initialization's pooled
eRank would need a run of its own), with a log line. Null too where either lacks the measure. README "Measures" says how erank_pooled differs from the paper's per-sentence quantity.

sweep_cka.json: {MODEL: {"final": REVISION, "layers": [names], "tokens": K,
"checkpoints": {REVISION: [[CKA(layer i at REVISION, layer j at final) for j] for i] or null}}}
(linear CKA, Kornblith et al. 2019, float64 on a JAX device: isojax.stats.cross_cka, imported only
where sweep_cka.json is built), from each step's samples.zarr/states [S, K, D] (extract
--sample-states), each read once. The sample holds the K tokens of smallest
key, a hash of the token's sequence and position (isojax.stats.sample), in key order: the same
tokens in the same order at every checkpoint of one model over one corpus. A checkpoint is
compared only where that holds as far as the files tell (same corpus fingerprint, token count,
K and layer names); else its entry is null, with a log line. A model whose final checkpoint has
no sample is null.

Beyond linear CKA, the registered pairs measures with `to_final` (cka_debiased, procrustes_distance,
svcca: isojax.stats.measures, their own float64 read-outs) of each state against the same state of
the final checkpoint, on the same sampled tokens, where every finished step of the model read the
measure out (its manifest's `measures`, the --measure it ran with: whatever job of a sharded or
resumed sweep measured it); a measure only some steps read out is left out for that model, with a
log line. In the model's entry "to_final": {NAME: {REVISION: [value per state] or null}} (absent
where no such measure was read out), and in sweep.csv the column NAME_to_final (present where any
step of the sweep read the measure out; null where not computed): with no step reading one out, both
files are as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from isojax.log import log
from isojax.steps import step_of


def revision_order(revision: str):
    """Training order of revisions: those naming a step by step, then the others by name, `main` last."""
    step = step_of(revision)
    return (0, step, "") if step is not None else (1, revision == "main", revision)


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


INIT_SEED = 0  # the random initialization behind erank_init (run/measure.py)


def add_diff_erank(rows: list[dict], layer_key: str = "name") -> list[dict]:
    """Each row (model, revision, `layer_key`, erank, erank_pooled, ...) gets diff_erank (Wei et al.'s,
    from the sentence probe's erank) and diff_erank_pooled: that measure of its model's step0 at that
    layer minus its own; without a step0, diff_erank is the row's erank_init minus its erank and
    diff_erank_pooled null (one log line per model); and diff_erank_baseline: "step0",
    "random-init-seed0" (INIT_SEED), or None where neither baseline exists."""
    has_step0 = {row.get("model") for row in rows if step_of(str(row.get("revision"))) == 0}
    for measure in ("erank", "erank_pooled"):
        untrained: dict = {}
        for row in rows:
            if step_of(str(row.get("revision"))) == 0:
                untrained[row.get("model"), row.get(layer_key)] = _number(row.get(measure))
        for row in rows:
            if row.get("model") in has_step0:
                base = untrained.get((row.get("model"), row.get(layer_key)), math.nan)
            else:
                base = _number(row.get("erank_init")) if measure == "erank" else math.nan
            d = base - _number(row.get(measure))
            row[f"diff_{measure}"] = d if math.isfinite(d) else None
    for model in dict.fromkeys(row.get("model") for row in rows):
        if model not in has_step0:
            init = any(math.isfinite(_number(r.get("erank_init"))) for r in rows if r.get("model") == model)
            log(f"{model}: no step0 in the sweep (its untrained model, Diff-eRank's baseline): diff_erank "
                + ("from a random initialization of its config (erank_init), " if init else "null (no erank_init: "
                   "--sentence-probe measures it), ") + "diff_erank_pooled null")
    for row in rows:  # which baseline: a column, not a comment line CSV readers would trip on
        if row.get("model") in has_step0:
            row["diff_erank_baseline"] = "step0"
        elif row.get("diff_erank") is not None:
            row["diff_erank_baseline"] = f"random-init-seed{INIT_SEED}"
        else:
            row["diff_erank_baseline"] = None
    return rows


def read_sample(folder: Path) -> np.ndarray | None:
    """samples.zarr/states [S, K, D] float32 of a step folder; None where it has none."""
    path = Path(folder) / "samples.zarr" / "states"
    if not path.is_dir():
        return None
    import tensorstore as ts
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    return np.asarray(ts.open(spec, open=True).result().read().result())


def _read_small(path: Path) -> np.ndarray | None:
    if not path.is_dir():
        return None
    import tensorstore as ts
    return np.asarray(ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}},
                              open=True).result().read().result())


def read_sample_keys(folder: Path) -> np.ndarray | None:
    """samples.zarr/keys [K, 2] uint32 of a step folder (each sampled token's key, stats/sample.py);
    None where it has none (no sample, or written before the keys were)."""
    return _read_small(Path(folder) / "samples.zarr" / "keys")


def read_sample_tokens(folder: Path) -> dict | None:
    """Which tokens a run folder's sample holds, in the order of samples.zarr/states' K axis:
    {"sequence_ids": int64 (index in the token cache), "positions": int32, "token_ids": int32} [K]
    from samples.zarr; None where it has none (no sample, a multi-process run, or written before
    they were: its keys alone say which tokens)."""
    from isojax.stats.sample import IDENTITY
    arrays = {name: _read_small(Path(folder) / "samples.zarr" / name) for name in IDENTITY}
    return None if any(a is None for a in arrays.values()) else arrays


def _manifest(folder: Path) -> dict:
    """A step folder's manifest.json ({} without one); unreadable: UserError naming it."""
    path = Path(folder) / "manifest.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        from isojax.errors import UserError
        raise UserError(f"{path}: unreadable ({e}); measure that step again, or move its folder out of the "
                        "sweep") from None


LATER = ("row length", "skip positions", "BOS", "dtype", "sampled tokens' keys",
         "sampled tokens")  # recorded or checked since issue 45


def _describe(folder: Path) -> dict:
    """What must match between two checkpoints for their samples to hold the same tokens, measured
    alike: corpus, token count, layers, the row length (windows), the positions left out, the BOS, the dtype,
    the sampled tokens' keys (a sha256 of samples.zarr/keys) and the sampled tokens themselves (a
    sha256 of their sequence ids, positions and token ids). Those of LATER are not compared where a
    folder written before them lacks them (None): the keys alone are compared then."""
    import hashlib
    metrics = json.loads((folder / "metrics.json").read_text())
    manifest = _manifest(folder)
    settings = manifest.get("settings") or {}
    keys, tokens = read_sample_keys(folder), read_sample_tokens(folder)
    digest = lambda arrays: hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()[:16]
    return {"corpus fingerprint": manifest.get("corpus_fingerprint"), "tokens": metrics.get("tokens"),
            "layers": [layer.get("name") for layer in metrics.get("layers") or []],
            "row length": settings.get("row_len"), "skip positions": settings.get("skip_positions"),
            "BOS": settings.get("bos"), "dtype": settings.get("dtype"),
            "sampled tokens' keys": None if keys is None else digest([keys]),
            "sampled tokens": None if tokens is None else digest(tokens.values())}


def damaged_sample(folder: Path) -> str | None:
    """Why a step folder's samples.zarr cannot be read as isojax wrote it (a file missing, or its
    sha256 not the record's: a flipped byte would change the CKA silently), or None."""
    from isojax.errors import UserError
    from isojax.run import outdir
    record = outdir.read_record(folder) or {"files": {}}
    try:
        outdir.check_results(folder, reads=[rel for rel in record["files"] if rel.startswith("samples.zarr/")])
    except UserError as e:
        return str(e)
    return None


def read_out(folder: Path) -> list[str]:
    """The to_final measures (stats.measures.to_final) that a step folder's run read out: those on by
    default and those its manifest's `measures` names (--measure); where a manifest written before
    they were recorded lacks it, those with a value at any state of its metrics.json."""
    from isojax.stats.measures import MEASURES, to_final
    folder = Path(folder)
    manifest = _manifest(folder)
    if isinstance(manifest.get("measures"), list):
        return [name for name in to_final() if MEASURES[name].on_by_default or name in manifest["measures"]]
    layers = json.loads((folder / "metrics.json").read_text()).get("layers") or []
    return [name for name in to_final() if any(layer.get(name) is not None for layer in layers)]


def _read_out_by_all(model: str, steps: list[tuple[str, Path]]) -> list[str]:
    """The to_final measures that every step of the model read out; a log line for each only some did."""
    have = [read_out(folder) for _, folder in steps]
    agreed = []
    for name in dict.fromkeys(n for names in have for n in names):
        count = sum(name in names for names in have)
        if count == len(have):
            agreed.append(name)
        else:
            log(f"sweep: {name}_to_final of {model} is null: {count} of its {len(have)} checkpoints read "
                f"{name} out (--measure {name} at every step of the model measures it)")
    return agreed


def sweep_cka(checkpoints: dict[str, list[tuple[str, Path]]]) -> dict:
    """sweep_cka.json's document from {model: [(revision, step folder), ...]} (finished steps); a
    sample that is not as isojax wrote it (damaged_sample) is left out, with a log line."""
    doc = {}
    for model, steps in checkpoints.items():
        steps = sorted(steps, key=lambda s: revision_order(s[0]))
        final_rev, final_dir = steps[-1]
        damaged = damaged_sample(final_dir)
        final = None if damaged else read_sample(final_dir)
        if final is None:
            log(f"sweep_cka.json: {model} is null: its final checkpoint {final_rev} "
                + (damaged or "has no sample (extract --sample-states K)"))
            doc[model] = None
            continue
        from isojax.stats.cross_cka import CkaAgainst, to_reference  # JAX only here: isojax.load imports this module
        against = CkaAgainst(final)
        want = _describe(final_dir)
        entry = {"final": final_rev, "layers": want["layers"], "tokens": int(final.shape[1]), "checkpoints": {}}
        names = _read_out_by_all(model, steps)
        if names:
            entry["to_final"] = {name: {} for name in names}
        for revision, folder in steps:
            damaged = None if folder == final_dir else damaged_sample(folder)
            states = final if folder == final_dir else None if damaged else read_sample(folder)
            have = _describe(folder) if not damaged else {}
            why = (damaged or "it has no sample (extract --sample-states K)") if states is None else next(
                (f"its {k} differs from {final_rev}'s ({have[k]} vs {want[k]})" for k in want
                 if have[k] != want[k] and not (k in LATER and None in (have[k], want[k]))),
                None) or (f"its sample holds {states.shape[1]} tokens, {final_rev}'s {final.shape[1]}"
                          if states.shape[1] != final.shape[1] else None)
            if why:
                log(f"sweep_cka.json: {model} @ {revision} is null: {why}")
                entry["checkpoints"][revision] = None
            else:
                entry["checkpoints"][revision] = against.matrix(states)
            measured = to_reference(names, states, final) if names and not why else {}
            for name in names:
                entry["to_final"][name][revision] = measured.get(name)
        doc[model] = entry
    return doc


def add_to_final(rows: list[dict], doc: dict, folders: list[Path]) -> list[dict]:
    """Each sweep.csv row (model, revision, name: the layer) gets NAME_to_final for each to_final
    measure that a step folder of `folders` read out: sweep_cka.json's `doc` "to_final" value of its
    model, revision and layer, null where not computed. No column where no step read one out."""
    from isojax.stats.measures import to_final
    have = {name for folder in folders for name in read_out(folder)}
    names = [name for name in to_final() if name in have]
    for row in rows:
        entry = doc.get(row.get("model")) or {}
        layers = entry.get("layers") or []
        for name in names:
            values = ((entry.get("to_final") or {}).get(name) or {}).get(row.get("revision"))
            at = layers.index(row["name"]) if row.get("name") in layers else None
            row[f"{name}_to_final"] = values[at] if values and at is not None else None
    return rows
