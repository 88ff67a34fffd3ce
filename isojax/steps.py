"""Training steps named by hub revisions: the one parser of the tree, the paper's Pythia steps,
what a checkpoint's weights are (`checkpoint_weights`), and the revision folders of a local
stand-in repository (`local_revision`).

A revision names a step on a model's training axis when it is

- `stepN` (Pythia): N;
- `stepN-tokensM` (OLMo-1, e.g. `step1000-tokens4B`): N;
- `stage1-stepN-tokensM` (OLMo-2's pretraining stage, e.g. `stage1-step1000-tokens5B`): N.

Every other revision names no step (None), later stages included: OLMo-2's
`stage2-ingredientK-stepN-tokensM` (and any stage after 1) restarts its step count at 0 on a
different data mix, once per ingredient, so its N is not comparable with stage 1's and is kept
off the step axis; such a run keeps its revision name as its label (`report` orders it after the
stepped revisions, by name).
"""

from __future__ import annotations

import re
from pathlib import Path

from isojax.errors import UserError

_STEP = re.compile(r"step(\d+)(?:-tokens\d+[KMBT]?)?|stage1-step(\d+)-tokens\d+[KMBT]?")


def step_of(revision: str | None) -> int | None:
    """The training step a revision names (module docstring); None for any other name:
    'step143000' -> 143000, 'stage1-step1000-tokens5B' -> 1000, 'stage2-ingredient1-step1000-tokens5B',
    'main' -> None. A bare `stage1-stepN` (no tokens part) is not an OLMo revision: None."""
    m = _STEP.fullmatch(revision or "")
    return None if m is None else int(m.group(1) or m.group(2))


def paper_steps() -> list[str]:
    """The 21 evenly spaced Pythia checkpoints of Machina & Mercer: step0 and floor(i*143/20)*1000."""
    return ["step0"] + [f"step{(i * 143 // 20) * 1000}" for i in range(1, 21)]


RANDOM, INITIAL, TRAINED = "random", "initialization (step 0)", "trained"


def checkpoint_weights(revision: str | None, *folders) -> str:
    """What a checkpoint's weights are (results' `"weights"`): INITIAL when its revision names step 0
    (`step0`, `step0-tokens0B`, ...) or, with a revision that names no step, the name of one of its
    folders does (`/ckpts/pythia-70m/step0`); else TRAINED. Random weights (`random:`) are RANDOM,
    said by whoever makes them."""
    step = step_of(revision)
    if step is None:
        step = next((s for s in (step_of(str(f).rstrip("/").rsplit("/", 1)[-1]) for f in folders if f)
                     if s is not None), None)
    return INITIAL if step == 0 else TRAINED


def weights_read(value: str | None, revision: str | None = None) -> str | None:
    """A result's `"weights"` as this version names it: results written before say "pretrained" for
    every checkpoint, read as `checkpoint_weights(revision)` (TRAINED unless the revision is step 0)."""
    return checkpoint_weights(revision) if value == "pretrained" else value


def local_revision(model, revision: str | None) -> Path | None:
    """DIR/REVISION of a local stand-in repository (DIR holding one checkpoint folder per revision),
    DIR itself without a revision; None where `model` is not a local directory. `--revision` and
    `--revisions` read it alike."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    if revision is None:
        check_not_revisions(path)
        return path
    if not (path / revision).is_dir():
        raise UserError(f"revision {revision!r} not found: {path} has no subfolder {revision}")
    return path / revision


def check_not_revisions(path: Path) -> None:
    """Refuse a folder of revisions (no config.json of its own, subfolders holding one) given as a
    checkpoint, naming --revision and --revisions."""
    if (path / "config.json").exists():
        return
    subs = sorted((d.name for d in path.iterdir() if (d / "config.json").is_file()),
                  key=lambda r: (step_of(r) is None, step_of(r) or 0, r))
    if subs:
        shown = ", ".join(subs[:4]) + (f" and {len(subs) - 4} more" if len(subs) > 4 else "")
        raise UserError(f"{path} looks like a folder of revisions ({shown}), not one checkpoint: pick one with "
                        f"--revision {subs[0]}, or measure them all with --revisions {','.join(subs)}")
