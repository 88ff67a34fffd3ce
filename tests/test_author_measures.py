"""Issue 45: the spectral measures as their authors define them, read out of the accumulators, against
float64 references written here from the papers, on Hugging Face hidden states of random checkpoints
of two families (GPT-NeoX, GPT-2), in float32 and with the states rounded to bfloat16:

- the spectral floor (geometry.spectral_floor's formula, restated here) and the rank-deficiency flag:
  an embedding of 40 distinct tokens has rank 39, a LayerNorm's output (final_ln) misses one dimension;
- effective_rank (Roy & Vetterli: entropy of sqrt(lambda) / Sum sqrt(lambda));
- alpha-ReQ (Agrawal et al. 2022, fitted as reptrix fits it): least squares of log lambda_k on log k
  weighted by 1/k over ranks 11 to 100 (numpy's polyfit with w = k^-1/2);
- IsoScore* (Rudman & Eickhoff 2024, I-STAR's analysis): the `isoscore` package with zeta = 0.75 and
  C0 = np.cov of the same states;
- erank_pooled (after Wei et al. 2024): entropy of the eigenvalues of the trace-normalized covariance
  of the unit vectors x / |x| of all tokens.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from conftest import build_hf_checkpoint, hf_states, need
from test_families import SHAPES, build
from test_families import hf_states as family_states
from test_stats import _feed
from isojax.stats import accumulators as stats
from isojax.stats import finalize as fz


def floor_of(lam, points, bf16):
    """The documented floor (README "Measures"): 64 x 2^-24 lambda_1; with bf16 states at least
    2^-18 max(lambda_1, the largest mean square of a coordinate of the points)."""
    scale = max(lam[0], (points * points).mean(0).max()) if bf16 else 0.0
    return max(64 * 2.0 ** -24 * lam[0], 2.0 ** -18 * scale)


def entropy_exp(p):
    p = p[p > 0] / p.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def reference(x, bf16: bool) -> dict:
    x = np.asarray(x, np.float64)
    lam = np.sort(np.linalg.eigvalsh(np.cov(x.T, ddof=0)))[::-1]
    lam = np.where(lam > floor_of(lam, x, bf16), lam, 0.0)
    rank = int((lam > 0).sum())
    k = np.arange(11, min(100, rank) + 1)
    alpha = -np.polyfit(np.log(k), np.log(lam[k - 1]), 1, w=k ** -0.5)[0] if k.size >= 2 else None
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cu = np.cov(u.T, ddof=0)
    lu = np.sort(np.linalg.eigvalsh(cu))[::-1]  # entropy_exp normalizes by the trace
    lu = np.where(lu > floor_of(lu, u, bf16), lu, 0.0)
    torch, isoscore_package = need("torch"), need("IsoScore.IsoScore")
    c0 = torch.tensor(np.cov(x.T))
    return {"null_eigenvalues": x.shape[1] - rank, "effective_rank": entropy_exp(np.sqrt(lam)), "alpha_req": alpha,
            "isoscore_star": float(isoscore_package.IsoScore_star(x, c0, 0.75)), "erank_pooled": entropy_exp(lu)}


def states_of(tmp_path, family):
    """[S, N, D] float32 hidden states of 1,024 tokens drawn from 40 token ids (the embedding: rank 39)."""
    rng = np.random.default_rng(45)
    ids = rng.choice(rng.choice(300, 40, replace=False), size=(8, 128))
    if family == "gpt_neox":
        model = build_hf_checkpoint(tmp_path / family, hidden_size=64, tokenizer=False)
        xs = [hf_states(model, row) for row in ids]
    else:
        model = build(tmp_path / family, family, **SHAPES[family][0])
        xs = [family_states(model, row) for row in ids]
    return np.concatenate(xs, axis=1).astype(np.float32)


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2"])
def test_spectral_measures_equal_float64_references_of_the_papers(tmp_path, family):
    x32 = states_of(tmp_path, family)
    s, n, d = x32.shape
    for bf16 in (False, True):
        x = x32.astype(ml_dtypes.bfloat16) if bf16 else x32
        acc = stats.init_accumulators(s, d)
        acc = _feed(acc, x, np.zeros(n, np.int32), np.ones(n, bool))
        layers = fz.finalize(acc, [f"s{i}" for i in range(s)], bf16=bf16)["layers"]
        for i, layer in enumerate(layers):
            ref = reference(x[i].astype(np.float64), bf16)
            what = (family, bf16, i)
            # the flag: GPT-NeoX's embedding of 40 tokens has rank 39 (GPT-2's adds positions); final_ln
            # misses one dimension, in bf16 too (its rounding to bf16 is under the floor, and so may be
            # an eigenvalue at that level: GPT-2's final_ln, whose mean dwarfs its spread)
            want = {0: d - 39 if family == "gpt_neox" else 0, s - 1: 1}.get(i, 0)
            assert want <= ref["null_eigenvalues"] <= want + (1 if bf16 else 0), (what, ref["null_eigenvalues"])
            assert layer["null_eigenvalues"] == ref["null_eigenvalues"], (what, layer["null_eigenvalues"], ref)
            assert layer["rank_deficient"] == (ref["null_eigenvalues"] > 0), what
            tol = 1e-3 if bf16 else 1e-6  # bf16 Grams: ~1e-4 of the spectrum (README "bfloat16"), IsoScore* amplifies it
            for key in ("effective_rank", "erank_pooled", "isoscore_star"):
                assert layer[key] == pytest.approx(ref[key], rel=tol), (what, key)
            assert abs(layer["alpha_req"] - ref["alpha_req"]) < 1e-3, (what, layer["alpha_req"], ref["alpha_req"])


def test_results_written_before_read_their_changed_measures_as_null(tmp_path):
    """An old-style metrics.json (no null_eigenvalues; alpha_req, isoscore_star and effective_rank of
    the older definitions) reads those as n/a in isojax.load and the report's collection, the rest as written."""
    import isojax
    from isojax.report.collect import _extract_run
    folder = tmp_path / "old"
    folder.mkdir()
    layer = {"name": "final_ln", "count": 10, "isoscore": 0.25, "isoscore_star": 0.4, "alpha_req": 1.94,
             "effective_rank": 48.2, "inter_sim": 0.1, "massive_ratio": 3e4}
    (folder / "metrics.json").write_text(json.dumps({"model": "m", "tokens": 10, "layers": [layer]}))
    row = isojax.load(folder).iloc[0]
    assert row["isoscore"] == 0.25 and row["inter_sim"] == 0.1
    assert row["massive_max_over_sample_median"] == 3e4 and "massive_ratio" not in row  # renamed, read as such
    assert np.isnan(row.get("erank", np.nan)) and np.isnan(row.get("massive_count", np.nan))  # not measured: n/a
    for key in ("isoscore_star", "alpha_req", "effective_rank"):
        assert row[key] is None or np.isnan(row[key]), key
    got = _extract_run(folder).data["layers"][0]
    assert got["isoscore"] == 0.25 and all(got[k] is None for k in ("isoscore_star", "alpha_req", "effective_rank"))


def test_diff_erank_pooled_is_step0_minus_this_one_and_null_without_step0(capsys):
    """diff_erank (of the probe's erank) and diff_erank_pooled: step0's minus this one's; without a
    step0, diff_erank from the row's erank_init (a random initialization) and diff_erank_pooled null;
    null where a checkpoint lacks the measure (diff_erank_baseline says which baseline)."""
    from isojax.run import sweep_files
    rows = [{"model": m, "revision": r, "name": "b", "erank_pooled": e, "erank": e / 10, "erank_init": 7.5}
            for m, r, e in [("a", "step1000", 30.0), ("a", "step0", 50.0), ("a", "main", 20.0),
                            ("z", "step1000", 30.0), ("z", "main", 20.0), ("y", "main", 20.0)]]
    del rows[2]["erank"]  # a checkpoint measured before the sentence probe
    del rows[4]["erank_init"], rows[5]["erank_init"]  # measured before erank_init
    rows = sweep_files.add_diff_erank(rows)
    got = {(r["model"], r["revision"]): r["diff_erank_pooled"] for r in rows}
    assert got == {("a", "step1000"): 20.0, ("a", "step0"): 0.0, ("a", "main"): 30.0,
                   ("z", "step1000"): None, ("z", "main"): None, ("y", "main"): None}
    got = {(r["model"], r["revision"]): r["diff_erank"] for r in rows}
    assert got == {("a", "step1000"): pytest.approx(2.0), ("a", "step0"): 0.0, ("a", "main"): None,
                   ("z", "step1000"): pytest.approx(4.5), ("z", "main"): None, ("y", "main"): None}
    assert [r["diff_erank_baseline"] for r in rows] == ["step0"] * 3 + ["random-init-seed0", None, None]
    err = capsys.readouterr().err
    assert "z: no step0 in the sweep" in err and "diff_erank from a random initialization" in err
    assert "y: no step0 in the sweep" in err and "diff_erank null (no erank_init" in err and "a: no step0" not in err


def test_a_sweep_csv_written_before_reads_its_changed_measures_as_null(tmp_path):
    """isojax.load of an older sweep.csv alone (no step folders): alpha_req, isoscore_star,
    effective_rank and the older diff_erank are n/a, the other columns as written."""
    import isojax
    (tmp_path / "sweep.csv").write_text(
        "model,revision,step,tokens,name,isoscore,isoscore_star,alpha_req,effective_rank,diff_erank,massive_ratio\n"
        "m,step0,0,10,final_ln,0.25,0.4,1.94,48.2,0.0,10.0\n"
        "m,main,,10,final_ln,0.5,0.6,1.5,40.0,8.2,20.0\n")
    df = isojax.load(tmp_path)
    assert df["isoscore"].tolist() == [0.25, 0.5]
    assert df["massive_max_over_sample_median"].tolist() == [10.0, 20.0] and "massive_ratio" not in df.columns
    for key in ("isoscore_star", "alpha_req", "effective_rank", "diff_erank"):
        assert df[key].isna().all(), key
