"""Runs over training checkpoints and model sizes: `extract --model A --model B --revisions R1,R2`
or `--paper-steps`.

Every (model, revision) is one isojax.measure into OUT/<model>/<revision>/ (model: a local
directory's name, else the name with '/' as '--'; revision: `main` when none), then OUT/sweep.csv gathers every finished step, one row
per (model, revision, layer). The corpus is tokenized once (Pythia models share a tokenizer, so
they share the token cache); while the devices measure one checkpoint a background thread
fetches the next one into Hugging Face's cache. A step whose folder holds metrics.json is done:
a killed sweep, run again with the same arguments and --resume, skips the finished steps and
resumes the unfinished one from its checkpoint; it refuses a corpus or --max-tokens other than
the finished steps' (sweep.csv would mix them).

Offline stand-ins for the hub: a local directory with one subfolder per revision
(DIR/step1000/, DIR/step2000/, each a Hugging Face checkpoint) is read as a repository:
`--model DIR --revisions step1000,step2000`.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path

from isojax.device import checkpoints as checkpointing
from isojax.run import outdir
from isojax.device import mesh as parallel
from isojax.errors import UserError
from isojax.log import log
from isojax.run.config import MeasureConfig
from isojax.steps import step_of


def slug(name: str) -> str:
    """A model's folder name: a local directory's own name, else the name with '/' as '--'."""
    path = Path(name).expanduser()
    return path.name if path.is_dir() else str(name).replace("/", "--")


def local_revision(model: str, revision: str | None) -> Path | None:
    """DIR/REVISION of a local stand-in repository (None: not a local directory)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    if revision is None:
        return path
    if not (path / revision).is_dir():
        raise UserError(f"revision {revision!r} not found: {path} has no subfolder {revision}")
    return path / revision


def check_revisions(model: str, revisions: list[str | None]) -> None:
    """Refuse unknown revisions before anything runs (hub: its branches and tags, when the hub
    is reachable; local stand-ins: their subfolders)."""
    if Path(model).expanduser().is_dir():
        for r in revisions:
            local_revision(model, r)
        return
    from isojax.model.config import base_preset, hub_id
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
            from isojax.hf.files import _hub_error
            raise _hub_error(e, repo, None) from None
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


def _prefetch(model: str, revision: str | None) -> None:
    """Download a hub checkpoint into the cache (in a background thread; errors surface later)."""
    if model.startswith("random:") or Path(model).expanduser().is_dir():
        return
    try:
        from isojax.model.config import base_preset, hub_id
        from isojax.hf.files import resolve_model
        resolve_model(hub_id(model) if base_preset(model) else model, revision)
    except Exception:
        pass


def run_sweep(models: list[str], revisions: list[str | None], out: Path, *, resume: bool, overwrite: bool,
              plots: bool, config: MeasureConfig) -> Path:
    from isojax.run.measure import measure
    jobs = [(m, r) for m in models for r in revisions]
    for m in models:
        check_revisions(m, revisions)
    main = parallel.is_main_process()
    inputs = [*models, *(config.data.data or [])]
    with outdir.claim(out, overwrite=True, names={"sweep.csv"}, inputs=inputs) if main else contextlib.nullcontext():
        fetch = None
        for i, (model, revision) in enumerate(jobs):
            step_dir = out / slug(model) / (revision or "main")
            with outdir.claim(step_dir, overwrite=True) if main else contextlib.nullcontext():
                done = (step_dir / "metrics.json").exists()
                if done and not overwrite:
                    if not resume:
                        raise UserError(f"{step_dir} already holds results; pass --resume to continue the sweep "
                                        "or --overwrite to replace it")
                    log(f"[{i + 1}/{len(jobs)}] {model} @ {revision or 'main'}: done earlier")
                    continue
                if fetch is not None:
                    fetch.join()
                if i + 1 < len(jobs):
                    fetch = threading.Thread(target=_prefetch, args=jobs[i + 1], daemon=True, name="isojax-prefetch")
                    fetch.start()
                log(f"[{i + 1}/{len(jobs)}] {model} @ {revision or 'main'}")
                local = local_revision(model, revision)
                spec = str(local) if local is not None else model
                ckpt = step_dir / "checkpoint"
                results = measure(config.replace(
                    model={"model": spec, "revision": None if local is not None else revision},
                    checkpoint={"directory": ckpt, "resume": resume and ckpt.exists()}))
                if local is not None:  # a stand-in repository: report the step as the hub's would be
                    results.metrics.update(model=slug(model), revision=revision)
                    results.manifest.update(model=slug(model), revision=revision)
                if resume and not overwrite:
                    check_same_corpus(results.manifest, out, jobs, model, step_dir)
                if main:
                    results.save(step_dir, overwrite=True, plots=plots)
                    checkpointing.remove(ckpt)  # only what isojax wrote there
                else:
                    results.join_save()
                del results
        if main:
            write_sweep_csv(out, jobs)
    return out


def check_same_corpus(manifest: dict, out: Path, jobs, model: str, step_dir: Path) -> None:
    """A resumed sweep measures what its finished steps measured: the same corpus (fingerprint of the
    text as this model's tokenizer reads it; other models may tokenize differently) and the same
    --max-tokens; otherwise sweep.csv would mix two corpora. Checked once the step is measured (the
    fingerprint is known only then), before it is saved."""
    import json
    for m, r in jobs:
        d = out / slug(m) / (r or "main")
        if d == step_dir or not (d / "manifest.json").exists():
            continue
        try:
            earlier = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        was, now = (earlier.get("settings") or {}).get("max_tokens"), (manifest.get("settings") or {}).get("max_tokens")
        if was != now:
            raise UserError(f"{d} was measured with --max-tokens {was or 'unset'}, this run with {now or 'unset'}: "
                            "resume with the same --max-tokens, or sweep into another --out")
        if m == model and earlier.get("corpus_fingerprint") != manifest.get("corpus_fingerprint"):
            raise UserError(f"{d} was measured on another corpus ({earlier.get('corpus')}) than this run "
                            f"({manifest.get('corpus')}): resume with the same --data, --source and --unit, "
                            "or sweep into another --out")


def write_sweep_csv(out: Path, jobs) -> Path:
    """OUT/sweep.csv: model, revision, step, tokens, layer and every scalar layer metric, for
    every finished step of the sweep; committed beside the step folders (outdir.staged)."""
    import json

    from isojax.run.results import flat_layer, write_csv
    rows = []
    for model, revision in jobs:
        d = out / slug(model) / (revision or "main")
        if (d / "metrics.json").exists():
            outdir.check_results(d, reads=("metrics.json",))
            metrics = json.loads((d / "metrics.json").read_text())
            rows += [{"model": metrics["model"], "revision": revision or "main", "step": step_of(revision),
                      "tokens": metrics["tokens"], **flat_layer(layer)} for layer in metrics["layers"]]
    with outdir.staged(out, replace_all=False) as stage:
        write_csv(stage / "sweep.csv", rows)
    return out / "sweep.csv"
