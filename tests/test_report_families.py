"""python -m isojax.report over results of several families (fake result folders, no model run):
Pythia beside OLMo-2 across training (OLMo's revision names on the step axis, stage2 kept off
it), tied OPT and Falcon as the paper's contrast rows, RMSNorm and weightless final norms."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from isojax.report import build

from test_figures import _review
from test_report import write_extract, write_weights

PYTHIA, OLMO2 = "EleutherAI/pythia-410m", "allenai/OLMo-2-0425-1B"
OLMO2_REVS = ["stage1-step0-tokens0B", "stage1-step1000-tokens5B", "stage1-step2000-tokens9B",
              "stage2-ingredient1-step1000-tokens5B"]


def family_weights(folder, rng, model, revision, family, tied=False, norm="layernorm"):
    doc = write_weights(folder, rng, model, revision)
    doc.update(family=family, tied=tied)
    if tied:
        doc["embed_out"] = {"tied_to": "embed_in", "tensor": "model.embed_tokens.weight"}
        with np.load(folder / "arrays.npz") as a:
            kept = {k: a[k] for k in a.files if k.startswith("embed_in")}
        np.savez(folder / "arrays.npz", **kept)
    doc["final_ln"]["norm"] = norm
    if norm != "layernorm":
        for k in list(doc["final_ln"]):
            if k != "norm" and (norm != "rmsnorm" or k != "avgnorm_g"):
                doc["final_ln"][k] = None
    (folder / "weights.json").write_text(json.dumps(doc))
    return doc


def _unwrap(text: str) -> str:
    """A label as one line (isojax.plots.paper writes long bar labels on several)."""
    return text.replace("\n@", " @").replace("-\n", "-").replace("\n", " ")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    rng = np.random.default_rng(5)
    docs = {}
    for rev in ("step0", "step1000", "step143000"):
        docs[PYTHIA, rev] = family_weights(root / "w" / "pythia" / rev, rng, PYTHIA, rev, "gpt_neox")
        write_extract(root / "x" / "pythia" / rev, rng, "pythia-410m", rev, 4, with_sources=False)
    for rev in OLMO2_REVS:
        docs[OLMO2, rev] = family_weights(root / "w" / "olmo2" / rev, rng, OLMO2, rev, "olmo2", norm="rmsnorm")
        metrics = write_extract(root / "x" / "olmo2" / rev, rng, "x", rev, 3, with_sources=False)
        (root / "x" / "olmo2" / rev / "metrics.json").write_text(json.dumps({**metrics, "model": OLMO2}))
    for model, family in (("facebook/opt-6.7b", "opt"), ("tiiuae/falcon-7b", "falcon")):
        docs[model, None] = family_weights(root / "w" / family, rng, model, None, family, tied=True)
    docs["allenai/OLMo-1B-hf", None] = family_weights(root / "w" / "olmo1", rng, "allenai/OLMo-1B-hf", None, "olmo",
                                                      norm="layernorm_no_affine")
    texts, raw = {}, {}
    orig = Figure.savefig

    def keep(fig, fname, *args, **kwargs):
        name = str(fname).rsplit("/", 1)[-1].rsplit(".", 1)[0]
        if name not in texts:
            _review(fig, name)  # tick labels apart, legends clear of the data
            raw[name] = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
            texts[name] = {_unwrap(t.get_text()) for ax in fig.axes for t in
                           [*ax.get_xticklabels(), ax.title, *(ax.get_legend().get_texts() if ax.get_legend() else [])]}
        return orig(fig, fname, *args, **kwargs)

    out = tmp_path_factory.mktemp("rep") / "report"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", keep)
        build.build([root], out)
    return out, docs, texts, raw


def _csv(out, name):
    with open(out / "figures" / f"{name}.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_families_side_by_side(report):
    out, docs, texts, raw = report
    bars = texts["isotropy_embed_out_sizes"]
    assert {"pythia-410m @ step143000", "OLMo-2-0425-1B @ stage2-ingredient1-step1000-tokens5B", "opt-6.7b (tied)",
            "falcon-7b (tied)", "OLMo-1B-hf"} <= bars, bars
    assert "OLMo-2-0425-1B\n@ stage2-ingredient1-\nstep1000-tokens5B" in raw["isotropy_embed_out_sizes"]
    rows = {r["model"]: r for r in _csv(out, "isotropy_embed_out_sizes")}
    assert float(rows["opt-6.7b"]["isotropy"]) == docs["facebook/opt-6.7b", None]["embed_in"]["isotropy"]
    assert (rows["opt-6.7b"]["tied"], rows["pythia-410m"]["tied"], rows["falcon-7b"]["family"]) == \
        ("True", "False", "falcon")
    assert {"falcon-7b (tied) — uncentered", "pythia-410m @ step143000 — centered"} <= texts["svd2d_embed_out"]


@pytest.mark.slow
def test_olmo_revisions_on_the_training_axis(report):
    out, docs, texts, raw = report
    assert {"pythia-410m embed_out", "OLMo-2-0425-1B embed_in"} <= texts["isotropy_training"]
    rows = [(r["model"], r["revision"], r["step"]) for r in _csv(out, "isotropy_training")]
    assert rows == [("pythia-410m", r, s) for r, s in (("step0", "0"), ("step1000", "1000"),
                                                      ("step143000", "143000"))] + \
        [("OLMo-2-0425-1B", r, s) for r, s in zip(OLMO2_REVS[:3], ("0", "1000", "2000"))]  # stage2: off the axis
    rows = [(r["model"], r["step"]) for r in _csv(out, "inter_sim_last_layer_training")]
    assert ("OLMo-2-0425-1B", "2000") in rows and ("pythia-410m", "143000") in rows
    assert {"pythia-410m @ step143000", "OLMo-2-0425-1B @ stage2-ingredient1-step1000-tokens5B"} <= \
        texts["inter_sim_by_layer"]


@pytest.mark.slow
def test_norms_of_each_family(report):
    out, docs, texts, raw = report
    rows = {r["model"]: r for r in _csv(out, "layernorm_sizes")}
    assert (rows["OLMo-2-0425-1B"]["norm"], rows["OLMo-2-0425-1B"]["avgnorm_b"]) == ("rmsnorm", "")
    assert float(rows["pythia-410m"]["avgnorm_b"]) == docs[PYTHIA, "step143000"]["final_ln"]["avgnorm_b"]
    assert "OLMo-1B-hf" not in rows
    md = (out / "report.md").read_text()
    assert "No bias b (n/a): OLMo-2-0425-1B @ stage2-ingredient1-step1000-tokens5B (rmsnorm)." in md
    assert "No final-norm weights, not drawn: OLMo-1B-hf (layernorm_no_affine)." in md
    assert [r["model"] for r in _csv(out, "layernorm_training")].count("OLMo-2-0425-1B") == 3
    assert "OLMo-2-0425-1B b" not in texts["layernorm_training"] and "pythia-410m b" in texts["layernorm_training"]


def test_tied_unembedding_is_the_embedding(tmp_path):
    """embed_out.METRIC of a tied model reads its one matrix, for report and correlate alike."""
    from isojax.report import collect, correlate
    doc = family_weights(tmp_path / "opt", np.random.default_rng(0), "facebook/opt-6.7b", None, "opt", tied=True)
    res = collect.load([tmp_path])
    run, = res.weights
    assert run.tied and collect.weights_value(run, "embed_out.isotropy") == doc["embed_in"]["isotropy"]
    assert {"embed_in.isotropy", "embed_out.isotropy"} <= set(correlate.weights_metrics(res))
