"""block_influence (ShortGPT, Men et al. 2024: BI_i = 1 - E_t cos(x_i,t, x_i+1,t) of a block's input and
output) as sample_metrics reads it out of the sample, against the formula token by token on the same
points: Hugging Face states of random checkpoints of two families (tests/measure_cases.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from measure_cases import FAMILIES, hf_points

from isojax.stats import finalize as fz
from isojax.stats import sample_readout as sr
from isojax.stats import measures


def sampled(x_SxKxD, keys=("block_influence", "linearity"), host: bool = True) -> list[dict]:
    """sample_metrics' values of `keys` per state, the sample being x (float32, where a run keeps it),
    read out in numpy on the host (the CPU's way) or, host=False, jitted (the accelerators'); the keys'
    measures that are off by default turned on."""
    s, k, _ = x_SxKxD.shape
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measures, "on_host", lambda: host)
        out = sr.sample_metrics(lambda i: jnp.asarray(x_SxKxD[i]), k, [f"s{i}" for i in range(s)], intrinsic=False,
                                extra=tuple(key for key in keys if key in measures.optional()))  # --measure's
    return [{key: m[key] for key in keys} for m in out]


def reference(x, y) -> float:
    cos = [a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(x, y)]
    return 1.0 - float(np.mean(cos))


@pytest.mark.parametrize("family", FAMILIES)
def test_block_influence_equals_the_papers_formula_on_hugging_face_states(family):
    x = hf_points(family)
    got = sampled(x, host=family == "gpt_neox")  # numpy on the host; jitted (the accelerators' way)
    assert got[0]["block_influence"] is None  # embed: no block before it
    x64 = x.astype(np.float64)
    for i in range(1, len(x)):
        assert got[i]["block_influence"] == pytest.approx(reference(x64[i - 1], x64[i]), rel=1e-9, abs=1e-12), i


@pytest.mark.parametrize("host", [True, False])
def test_block_influence_leaves_out_zero_vectors_and_is_null_without_any(host):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 50, 8)).astype(np.float32)
    x[1, :10] = 0.0  # ten tokens whose output is zero: no cosine
    got = sampled(x, host=host)[1]["block_influence"]
    assert got == pytest.approx(reference(x[0, 10:].astype(np.float64), x[1, 10:].astype(np.float64)), rel=1e-9)
    x[1] = 0.0
    assert sampled(x, host=host)[1]["block_influence"] is None
