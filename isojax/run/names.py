"""One name for one checkpoint, (model, revision), written by extract, weights and sweeps and read
by report and correlate, so that a checkpoint measured by two commands, locally or from the hub,
meets itself (and its downstream scores) in the report:

- a preset is its hub id (`pythia-70m` -> `EleutherAI/pythia-70m`, as lm-evaluation-harness names
  it); hub ids and `random:<preset>` are kept as given;
- a local folder is named by its own name (`/ckpts/pythia-70m` -> `EleutherAI/pythia-70m` as a
  preset's name, `/ckpts/tiny` -> `tiny`); a revision folder of a local stand-in repository
  (`--model /ckpts/tiny --revisions step1000`, or `--model /ckpts/tiny/step1000` itself: a folder
  named as a training step) is the repository's name at that revision: (`tiny`, `step1000`);
- no revision is None, which readers take as `main`.

A sweep's step lives in OUT/<model with '/' as '--'>/<revision or main>/ (`step_folder`), for
extract and weights alike.
"""

from __future__ import annotations

from pathlib import Path

from isojax.hf.family.presets import base_preset, hub_id
from isojax.steps import step_of


def canonical_model(name: str) -> str:
    """'pythia-70m' -> 'EleutherAI/pythia-70m'; hub ids, random:NAME and other names unchanged."""
    name = str(name).strip()
    if name and "/" not in name and ":" not in name and base_preset(name):
        return hub_id(name)
    return name


def _local(model: str) -> Path | None:
    """The folder a model name means, when it means one (it exists, or is written as a path)."""
    path = Path(model).expanduser()
    return path if path.is_dir() or model.startswith(("/", ".", "~")) else None


def checkpoint_name(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """(model, revision) as every command names this checkpoint (see the module's docstring)."""
    model = str(model)
    local = None if model.startswith("random:") else _local(model)
    if local is not None:
        local = Path(local.as_posix().rstrip("/") or "/")
        if revision is None and step_of(local.name) is not None and local.parent.name:
            return canonical_model(local.parent.name), local.name
        return canonical_model(local.name), revision
    return canonical_model(model), revision


def revision_name(revision) -> str:
    return "main" if revision in (None, "") else str(revision)


def folder_name(model: str) -> str:
    """A model's folder in a sweep: its name with '/' as '--' (EleutherAI--pythia-70m)."""
    return model.replace("/", "--")


def step_folder(out: Path, model: str, revision: str | None) -> Path:
    """OUT/<model>/<revision>/ of a checkpoint given as on the command line."""
    name, rev = checkpoint_name(model, revision)
    return Path(out) / folder_name(name) / revision_name(rev)
