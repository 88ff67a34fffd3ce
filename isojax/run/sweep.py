"""Runs over training checkpoints and model sizes: `extract --model A --model B --revisions R1,R2`
or `--paper-steps`, and `weights --model A --revisions ...` alike.
Length: a sweep's whole life (layout, resume, the pipelined saving, shards) in one place, read together.

Every (model, revision) is measured into OUT/<model>/<revision>/ (isojax.run.names: the model's
name with '/' as '--', a preset as its hub id; revision `main` when none), then OUT/sweep.csv
gathers every finished step, one row per (model, revision[, layer]). The corpus is tokenized once
(Pythia models share a tokenizer, so they share the token cache); while one checkpoint is measured
a background thread fetches the next unfinished one into Hugging Face's cache. A step whose folder
holds its result (metrics.json, weights.json) is done: a killed sweep, run again with the same
arguments and --resume, skips the finished steps without downloading them and resumes the
unfinished one from its checkpoint; an extract sweep refuses a corpus or --max-tokens other than
the finished steps' (sweep.csv would mix them). --delete-downloads removes from the Hugging Face
cache what the sweep downloaded for a step once it is measured (isojax.hf.cache).

A sweep across a cluster: `--shard I/N` (I = 0 ... N-1: a SLURM job array --array=0-(N-1) gives
I as $SLURM_ARRAY_TASK_ID) measures every N-th step of the sweep's (model, revision) list, from
its I-th, so N jobs share one sweep and one OUT. Each step folder is locked while it is measured
(outdir: flock, freed when its process dies), OUT itself only while the sweep's checks run and
while its files are rebuilt: a step another live job is measuring is skipped with a log line (two
jobs given one shard divide its steps; no step is measured twice at once). Every job, its steps done, rebuilds sweep.csv (sweep.parquet, sweep_cka.json, weights'
plots) from every finished step folder of the whole sweep and says how many are still missing, so
the last job to finish writes the complete files. A killed job's steps are missing until its
shard runs again with --resume.

Offline stand-ins for the hub: a local directory with one subfolder per revision
(DIR/step1000/, DIR/step2000/, each a Hugging Face checkpoint) is read as a repository:
`--model DIR --revisions step1000,step2000` (and `--model DIR --revision step1000` alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from pathlib import Path

from isojax.device import checkpoints as checkpointing
from isojax.run import outdir
from isojax.device import mesh as parallel
from isojax import faults
from isojax.errors import UserError, explain
from isojax.log import log
from isojax.run.timings import in_background
from isojax.run.config import MeasureConfig
from isojax.steps import local_revision, step_of
from isojax.run.names import canonical_model, checkpoint_name, revision_name, step_folder


def check_revisions(model: str, revisions: list[str | None]) -> None:
    """Refuse unknown revisions before anything runs (hub: its branches and tags, when the hub
    is reachable; local stand-ins: their subfolders)."""
    if Path(model).expanduser().is_dir():
        for r in revisions:
            local_revision(model, r)
        return
    from isojax.hf.family.presets import base_preset, hub_id
    from isojax.hf.network import hub_reachable
    wanted = [r for r in revisions if r is not None and not re.fullmatch(r"[0-9a-f]{40}", r)]
    if not wanted or model.startswith("random:") or not hub_reachable():
        return
    import huggingface_hub
    repo = hub_id(model) if base_preset(model) else model
    try:
        refs = huggingface_hub.HfApi().list_repo_refs(repo)
    except Exception as e:  # network trouble: loading will say precisely
        from huggingface_hub import errors
        if isinstance(e, (errors.RepositoryNotFoundError, errors.GatedRepoError)):
            from isojax.hf.network import hub_error
            raise hub_error(e, repo, None) from None
        log(f"could not list the revisions of {repo} ({type(e).__name__}); checking them one by one")
        return
    known = {b.name for b in refs.branches} | {t.name for t in refs.tags}
    missing = [r for r in wanted if r not in known]
    if missing:
        steps = sorted((k for k in known if step_of(k) is not None), key=step_of)
        others = sorted(k for k in known if step_of(k) is None)
        shown = others + (steps if len(steps) <= 12 else [*steps[:5], "…", *steps[-5:]])
        raise UserError(f"{repo} has no revision {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''} "
                        f"(it has {len(known)} branches and tags: {', '.join(shown)})")


@dataclasses.dataclass(frozen=True)
class Step:
    """One checkpoint of a sweep: --model as given, a revision, and its result folder."""
    model: str
    revision: str | None
    folder: Path

    @property
    def name(self) -> tuple[str, str | None]:
        return checkpoint_name(self.model, self.revision)

    @property
    def local(self) -> Path | None:
        return local_revision(self.model, self.revision)

    @property
    def repo(self) -> str | None:
        """The hub repository it downloads from (None: random weights or a local folder)."""
        if self.model.startswith("random:") or Path(self.model).expanduser().is_dir():
            return None
        return canonical_model(self.model)


def plan(models: list[str], revisions: list[str | None], out: Path) -> list[Step]:
    """Every (model, revision), revisions checked before anything runs; two that would share a result
    folder (a preset and its hub id) are refused."""
    for m in models:
        check_revisions(m, revisions)
    steps, seen = [], {}
    for m in models:
        for r in revisions:
            step = Step(m, r, step_folder(out, m, r))
            if step.folder in seen:
                raise UserError(f"{seen[step.folder]} and {m} @ {revision_name(r)} are the same checkpoint "
                                f"({step.folder}); give it once")
            seen[step.folder] = f"{m} @ {revision_name(r)}"
            steps.append(step)
    return steps


def parse_shard(text: str | None, sweep: bool) -> tuple[int, int]:
    """--shard I/N -> (I, N), I from 0 to N-1; None -> (0, 1), the whole sweep."""
    if text is None:
        return 0, 1
    if not sweep:
        raise UserError("--shard applies to sweeps (--revisions, --paper-steps or several --model)")
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or int(m[2]) < 1 or int(m[1]) >= int(m[2]):
        raise UserError(f"--shard {text}: give I/N with N >= 1 and I from 0 to N-1 (0/3, 1/3 and 2/3 split a sweep "
                        "over 3 jobs)")
    return int(m[1]), int(m[2])


def finished(steps: list[Step], result: str) -> list[Step]:
    """The steps whose folder holds `result`, its commit complete (a folder whose commit was cut short
    is not done: its next claim puts the earlier results back). The result is looked for before the
    journal: a commit moves the result in, then removes its journal."""
    return [s for s in steps if (s.folder / result).exists() and not (s.folder / outdir.JOURNAL).exists()]


def run_steps(steps: list[Step], out: Path, *, result: str, measure, fetch, resume: bool, overwrite: bool,
              delete_downloads: bool, finish, inputs=(), names=("sweep.csv",), step_names=(), shard=(0, 1),
              upcoming=None) -> None:
    """The loop of every sweep, extract's and weights': each unfinished step of this shard (every
    shard[1]-th from the shard[0]-th) is measured into its folder, locked, the next unfinished one
    downloading meanwhile (fetch(step), in a thread). measure(step) commits the step's results, or
    returns save() that does, run on a thread while the next step is measured (the folder locked
    until it is done; waited for once the next step's devices are done with, before its own saving
    starts: at most two steps' results in memory); its error stops the sweep, naming its step, and
    the steps committed before stay. A step whose folder holds `result` is done: skipped with
    --resume (nothing downloaded for it), refused without, before anything is measured; a step
    locked by another live job, or finished by one since this job began, is skipped; with
    delete_downloads, a measured step's downloads leave the Hugging Face cache. finish(ready) then
    writes the sweep's files at OUT's top from every finished step of the whole sweep, OUT locked
    (waiting for another job's rebuild), on process 0 only. `names`: those files; `step_names`: what
    measure(step) writes in a step folder; both checked before any work. upcoming(step, fetching):
    told before each step is measured which unfinished step follows it (None: none) and the thread
    downloading that one (None: none), e.g. to read it ahead (run/load_ahead.py)."""
    main = parallel.is_main_process()
    sweep, steps = steps, steps[shard[0]::shard[1]]
    if shard[1] > 1:
        log(f"shard {shard[0]}/{shard[1]}: {len(steps)} of the sweep's {len(sweep)} steps")
    existed = {s for s in steps if (s.folder / result).exists()}  # to tell a step another job finishes meanwhile
    done = set() if overwrite else set(finished(steps, result))
    if not resume:
        first = next((s for s in steps if s in done), None)
        outdir.refuse_earlier(out, first and [str(first.folder.relative_to(out) / result)], overwrite=overwrite,
                              flag="--resume to continue the sweep or --overwrite")
    todo = [s for s in steps if s not in done]
    downloads = None
    if delete_downloads:
        from isojax.hf.cache import Downloads
        downloads = Downloads(s.repo for s in todo if s.repo is not None)
    if main:  # OUT checked, a commit of the sweep's files a killed job cut short undone, before any work
        with outdir.claim(out, overwrite=True, names=set(names), inputs=inputs, wait=True):
            for step in todo:
                outdir.check_names(step.folder, step_names)
    fetching, skipped, saving = None, 0, None
    try:
        for step in steps:
            label = f"[{sweep.index(step) + 1}/{len(sweep)}] {step.model} @ {revision_name(step.revision)}"
            if step in done:
                log(f"{label}: done earlier")
                continue
            if fetching is not None:
                fetching.join()
            later = todo[todo.index(step) + 1:]
            fetching = _start_fetch(fetch, later[0]) if later else None
            if upcoming is not None:
                upcoming(later[0] if later else None, fetching)
            held = contextlib.ExitStack()  # the step folder's lock: closed once its results are committed
            try:
                why = None
                if main:
                    try:
                        held.enter_context(outdir.claim(step.folder, overwrite=True, names=set(step_names)))
                    except outdir.Busy as e:
                        why = f"another job is measuring it (pid {e.holder.get('pid', '?')} on {e.holder.get('host', '?')})"
                    else:
                        if step not in existed and finished([step], result):
                            why = "another job measured it since this one began"
                if not parallel.all_processes_agree(why is None):
                    log(f"{label}: skipped, {why or 'as process 0 says'}")
                    skipped += 1
                    held.close()
                    continue
                log(label)
                save = measure(step)
            except BaseException:
                held.close()
                raise
            saving, previous = None, saving
            _saved(previous)  # the step before, saved beside this one's measurement
            if save is None:
                held.close()
            else:
                saving = (step, in_background(functools.partial(_saving, save, held), name="isojax-save"))
            if downloads is not None and step.repo is not None:
                if fetching is not None:  # its files are in the cache before this step's go
                    fetching.join()
                freed = downloads.release(step.repo, step.revision,
                                          keep=[s.revision for s in later if s.repo == step.repo])
                if freed:
                    log(f"{step.repo} @ {revision_name(step.revision)}: deleted the {freed / 1e9:.2f} GB this sweep "
                        "downloaded (--delete-downloads)")
    except BaseException:
        if saving is not None:  # the step saving beside commits (or fails) before the error ends the sweep
            with contextlib.suppress(BaseException):
                _saved(saving)
        raise
    _saved(saving)
    if main:
        with outdir.claim(out, overwrite=True, names=set(names), inputs=inputs, wait=True):
            ready = finished(sweep, result)
            finish(ready)
        missing = len(sweep) - len(ready)
        log(f"{out}: the sweep's files hold all {len(sweep)} steps" if not missing else
            f"{out}: the sweep's files hold {len(ready)} of its {len(sweep)} steps; {missing} still missing "
            f"({'skipped here, ' if skipped else ''}other jobs' or not yet measured: run the missing shards, "
            "with --resume; the last job to finish writes the complete files)")


def _saving(save, held: contextlib.ExitStack) -> None:
    """save() on the saving thread, the step folder's lock freed after it, whatever happens."""
    with held:
        faults.reached("sweep_saving")
        save()


def _saved(saving) -> None:
    """Wait for a step's saving thread ((step, Future) or None); its error names the step."""
    if saving is None:
        return
    step, future = saving
    try:
        future.result()
    except UserError as e:
        raise UserError(f"{step.model} @ {revision_name(step.revision)}: {e}") from None
    except Exception as e:
        message = explain(e)
        if message is None:
            log(f"{step.model} @ {revision_name(step.revision)}: saving its results failed")
            raise
        raise UserError(f"{step.model} @ {revision_name(step.revision)}: {message}") from None


def _start_fetch(fetch, step: Step) -> threading.Thread | None:
    """Download a hub checkpoint into the cache in a background thread; its errors surface when
    the step itself loads it."""
    if step.repo is None:
        return None

    def run():
        with contextlib.suppress(Exception):
            fetch(step)
    thread = threading.Thread(target=run, daemon=True, name="isojax-prefetch")
    thread.start()
    return thread


def run_sweep(models: list[str], revisions: list[str | None], out: Path, *, resume: bool, overwrite: bool,
              plots: bool, config: MeasureConfig, delete_downloads: bool = False, parquet: bool = False,
              shard=(0, 1), overlap: bool = True, load_ahead: bool = True) -> Path:
    """extract's sweep: one isojax.measure per step into its folder, then OUT/sweep.csv (write_sweep_csv);
    `parquet`: layers.parquet in each step folder, sweep.parquet at the top. With `overlap` (single-process
    runs), a step's files are written on a thread while the next step loads and loops (run_steps), its
    figures drawn in a process of their own (FigureProcess): its read-out on the devices done first,
    the sample copied to the host (Results.detach), so the devices serve one step at a time; the files
    are those of the sequential path, byte for byte but the timings. Not with --save-token-sums (the per-token sums stay on the devices until written).
    With `load_ahead` (single-process runs), the next step's tokenizer and weights are read while a
    step loops (run/load_ahead.py): the same parameters, bit for bit."""
    from isojax.device.memory import defaults_platform
    from isojax.hf.files import resolve_model
    from isojax.run.measure import start_measure
    from isojax.run.results import planned_result_names
    steps = plan(models, revisions, out)
    main = parallel.is_main_process()
    import jax
    overlap = overlap and jax.process_count() == 1
    from isojax.run.load_ahead import LoadAhead
    ahead = LoadAhead() if load_ahead and jax.process_count() == 1 else None

    def model_of(step: Step) -> tuple[str, str | None]:  # what start_measure loads: a local folder, or hub and revision
        local = step.local
        return (str(local), None) if local is not None else (step.model, step.revision)

    def measure_step(step: Step):
        ckpt = step.folder / "checkpoint"
        model, revision = model_of(step)
        results = start_measure(config.replace(
            model={"model": model, "revision": revision},
            checkpoint={"directory": ckpt, "resume": resume and ckpt.exists()}), ahead=ahead)
        model, revision = step.name  # a stand-in repository's step is named as the hub's would be
        results.metrics.update(model=model, revision=revision)
        results.manifest.update(model=model, revision=revision)
        if resume and not overwrite:
            check_same_corpus(results.manifest, steps, step)
        if not main:
            results.join_save()
            return None

        if overlap and results.detach():
            return lambda: save(results, step, ckpt, figures)
        save(results, step, ckpt, None)
        return None

    def save(results, step: Step, ckpt: Path, drawer) -> None:
        results.save(step.folder, overwrite=True, plots=plots, parquet=parquet, drawer=drawer)
        checkpointing.remove(ckpt)  # only what isojax wrote there

    from isojax.run.results import FigureProcess
    figures = FigureProcess() if overlap and plots and main else None  # its start overlaps the first checkpoint
    try:
        run_steps(steps, out, result="metrics.json", measure=measure_step,
                  fetch=lambda s: resolve_model(s.repo, s.revision), resume=resume, overwrite=overwrite,
                  delete_downloads=delete_downloads, finish=lambda ready: write_sweep_csv(out, ready, parquet),
                  inputs=[*models, *(config.data.data or [])], names=SWEEP_FILES, shard=shard,
                  step_names=planned_result_names(config, plots=plots, parquet=parquet,
                                                  on_accel=defaults_platform() != "cpu"),
                  upcoming=None if ahead is None else lambda s, fetching: ahead.expect(
                      *(model_of(s) if s is not None else (None, None)), fetching))
    finally:
        if ahead is not None:
            ahead.close()
        if figures is not None:
            figures.close()
    return out


def check_same_corpus(manifest: dict, steps: list[Step], step: Step) -> None:
    """A resumed sweep measures what its finished steps measured: the same corpus (fingerprint of the
    text as this model's tokenizer reads it; other models may tokenize differently), the same
    --max-tokens, and for the same model the same BOS (on or off, as --bos resolved: auto may differ
    between models; a step measured before --bos added none); otherwise sweep.csv would mix two corpora. Checked once the step is measured (the
    fingerprint is known only then), before it is saved."""
    import json
    for other in steps:
        d = other.folder
        if d == step.folder or not (d / "manifest.json").exists():
            continue
        try:
            earlier = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        was, now = (earlier.get("settings") or {}).get("max_tokens"), (manifest.get("settings") or {}).get("max_tokens")
        if was != now:
            raise UserError(f"{d} was measured with --max-tokens {was or 'unset'}, this run with {now or 'unset'}: "
                            "resume with the same --max-tokens, or sweep into another --out")
        was, now = ((m.get("settings") or {}).get("bos") or "off" for m in (earlier, manifest))
        if other.model == step.model and was != now:
            raise UserError(f"{d} was measured with BOS {was}, this run with BOS {now}: resume with --bos {was}, "
                            "or sweep into another --out")
        if other.model == step.model and earlier.get("corpus_fingerprint") != manifest.get("corpus_fingerprint"):
            raise UserError(f"{d} was measured on another corpus ({earlier.get('corpus')}) than this run "
                            f"({manifest.get('corpus')}): resume with the same --data, --source and --unit, "
                            "or sweep into another --out")


def sweep_rows(steps: list[Step], result: str, rows_of) -> list[dict]:
    """model, revision, step, then rows_of(document) for every finished step (its `result` file read
    whole, as isojax's record of the folder says)."""
    import json
    rows = []
    for step in finished(steps, result):
        outdir.check_results(step.folder, reads=(result,))
        model, revision = step.name
        head = {"model": model, "revision": revision_name(revision), "step": step_of(revision)}
        rows += [{**head, **row} for row in rows_of(json.loads((step.folder / result).read_text()))]
    return rows


SWEEP_FILES = ("sweep.csv", "sweep.parquet", "sweep_cka.json")


def write_sweep_csv(out: Path, steps: list[Step], parquet: bool = False) -> Path:
    """OUT/sweep.csv: model, revision, step, tokens, layer and every scalar layer metric (flat_layer),
    and diff_erank, diff_erank_pooled (isojax.run.sweep_files), for every finished step of the sweep; sweep.parquet
    beside it with `parquet` (or where an earlier sweep wrote one: kept in step with sweep.csv);
    sweep_cka.json where a step holds a sample (or one was written before), and the columns of its
    "to_final" (add_to_final). Committed beside the step folders in one step (outdir.staged)."""
    import json
    from isojax.run.results import flat_layer, json_safe, write_csv, write_parquet
    from isojax.run.sweep_files import add_diff_erank, add_to_final, sweep_cka
    rows = add_diff_erank(sweep_rows(steps, "metrics.json", lambda metrics: [
        {"tokens": metrics["tokens"], **flat_layer(layer)} for layer in metrics["layers"]]))
    earlier = set(outdir.owned(out))
    ready = {}
    for step in finished(steps, "metrics.json"):
        model, revision = step.name
        ready.setdefault(model, []).append((revision_name(revision), step.folder))
    folders = [folder for fs in ready.values() for _, folder in fs]
    cka = json_safe(sweep_cka(ready)) if "sweep_cka.json" in earlier or any(
        (folder / "samples.zarr").is_dir() for folder in folders) else None
    rows = add_to_final(rows, cka or {}, folders)
    with outdir.staged(out, replace_all=False) as stage:
        write_csv(stage / "sweep.csv", rows)
        if parquet or "sweep.parquet" in earlier:
            write_parquet(stage / "sweep.parquet", rows)
        if cka is not None:
            (stage / "sweep_cka.json").write_text(json.dumps(cka, indent=1) + "\n")
    return out / "sweep.csv"
