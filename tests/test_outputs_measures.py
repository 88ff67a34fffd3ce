"""Issue 37's measures in every output: layers.csv / sweep.csv columns (lists flattened),
Diff-eRank and sweep_cka.json in sweeps, --format parquet, isojax.load, correlate's metric list
and the report. The measures themselves are faked here (metrics.json written by hand, random
numbers); one real extract run shows the existing keys flow into layers.parquet and isojax.load."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

import isojax
from isojax.errors import UserError
from isojax.run import results, sweep, sweep_files
from isojax.stats import measures
from isojax.stats.geometry import linear_cka

# the measures the report's measures section draws: those not registered, and the registered ones drawn there
NEW_SCALARS = list(dict.fromkeys(["isoscore", "isoscore_star", "rogue_share_top3", "inter_sim_standardized",
                                  "massive_max", "massive_max_over_sample_median", "feature_kurtosis", "alpha_req",
                                  "effective_rank", "erank_pooled", "erank", "massive_count", "massive_top1",
                                  *measures.drawn(), *(c for m in measures.dict_valued().values()
                                                       for c in m.columns())]))
BANDS = [(0, 1), (1, 16), (16, 128), (128, None)]
POS_COLUMNS = ["inter_sim_pos_0", "inter_sim_pos_1_16", "inter_sim_pos_16_128", "inter_sim_pos_128_"]


def fake_layer(rng, name: str, d: int = 16) -> dict:
    """A metrics.json layer with every measure of MEASURES.md, random values."""
    layer = {"name": name, "count": 500, "inter_sim": float(rng.random()),
             **{k: float(rng.random()) for k in NEW_SCALARS}, "null_eigenvalues": 0, "rank_deficient": False,
             "massive_dim": int(rng.integers(d)), "massive_token": int(rng.integers(50000)),
             "massive_position": int(rng.integers(64)),
             "rogue_dims": [{"dim": int(i), "share": float(rng.random())} for i in rng.permutation(d)[:3]],
             "inter_sim_by_position": [{"lo": lo, "hi": hi, "tokens": 10, "inter_sim": float(rng.random())}
                                       for lo, hi in BANDS],
             "intrinsic_dimension": {"twonn": 3.0, "mle": 4.0, "mom": 5.0},
             "massive_dims": [{"dim": 3, "count": 5}, {"dim": 1, "count": 2}]}
    layer["rogue_share_top3"] = sum(r["share"] for r in layer["rogue_dims"])
    return layer


def write_step(folder, rng, model="EleutherAI/pythia-70m", revision="step0", blocks=2, tokens=800,
               sample=None, fingerprint="abc"):
    folder.mkdir(parents=True)
    names = ["embed"] + [f"block_{i}" for i in range(1, blocks + 1)] + ["final_ln"]
    metrics = {"model": model, "revision": revision, "weights": "pretrained", "tokens": tokens,
               "layers": [fake_layer(rng, n) for n in names]}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "manifest.json").write_text(json.dumps({"corpus_fingerprint": fingerprint, "corpus": "pile"}))
    if sample is not None:
        results.write_zarr(folder / "samples.zarr" / "states", sample.astype(np.float32))
    return metrics


def test_flat_layer_flattens_rogue_dims_and_position_bands():
    layer = fake_layer(np.random.default_rng(0), "block_1")
    row = results.flat_layer(layer)
    for i, r in enumerate(layer["rogue_dims"], 1):
        assert row[f"rogue_dim_{i}"] == r["dim"] and row[f"rogue_share_{i}"] == r["share"]
    assert [row[c] for c in POS_COLUMNS] == [b["inter_sim"] for b in layer["inter_sim_by_position"]]
    for k in NEW_SCALARS + ["massive_dim", "massive_token", "massive_position"]:
        assert row[k] == layer[k]
    assert "rogue_dims" not in row and "inter_sim_by_position" not in row
    assert row["massive_dims"] == "3:5 1:2"
    renamed = results.flat_layer({"massive_ratio": 7.0})  # read under its new name, registered measures null
    assert renamed == {"massive_max_over_sample_median": 7.0, **{k: None for k in measures.columns()}}
    assert row["intrinsic_dimension_twonn"] == 3.0


def _cka_reference(x, y):
    """Kornblith's HSIC form on K x K Grams, float64: <HKH, HLH> / (||HKH|| ||HLH||)."""
    k = x.shape[0]
    h = np.eye(k) - 1.0 / k
    a, b = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    return np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b))


@pytest.mark.parametrize("k,d", [(40, 16), (12, 16)])  # the D x D and the K x K paths
def test_cka_against_and_linear_cka_equal_the_hsic_reference(k, d):
    from isojax.stats.cross_cka import CkaAgainst
    rng = np.random.default_rng(k)
    xs = rng.normal(size=(3, k, d)) * rng.uniform(0.1, 5, size=d) + 3.0
    ys = rng.normal(size=(4, k, d)) @ rng.normal(size=(d, d))
    got = CkaAgainst(ys.astype(np.float32)).matrix(xs.astype(np.float32))
    x32, y32 = xs.astype(np.float32).astype(np.float64), ys.astype(np.float32).astype(np.float64)
    for i in range(3):
        for j in range(4):
            ref = _cka_reference(x32[i], y32[j])
            assert got[i][j] == pytest.approx(ref, abs=1e-10)
            assert linear_cka(x32[i], y32[j]) == pytest.approx(ref, abs=1e-10)
    assert linear_cka(x32[0], x32[0]) == pytest.approx(1.0, abs=1e-12)
    assert CkaAgainst(ys[:1]).matrix(np.ones((1, k, d))) == [[None]]  # a constant state


@pytest.fixture
def swept(tmp_path):
    """A sweep of two models at three steps written by hand; the samples hold the same tokens (K = 30)
    except pythia-160m's step1000 (K = 20) and pythia-160m's step0 (another corpus)."""
    rng = np.random.default_rng(7)
    out = tmp_path / "sweep"
    steps, samples = [], {}
    for model in ("pythia-70m", "pythia-160m"):
        for rev in ("step0", "step1000", "step2000"):
            k = 20 if (model, rev) == ("pythia-160m", "step1000") else 30
            samples[model, rev] = rng.normal(size=(4, k, 16))
            write_step(out / model / rev, rng, f"EleutherAI/{model}", rev, sample=samples[model, rev],
                       fingerprint="other" if (model, rev) == ("pythia-160m", "step0") else "abc")
            steps.append(sweep.Step(model, rev, out / model / rev))
    return out, steps, samples


def test_sweep_files_hold_every_measure(swept, capsys):
    out, steps, samples = swept
    sweep.write_sweep_csv(out, steps, parquet=True)
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == 6 * 4
    cols = rows[0].keys()
    for c in NEW_SCALARS + POS_COLUMNS + ["diff_erank_pooled", "diff_erank", "diff_erank_baseline", "rogue_dim_1",
                                          "rogue_share_3", "massive_position", "massive_dims"]:
        assert c in cols, c
    for model in ("pythia-70m", "pythia-160m"):
        docs = {r: json.loads((out / model / r / "metrics.json").read_text()) for r in ("step0", "step2000")}
        row = next(r for r in rows if r["model"] == f"EleutherAI/{model}" and r["revision"] == "step2000"
                   and r["name"] == "block_2")
        for key in ("erank_pooled", "erank"):
            want = docs["step0"]["layers"][2][key] - docs["step2000"]["layers"][2][key]
            assert float(row[f"diff_{key}"]) == pytest.approx(want, abs=1e-12)
        assert row["diff_erank_baseline"] == "step0"
        assert float(row["inter_sim_pos_16_128"]) == docs["step2000"]["layers"][2]["inter_sim_by_position"][2][
            "inter_sim"]
    import pandas as pd
    table = pd.read_parquet(out / "sweep.parquet")
    assert list(table.columns) == list(cols) and len(table) == len(rows)
    assert table["diff_erank_pooled"].tolist() == pytest.approx([float(r["diff_erank_pooled"]) for r in rows])

    cka = json.loads((out / "sweep_cka.json").read_text())
    entry = cka["EleutherAI/pythia-70m"]
    assert entry["final"] == "step2000" and entry["tokens"] == 30 and entry["layers"][0] == "embed"
    for rev in ("step0", "step1000", "step2000"):
        m = entry["checkpoints"][rev]
        x, y = samples["pythia-70m", rev].astype(np.float32), samples["pythia-70m", "step2000"].astype(np.float32)
        for i in range(4):
            for j in range(4):
                assert m[i][j] == pytest.approx(_cka_reference(x[i].astype(float), y[j].astype(float)), abs=1e-10)
    other = cka["EleutherAI/pythia-160m"]["checkpoints"]
    assert other["step0"] is None and other["step1000"] is None and other["step2000"][0][0] == pytest.approx(1.0)
    err = capsys.readouterr().err
    assert "pythia-160m @ step1000 is null: its sample holds 20 tokens" in err
    assert "pythia-160m @ step0 is null: its corpus fingerprint differs" in err
    from isojax.run import outdir
    assert outdir.read_record(out)["names"] == ["sweep.csv", "sweep.parquet", "sweep_cka.json"]

    df = isojax.load(out)
    assert list(df.columns[:6]) == ["model", "revision", "step", "layer", "layer_index", "tokens"]
    assert len(df) == 24 and set(NEW_SCALARS + POS_COLUMNS + ["diff_erank_pooled"]) <= set(df.columns)
    got = df.set_index(["model", "revision", "layer"])["diff_erank_pooled"]
    csv_rows = {(r["model"], r["revision"], r["name"]): float(r["diff_erank_pooled"]) for r in rows}
    assert all(got[k] == pytest.approx(v, abs=1e-12) for k, v in csv_rows.items())
    assert df["step"].tolist()[:4] == [0, 0, 0, 0]


def test_sweep_cka_null_without_a_final_sample(tmp_path, capsys):
    rng = np.random.default_rng(1)
    write_step(tmp_path / "m" / "step0", rng, sample=rng.normal(size=(4, 10, 16)))
    write_step(tmp_path / "m" / "step9", rng, revision="step9")
    doc = sweep_files.sweep_cka({"m": [("step9", tmp_path / "m" / "step9"), ("step0", tmp_path / "m" / "step0")]})
    assert doc == {"m": None} and "final checkpoint step9 has no sample" in capsys.readouterr().err


def test_load_a_run_and_refuse_a_folder_without_results(tmp_path):
    rng = np.random.default_rng(2)
    metrics = write_step(tmp_path / "run", rng, revision=None, blocks=3)
    df = isojax.load(tmp_path / "run")
    assert df["layer"].tolist() == ["embed", "block_1", "block_2", "block_3", "final_ln"]
    assert df["layer_index"].tolist() == list(range(5)) and set(df["revision"]) == {"main"}
    assert df["step"].isna().all() and "diff_erank_pooled" not in df.columns
    assert df["rogue_share_2"].tolist() == [layer["rogue_dims"][1]["share"] for layer in metrics["layers"]]
    assert isojax.load(tmp_path / "run" / "metrics.json").equals(df)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no isojax results"):
        isojax.load(tmp_path / "empty")
    with pytest.raises(UserError, match="no such folder"):
        isojax.load(tmp_path / "nothing")


def test_load_keeps_separate_runs_apart_and_layers_in_model_order(tmp_path):
    """Two runs of one model (plain, --skip-positions 1) in one folder are two runs, not two
    checkpoints: told apart by run and skip_positions, no diff_erank_pooled; a sweep beside them keeps its
    own; layers sort and pivot in the model's order (block_2 before block_10)."""
    rng = np.random.default_rng(3)
    plain = write_step(tmp_path / "plain", rng, revision=None, blocks=10)
    skip = write_step(tmp_path / "skip1", rng, revision=None, blocks=10)
    settings = {"skip_positions": 1, "dtype": "float32"}
    (tmp_path / "skip1" / "manifest.json").write_text(json.dumps({"settings": settings}))
    df = isojax.load(tmp_path)
    assert len(df) == 2 * 12 and "diff_erank_pooled" not in df.columns
    assert df[df["run"] == "skip1"]["skip_positions"].tolist() == [1] * 12
    assert df[df["run"] == "plain"]["skip_positions"].isna().all()
    assert df[df["run"] == "skip1"]["inter_sim"].tolist() == [layer["inter_sim"] for layer in skip["layers"]]
    table = df.pivot(index="run", columns="layer", values="inter_sim")
    names = ["embed"] + [f"block_{i}" for i in range(1, 11)] + ["final_ln"]
    assert [str(c) for c in table.columns] == names
    assert table.loc["plain"].tolist() == [layer["inter_sim"] for layer in plain["layers"]]
    assert df.sort_values(["run", "layer"])["layer"].astype(str).tolist()[:12] == names

    first = write_step(tmp_path / "sweep" / "m" / "step0", rng, model="m", revision="step0")
    last = write_step(tmp_path / "sweep" / "m" / "step9", rng, model="m", revision="step9")
    write_step(tmp_path / "sweep" / "other", rng, model="m", revision="step5")  # a run beside the sweep
    df = isojax.load(tmp_path / "sweep")
    assert df["run"].unique().tolist() == ["m/step0", "other", "m/step9"]
    got = df[df["run"] == "m/step9"]["diff_erank_pooled"].tolist()
    assert got == pytest.approx([a["erank_pooled"] - b["erank_pooled"]
                                 for a, b in zip(first["layers"], last["layers"])])
    assert df[df["run"] == "other"]["diff_erank_pooled"].isna().all()


def test_correlate_takes_the_new_measures(tmp_path):
    from isojax.report import collect, correlate
    rng = np.random.default_rng(3)
    scores = ["model,revision,task,score"]
    truth = {}
    for rev in ("step1000", "step2000", "step3000", "step4000"):
        m = write_step(tmp_path / "x" / rev, rng, revision=rev)
        truth[rev] = (m["layers"][-1]["isoscore"], m["layers"][-1]["inter_sim_by_position"][0]["inter_sim"],
                      float(rng.random()))
        scores.append(f"EleutherAI/pythia-70m,{rev},sciq/acc,{truth[rev][2]!r}")
    (tmp_path / "s.csv").write_text("\n".join(scores) + "\n")
    res = collect.load([tmp_path / "x"])
    have = correlate.layer_metrics(res)
    assert set(NEW_SCALARS + POS_COLUMNS + ["rogue_share_1"]) <= set(have)
    assert not {"massive_dim", "massive_token", "rogue_dim_1"} & set(have)  # ids, not measures
    entries = correlate.correlate(res, correlate.load_scores([tmp_path / "s.csv"]),
                                  correlate.specs(res, ["isoscore", "inter_sim_pos_0"], ["final_ln"]))
    for metric, col in (("isoscore", 0), ("inter_sim_pos_0", 1)):
        entry = next(e for e in entries if e["metric"] == metric)
        x = [truth[r][col] for r in sorted(truth, key=lambda r: int(r[4:]))]
        y = [truth[r][2] for r in sorted(truth, key=lambda r: int(r[4:]))]
        assert entry["pearson"]["r"] == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)


def test_report_draws_every_measure_and_skips_absent_ones(swept, tmp_path):
    from isojax.report import build
    out, steps, _ = swept
    (out / "pythia-160m" / "step0" / "manifest.json").write_text(json.dumps({"corpus_fingerprint": "abc"}))
    sweep.write_sweep_csv(out, steps)
    run = out / "pythia-70m" / "step2000"
    names = ["embed", "block_1", "block_2", "final_ln"]
    (run / "cka.json").write_text(json.dumps({"layers": names, "tokens": 30,
                                              "matrix": np.eye(4).tolist()}))
    old = tmp_path / "old" / "pythia-410m" / "main"  # an older result: none of the new measures
    write_step(old, np.random.default_rng(5), "EleutherAI/pythia-410m", "main")
    doc = json.loads((old / "metrics.json").read_text())
    doc["layers"] = [{"name": layer["name"], "inter_sim": 0.5} for layer in doc["layers"]]
    (old / "metrics.json").write_text(json.dumps(doc))
    build.build([out, tmp_path / "old"], tmp_path / "rep")
    figs = {p.stem for p in (tmp_path / "rep" / "figures").glob("*.png")}
    keyed = [c for m in measures.dict_valued().values() for c in m.columns()]  # gride_2 ...: one figure, a line each
    for key in NEW_SCALARS:
        assert key in keyed or f"{key}_by_layer" in figs and f"{key}_last_layer_training" in figs, key
    for stem in ("diff_erank_pooled_last_layer_training", "diff_erank_last_layer_training", "inter_sim_by_position",
                 "inter_sim_by_position_training", "cka_layers", "cka_training", "gride", "gride_training",
                 "similarity_consecutive", "similarity_consecutive_training",
                 # the steps' metrics.json hold the measures (read out, as their manifests predate the record)
                 "cka_debiased_to_final_training", "procrustes_distance_to_final_training"):
        assert stem in figs, stem
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "top 3 rogue dimensions of each layer" in md and "largest |activation| of each layer" in md
    assert "Massive activations as Sun et al. 2024 define them" in md and "3:5 1:2" in md
    with open(tmp_path / "rep" / "figures" / "isoscore_by_layer.csv") as f:
        assert "pythia-410m" not in next(csv.reader(f))  # the old run has no isoscore: left out of the figure
    with open(tmp_path / "rep" / "figures" / "inter_sim_by_layer.csv") as f:
        assert "pythia-410m" in next(csv.reader(f))
    build.build([tmp_path / "old"], tmp_path / "rep_old")  # only old results: the section says so
    assert "No extract results with these measures" in (tmp_path / "rep_old" / "report.md").read_text()


@pytest.mark.slow
def test_extract_format_parquet_and_load(tmp_path, monkeypatch):
    """A real extract run with --format parquet: layers.parquet equals layers.csv, recorded with the
    other results; isojax.load gives the same numbers as metrics.json."""
    from conftest import build_hf_checkpoint
    from isojax.extract import main
    from isojax.run import outdir
    import pandas as pd
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    build_hf_checkpoint(tmp_path / "ckpt", vocab_size=50304, hidden_size=32, num_layers=1, num_heads=2)
    (tmp_path / "c.txt").write_text("A sentence of text. Another one here.\n" * 20)
    out = tmp_path / "out"
    assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "c.txt"), "--seq-len", "32",
                 "--batch-tokens", "128", "--out", str(out), "--no-plots", "--format", "parquet"]) == 0
    assert "layers.parquet" in outdir.read_record(out)["names"]
    table = pd.read_parquet(out / "layers.parquet")
    with open(out / "layers.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(table.columns) == list(rows[0]) and len(table) == len(rows) == 3
    metrics = json.loads((out / "metrics.json").read_text())
    assert table["inter_sim"].tolist() == [layer["inter_sim"] for layer in metrics["layers"]]
    df = isojax.load(out)
    assert df["inter_sim"].tolist() == table["inter_sim"].tolist()
    assert df["layer"].tolist() == ["embed", "block_1", "final_ln"] and (df["tokens"] == metrics["tokens"]).all()
