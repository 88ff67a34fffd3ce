"""python -m isojax.report: fake result folders (random numbers, no model run) of 3 sizes x 4
revisions in the layouts of extract and weights sweeps -> a self-contained HTML report, a Markdown
twin, every figure as PNG and SVG, tables holding the input numbers; bad inputs exit 2."""

from __future__ import annotations

import base64
import csv
import json
import re

import numpy as np
import pytest

from isojax.report import build

MODELS = {"pythia-70m": 6, "pythia-160m": 12, "pythia-410m": 24}   # name -> blocks
REVISIONS = ["step0", "step1000", "step71000", "step143000"]
FINGERPRINT = "f00dfeed" * 4
LAYER_KEYS = ["inter_sim", "intra_sim", "intra_sim_weighted", "anisotropy", "anisotropy_uncentered",
              "unit_anisotropy", "effective_rank", "erank_pooled", "mean_norm", "norm_of_mean"]


def _layers(rng, blocks, sources=False):
    names = ["embed"] + [f"block_{i}" for i in range(1, blocks + 1)] + ["final_ln"]
    out = []
    for name in names:
        layer = {"name": name, "count": 5000, **{k: float(rng.random()) for k in LAYER_KEYS}, "null_eigenvalues": 0}
        if sources:
            for k in ("intra_sim", "intra_sim_weighted"):
                del layer[k]
        else:
            layer["intra_tokens"] = 321
            layer["intra_sim_by_band"] = [{"lo": 2 ** k, "hi": 2 ** (k + 1), "tokens": int(rng.integers(1, 50)),
                                           "intra_sim": float(rng.random())} for k in range(1, 8)]
        out.append(layer)
    return out


def write_extract(folder, rng, model, revision, blocks, fingerprint=FINGERPRINT, with_sources=True):
    folder.mkdir(parents=True)
    metrics = {"model": f"EleutherAI/{model}", "revision": revision, "weights": "pretrained", "unit": "sentence",
               "tokens": 5000, "sequences": 50, "layers": _layers(rng, blocks)}
    if with_sources:
        metrics["sources"] = {s: {"tokens": 2500, "layers": _layers(rng, blocks, sources=True)}
                              for s in ("Enron Emails", "PhilPapers")}
    manifest = {"model": metrics["model"], "revision": revision, "corpus": "pile-val",
                "corpus_fingerprint": fingerprint,
                "config": {"num_layers": blocks, "hidden_size": 64, "vocab_size": 512}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return metrics


def write_weights(folder, rng, model, revision, rows=300):
    folder.mkdir(parents=True)
    matrix = lambda: {k: float(rng.random()) for k in ("isotropy", "isotropy_centered", "isotropy_pc_removed",  # noqa
                                                         "isotropy_scaled_centered", "mean_norm", "mean_vector_norm")}
    doc = {"model": model, "revision": revision, "embed_in": {**matrix(), "rows": rows, "dim": 64},
           "embed_out": {**matrix(), "rows": rows, "dim": 64},
           "final_ln": {k: float(rng.random()) for k in ("avgnorm_g", "avgnorm_b", "b_over_g", "gao_sum",
                                                           "b_parallel_norm", "b_perp_norm")}}
    (folder / "weights.json").write_text(json.dumps(doc))
    arrays = {f"{m}_{k}": rng.normal(size=(rows, 2)) for m in ("embed_in", "embed_out")
              for k in ("proj2d", "proj2d_centered")}
    np.savez(folder / "arrays.npz", **arrays)
    return doc


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """extract sweep OUT/<model>/<revision>/ and weights sweeps OUT/<revision>/ per model."""
    root = tmp_path_factory.mktemp("results")
    rng = np.random.default_rng(12345)
    data = {"extract": {}, "weights": {}}
    for model, blocks in MODELS.items():
        for rev in REVISIONS:
            data["extract"][model, rev] = write_extract(root / "sweep" / f"EleutherAI--{model}" / rev, rng, model,
                                                        rev, blocks)
            data["weights"][model, rev] = write_weights(root / f"w-{model}" / rev, rng, model, rev)
    (root / "sweep" / "sweep.csv").write_text("model,revision\n")  # ignored
    return root, data


@pytest.fixture(scope="module")
def report(results, tmp_path_factory):
    root, data = results
    out = tmp_path_factory.mktemp("rep") / "report"
    assert build.main([str(root / "sweep"), str(root / "w-pythia-70m"), str(root / "w-pythia-160m"),
                       str(root / "w-pythia-410m"), "--out", str(out)]) == 0
    return out, data


EXPECTED = ["inter_sim_by_layer", "intra_sim_by_layer", "anisotropy_by_layer", "inter_sim_last_layer_training",
            "intra_sim_last_layer_training", "isotropy_embed_out_sizes", "isotropy_embed_in_sizes",
            "isotropy_training", "layernorm_sizes", "layernorm_training", "svd2d_embed_out",
            "svd2d_embed_out_training_pythia-70m", "svd2d_embed_out_training_pythia-160m",
            "svd2d_embed_out_training_pythia-410m", "intra_sim_by_band", "sources_inter_sim", "sources_anisotropy",
            # the further measures' section (report/measures.py): these results hold effective_rank and
            # erank_pooled only
            "effective_rank_by_layer", "effective_rank_last_layer_training", "erank_pooled_by_layer",
            "erank_pooled_last_layer_training", "diff_erank_pooled_last_layer_training"]


@pytest.mark.slow
def test_every_figure_as_png_and_svg(report):
    out, _ = report
    figures = out / "figures"
    for name in EXPECTED:
        png, svg = figures / f"{name}.png", figures / f"{name}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert b"<svg" in svg.read_bytes()[:2000], name
    assert sorted(p.stem for p in figures.glob("*.png")) == sorted(EXPECTED)
    assert not list(out.parent.glob(".report.tmp-*"))  # staging folder gone


@pytest.mark.slow
def test_html_is_self_contained(report):
    out, _ = report
    text = (out / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<script" not in text and "<link" not in text and "@import" not in text and "url(" not in text
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', text)
    assert len(srcs) == len(EXPECTED)
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"


@pytest.mark.slow
def test_markdown_links_existing_figures(report):
    out, _ = report
    md = (out / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(links) == len(EXPECTED)
    for link in links:
        assert (out / link).is_file()


def _html_cells(html):
    return set(re.findall(r"<td[^>]*>([^<]*)</td>", html))


def _md_cells(md):
    return {c.strip() for line in md.splitlines() if line.startswith("|") for c in line.strip("|").split(" | ")}


@pytest.mark.slow
def test_tables_hold_the_input_numbers(report):
    out, data = report
    html_cells, md_cells = _html_cells((out / "report.html").read_text()), _md_cells((out / "report.md").read_text())
    final = {m: data["extract"][m, "step143000"] for m in MODELS}
    expect = []
    for model, metrics in final.items():  # Figs 1-2: every layer of every model's final checkpoint
        expect += [layer[k] for layer in metrics["layers"] for k in ("inter_sim", "intra_sim")]
        expect += [b["intra_sim"] for b in metrics["layers"][-1]["intra_sim_by_band"]]
        expect += [layer["inter_sim"] for layer in metrics["sources"]["PhilPapers"]["layers"]]
    for (model, rev), metrics in data["extract"].items():  # Figs 3-4: last block and final_ln over training
        expect += [metrics["layers"][k]["inter_sim"] for k in (-2, -1)]
    for (model, rev), w in data["weights"].items():  # Figs 7, 9 (all revisions), 5, 6, 8 (final)
        expect += [w["embed_out"]["isotropy"], w["embed_in"]["isotropy"], w["final_ln"]["avgnorm_g"],
                   w["final_ln"]["avgnorm_b"]]
    for value in expect:
        text = format(value, ".6g")
        assert text in html_cells and text in md_cells, value


@pytest.mark.slow
def test_csv_has_full_precision(report):
    out, data = report
    with open(out / "figures" / "inter_sim_by_layer.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["layer", "pythia-70m @ step143000", "pythia-160m @ step143000", "pythia-410m @ step143000"]
    by_layer = {r[0]: r[1:] for r in rows[1:]}
    for i, model in enumerate(MODELS):
        for layer in data["extract"][model, "step143000"]["layers"]:
            assert float(by_layer[layer["name"]][i]) == layer["inter_sim"]
    assert by_layer["block_20"][0] == ""  # pythia-70m has no block_20
    with open(out / "figures" / "isotropy_training.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["step"]) for r in rows[:4]] == [("pythia-70m", s) for s in ("0", "1000", "71000", "143000")]
    assert float(rows[5]["embed_out.isotropy"]) == data["weights"]["pythia-160m", "step1000"]["embed_out"]["isotropy"]


def test_sections_without_data_are_noted(results, tmp_path, capsys):
    root, _ = results
    out = tmp_path / "only-weights"
    assert build.main([str(root / "w-pythia-70m" / "step143000"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "No extract results (metrics.json) with per-layer InterSim or IntraSim: section left out." in md
    assert "No model has extract results at two or more revisions naming a training step" in md
    assert "No correlation.json among the inputs" in md
    assert sorted(p.stem for p in (out / "figures").glob("*.svg")) == [
        "isotropy_embed_in_sizes", "isotropy_embed_out_sizes", "layernorm_sizes", "svd2d_embed_out"]
    assert "section left out" in capsys.readouterr().err


def _error(capsys, argv):
    assert build.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_mismatched_corpora(tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_extract(tmp_path / "a" / "step1000", rng, "pythia-70m", "step1000", 6)
    write_extract(tmp_path / "a" / "step2000", rng, "pythia-70m", "step2000", 6)
    write_extract(tmp_path / "b", rng, "pythia-70m", "step3000", 6, fingerprint="0123456789abcdef")
    msg = _error(capsys, [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")])
    assert "different corpora" in msg and "0123456789abcdef" in msg and FINGERPRINT in msg
    assert str((tmp_path / "b").resolve()) in msg and str((tmp_path / "a" / "step2000").resolve()) in msg
    assert not (tmp_path / "out").exists()


def test_bad_inputs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "no results found" in _error(capsys, [str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert "no such file" in _error(capsys, [str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.json").write_text('{"model": "x", "layers": [')
    msg = _error(capsys, [str(bad), "--out", str(tmp_path / "o")])
    assert "unreadable JSON" in msg and str(bad / "metrics.json") in msg
    (bad / "metrics.json").write_text('{"model": "x"}')
    assert "not an isojax metrics.json" in _error(capsys, [str(bad), "--out", str(tmp_path / "o")])
    rng = np.random.default_rng(1)
    write_extract(tmp_path / "d1", rng, "pythia-70m", "step1000", 6)
    write_extract(tmp_path / "d2", rng, "pythia-70m", "step1000", 6)
    assert "two extract results for EleutherAI/pythia-70m@step1000" in _error(
        capsys, [str(tmp_path / "d1"), str(tmp_path / "d2"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_out_not_overwritten_without_flag(results, tmp_path, capsys):
    root, _ = results
    src = root / "w-pythia-70m" / "step1000"
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert build.main([str(src), "--out", str(out)]) == 0  # beside the user's files, which stay
    capsys.readouterr()
    assert "pass --overwrite" in _error(capsys, [str(src), "--out", str(out)])  # isojax's report now
    assert build.main([str(src), "--out", str(out), "--overwrite"]) == 0
    assert (out / "report.html").exists() and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old folders left
    assert not [p for p in out.iterdir() if p.name.startswith(".partial")]


@pytest.mark.slow
def test_correlation_table_from_scores(results, tmp_path):
    """--scores adds Table 1: Spearman by checkpoint of embed_out.isotropy, checked by hand-made ranks."""
    root, data = results
    rng = np.random.default_rng(7)
    scores = tmp_path / "scores.csv"
    rows = ["model,revision,task,score"]
    truth = {}
    for model in MODELS:
        for rev in REVISIONS:
            truth[model, rev] = float(rng.random())
            rows.append(f"EleutherAI/{model},{rev},sciq/acc,{truth[model, rev]!r}")
    scores.write_text("\n".join(rows) + "\n")
    out = tmp_path / "rep"
    assert build.main([str(root / "w-pythia-70m"), str(root / "w-pythia-410m"), "--scores", str(scores),
                       "--out", str(out)]) == 0
    html_cells = _html_cells((out / "report.html").read_text())
    for model in ("pythia-70m", "pythia-410m"):
        revs = REVISIONS[1:]  # step0 left out, as in the paper
        x = np.array([data["weights"][model, r]["embed_out"]["isotropy"] for r in revs])
        y = np.array([truth[model, r] for r in revs])
        rank = lambda v: np.argsort(np.argsort(v)).astype(float)  # noqa: E731  (no ties in random floats)
        rho = np.corrcoef(rank(x), rank(y))[0, 1]
        assert format(rho, ".3f") in html_cells
        assert format(np.corrcoef(x, y)[0, 1], ".3f") in html_cells
    assert "embed_out.isotropy vs downstream scores, by checkpoint" in (out / "report.md").read_text()


def test_correlation_json_input_is_shown(results, tmp_path):
    root, _ = results
    entry = {"metric": "inter_sim", "layer": "final_ln", "layer_name": "final_ln", "task": "lambada/acc",
             "by": "checkpoint", "group": "EleutherAI/pythia-70m", "n": 4,
             "pearson": {"r": 0.8125, "p": 0.19}, "spearman": {"rho": -0.4375, "p": 0.56},
             "kendall": {"tau": 0.3333, "p": 0.75}}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "correlation.json").write_text(json.dumps([entry]))
    out = tmp_path / "rep"
    assert build.main([str(root / "w-pythia-70m" / "step0"), str(tmp_path / "c"), "--out", str(out)]) == 0
    cells = _html_cells((out / "report.html").read_text())
    assert {"0.812", "-0.438", "0.333", "lambada/acc"} <= cells


def test_discovery_of_mixed_layouts(tmp_path):
    """A single run given as its metrics.json, a weights run at depth, staging folders and plots/
    skipped; preset names meet hub ids on (model, revision); a missing revision is main."""
    from isojax.report import collect
    rng = np.random.default_rng(3)
    write_extract(tmp_path / "single", rng, "pythia-70m", None, 6)
    write_weights(tmp_path / "deep" / "a" / "b" / "main", rng, "pythia-70m", None)
    (tmp_path / "single" / ".partial-x1").mkdir()
    (tmp_path / "single" / ".partial-x1" / "metrics.json").write_text("{broken")
    (tmp_path / "single" / "plots").mkdir()
    (tmp_path / "single" / "plots" / "weights.json").write_text("{broken")
    res = collect.load([tmp_path / "single" / "metrics.json", tmp_path / "deep"])
    assert [(r.kind, r.model, r.revision) for r in res.runs] == [
        ("extract", "EleutherAI/pythia-70m", "main"), ("weights", "EleutherAI/pythia-70m", "main")]
    assert res.extract[0].key == res.weights[0].key
    assert [r.label for r in res.runs] == ["pythia-70m", "pythia-70m"]


@pytest.mark.slow
def test_shape_of_learning_section(tmp_path):
    """Intrinsic dimension (nested in metrics.json) per layer and averaged over layers (embed
    left out) across training: the table holds the mean computed here."""
    rng = np.random.default_rng(7)
    runs = {}
    for rev in ("step0", "step1000", "step2000"):
        metrics = write_extract(tmp_path / "r" / rev, rng, "pythia-70m", rev, 3, with_sources=False)
        for layer in metrics["layers"]:
            layer["intrinsic_dimension"] = {"twonn": float(rng.uniform(2, 30)), "mle": 1.0, "mom": 1.0}
            layer["anisotropy_batch_mean"] = float(rng.random())
        (tmp_path / "r" / rev / "metrics.json").write_text(json.dumps(metrics))
        runs[rev] = np.mean([layer["intrinsic_dimension"]["twonn"] for layer in metrics["layers"][1:]])
    build.build([tmp_path / "r"], tmp_path / "report")
    figures = tmp_path / "report" / "figures"
    for stem in ("intrinsic_dimension_twonn_by_layer", "anisotropy_batch_mean_by_layer", "intrinsic_dimension_training"):
        assert (figures / f"{stem}.png").exists() and (figures / f"{stem}.svg").exists(), stem
    rows = list(csv.reader(open(figures / "intrinsic_dimension_training.csv")))[1:]
    assert {r[1]: float(r[3]) for r in rows} == pytest.approx(runs, rel=1e-12)
