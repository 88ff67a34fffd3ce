"""The one parser of training steps in revision names (isojax.steps)."""

import pytest

from isojax.steps import paper_steps, step_of


@pytest.mark.parametrize("revision, step", [
    ("step0", 0), ("step143000", 143000),                                     # Pythia
    ("step1000-tokens4B", 1000), ("step20000-tokens84B", 20000),              # OLMo-1
    ("step738020-tokens3095B", 738020), ("step5000-tokens20", 5000),
    ("stage1-step1000-tokens5B", 1000), ("stage1-step0-tokens0B", 0),         # OLMo-2 pretraining
    # not on the step axis: later stages restart their count on another data mix
    ("stage2-ingredient1-step1000-tokens5B", None), ("stage2-ingredient3-step11931-tokens50B", None),
    ("stage2-step1000-tokens5B", None), ("stage3-step10-tokens1B", None),
    # other names
    ("main", None), (None, None), ("", None), ("v1.0", None), ("Step1000", None), ("step", None),
    ("step-1", None), ("step1000-tokens", None), ("step1000-tokens4B-extra", None), ("stage1-step1000", None),
    ("1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b", None), ("step1000 ", None),
])
def test_step_of(revision, step):
    assert step_of(revision) == step


def test_paper_steps():
    assert paper_steps()[:3] == ["step0", "step7000", "step14000"] and paper_steps()[-1] == "step143000"
    assert len(paper_steps()) == 21 and all(step_of(r) is not None for r in paper_steps())
