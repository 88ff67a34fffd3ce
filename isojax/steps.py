"""Training steps named by hub revisions: the one parser of the tree, and the paper's Pythia steps.

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
