"""python -m isojax.correlate: series from fake result folders (random numbers, no model run)
against downstream scores from lm-evaluation-harness results files or a CSV; correlations checked
against independent computations (numpy corrcoef, ranks by hand, Kendall by counting pairs)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from scipy import stats as sps

from isojax.report import correlate

REVISIONS = ["step0", "step1000", "step3000", "step13000", "step71000", "step143000"]
MODELS = {"pythia-70m": 6, "pythia-410m": 24}


def write_extract(folder, rng, model, revision, blocks):
    folder.mkdir(parents=True)
    names = ["embed"] + [f"block_{i}" for i in range(1, blocks + 1)] + ["final_ln"]
    layers = [{"name": n, "count": 1000, "intra_tokens": 50,
               **{k: float(rng.random()) for k in ("inter_sim", "intra_sim", "anisotropy")}} for n in names]
    (folder / "metrics.json").write_text(json.dumps({"model": f"EleutherAI/{model}", "revision": revision,
                                                     "tokens": 1000, "layers": layers}))
    (folder / "manifest.json").write_text(json.dumps({"corpus_fingerprint": "abc"}))
    return layers


def write_weights(folder, rng, model, revision):
    folder.mkdir(parents=True)
    doc = {"model": model, "revision": revision,
           "embed_in": {"isotropy": float(rng.random()), "rows": 512, "dim": 64},
           "embed_out": {"isotropy": float(rng.random()), "isotropy_centered": float(rng.random()), "rows": 512},
           "final_ln": {"avgnorm_g": float(rng.random()), "avgnorm_b": float(rng.random())}}
    (folder / "weights.json").write_text(json.dumps(doc))
    return doc


@pytest.fixture()
def world(tmp_path):
    """Extract and weights sweeps of two models, and a scores CSV for two tasks, all random."""
    rng = np.random.default_rng()  # fresh inputs every run: the references must hold for any data
    truth = {"layers": {}, "weights": {}, "scores": {}}
    rows = ["model,revision,task,score"]
    for model, blocks in MODELS.items():
        for rev in REVISIONS:
            truth["layers"][model, rev] = write_extract(tmp_path / "x" / model / rev, rng, model, rev, blocks)
            truth["weights"][model, rev] = write_weights(tmp_path / "w" / model / rev, rng, model, rev)
            for task in ("sciq/acc", "piqa/acc"):
                truth["scores"][model, rev, task] = float(rng.random())
                rows.append(f"EleutherAI/{model},{rev},{task},{truth['scores'][model, rev, task]!r}")
    (tmp_path / "scores.csv").write_text("\n".join(rows) + "\n")
    return tmp_path, truth


def _ranks(v):
    r = np.empty(len(v))
    r[np.argsort(v)] = np.arange(len(v))
    return r


def _kendall_tau_b_no_ties(x, y):
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    return s / len(pairs)


def _exact_p(stat, x, y):
    """Two-sided permutation p by brute force: orderings of y at least as far from 0 as y's."""
    obs = abs(stat(x, y))
    return np.mean([abs(stat(x, np.asarray(p))) >= obs - 1e-12 for p in itertools.permutations(y)])


def _pearson(x, y):
    return np.corrcoef(x, y)[0, 1]


def _spearman(x, y):
    return np.corrcoef(_ranks(x), _ranks(y))[0, 1]


def _check(entry, x, y):
    x, y = np.asarray(x), np.asarray(y)
    n = len(x)
    assert entry["n"] == n
    r = _pearson(x, y)
    assert entry["pearson"]["r"] == pytest.approx(r, abs=1e-12)
    assert entry["spearman"]["rho"] == pytest.approx(_spearman(x, y), abs=1e-12)
    assert entry["kendall"]["tau"] == pytest.approx(_kendall_tau_b_no_ties(x, y), abs=1e-12)
    if n <= correlate.EXACT_MAX_N:
        assert entry["p_method"] == "permutation"
        for key, stat in (("pearson", _pearson), ("spearman", _spearman), ("kendall", _kendall_tau_b_no_ties)):
            assert entry[key]["p"] == pytest.approx(_exact_p(stat, x, y), abs=1e-12), key
    else:
        assert entry["p_method"] == "scipy"
        t = r * np.sqrt((n - 2) / (1 - r * r))
        assert entry["pearson"]["p"] == pytest.approx(2 * sps.t.sf(abs(t), n - 2), rel=1e-6)
        assert 0 <= entry["kendall"]["p"] <= 1


@pytest.mark.slow
def test_small_n_p_values_are_exact():
    """At n = 3 a perfect rank correlation has p = 2/6 (two of six orderings reach |rho| = 1):
    scipy's asymptotic Spearman p is 0 there. Ties are permuted as they are; above n = 8 scipy's."""
    got = correlate.statistics([1.0, 2.0, 3.0], [0.1, 0.5, 0.7])
    assert got["p_method"] == "permutation"
    assert got["spearman"] == {"rho": 1.0, "p": pytest.approx(1 / 3)} and got["kendall"]["p"] == pytest.approx(1 / 3)
    rng = np.random.default_rng()
    x, y = rng.normal(size=7), rng.integers(0, 3, size=7).astype(float)  # ties in y
    got = correlate.permutation_p(x, y)
    tau = lambda a, b: sps.kendalltau(a, b).statistic  # noqa: E731  (tau-b, with ties)
    for key, stat in (("pearson", _pearson), ("spearman", lambda a, b: sps.spearmanr(a, b).statistic),
                      ("kendall", tau)):
        assert got[key] == pytest.approx(_exact_p(stat, x, y), abs=1e-12), key
    assert correlate.statistics(rng.normal(size=9), rng.normal(size=9))["p_method"] == "scipy"
    assert correlate.permutation_p([1, 2, 3], [5, 5, 5]) == {"pearson": None, "spearman": None, "kendall": None}


def test_defaults_by_checkpoint(world, capsys):
    root, truth = world
    out = root / "correlation.json"
    assert correlate.main([str(root / "x"), str(root / "w"), "--scores", str(root / "scores.csv"),
                           "--out", str(out)]) == 0
    entries = json.loads(out.read_text())
    keys = {(e["metric"], e["layer"]) for e in entries}
    for m in ("inter_sim", "intra_sim", "anisotropy"):
        assert {(m, "block_L"), (m, "final_ln")} <= keys
    assert {("embed_out.isotropy", None), ("final_ln.avgnorm_b", None), ("embed_in.isotropy", None)} <= keys
    assert not {k for k in keys if k[0] in ("count", "intra_tokens", "embed_in.rows", "embed_out.rows")}
    assert len(entries) == len(keys) * 2 * 2  # x 2 models x 2 tasks
    revs = REVISIONS[1:]  # step0 left out, as in the paper
    for e in entries:
        model = e["group"].split("/")[-1]
        assert e["by"] == "checkpoint" and [p["revision"] for p in e["points"]] == revs
        y = [truth["scores"][model, r, e["task"]] for r in revs]
        if e["layer"] is None:
            group, metric = e["metric"].split(".")
            x = [truth["weights"][model, r][group][metric] for r in revs]
        else:
            idx = -2 if e["layer"] == "block_L" else -1
            assert e["layer_name"] == truth["layers"][model, revs[0]][idx]["name"]
            x = [truth["layers"][model, r][idx][e["metric"]] for r in revs]
        assert [p["value"] for p in e["points"]] == x and [p["score"] for p in e["points"]] == y
        _check(e, x, y)
    table = capsys.readouterr().out
    assert "pearson r (p)" in table and "EleutherAI/pythia-410m" in table and "block_24" in table


def test_by_model_with_two_models_has_nothing_to_correlate(world, capsys):
    root, _ = world
    msg = _error(capsys, [str(root / "x"), "--scores", str(root / "scores.csv"), "--metric", "inter_sim",
                          "--layer", "final_ln", "--by", "model", "--out", str(root / "c.json")])
    assert "fewer than 3 points" in msg


def test_by_model_needs_three_models(world, tmp_path, capsys):
    root, truth = world
    rng = np.random.default_rng()
    extra = {}
    for rev in REVISIONS:
        extra[rev] = write_extract(root / "x" / "pythia-1b" / rev, rng, "pythia-1b", rev, 16)
        with open(root / "scores.csv", "a") as f:
            f.write(f"EleutherAI/pythia-1b,{rev},sciq/acc,{rev[4:]}\n")
            f.write(f"EleutherAI/pythia-1b,{rev},piqa/acc,0.5\n")
    out = root / "m.json"
    assert correlate.main([str(root / "x"), "--scores", str(root / "scores.csv"), "--metric", "inter_sim",
                           "--layer", "final_ln", "--by", "model", "--task", "sciq/acc", "--out", str(out)]) == 0
    entries = json.loads(out.read_text())
    assert [e["group"] for e in entries] == REVISIONS[1:]  # in training order
    for e in entries:
        rev = e["group"]
        assert [p["model"] for p in e["points"]] == ["EleutherAI/pythia-70m", "EleutherAI/pythia-410m",
                                                     "EleutherAI/pythia-1b"]  # ordered by size
        x = [truth["layers"]["pythia-70m", rev][-1]["inter_sim"], truth["layers"]["pythia-410m", rev][-1]["inter_sim"],
             extra[rev][-1]["inter_sim"]]
        y = [truth["scores"]["pythia-70m", rev, "sciq/acc"], truth["scores"]["pythia-410m", rev, "sciq/acc"],
             float(rev[4:])]
        _check(e, x, y)


def _error(capsys, argv):
    assert correlate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and not any("Traceback" in line for line in err), err
    return err[-1]


def test_missing_scores(world, capsys):
    root, _ = world
    lines = (root / "scores.csv").read_text().splitlines()
    kept = [line for line in lines if not line.startswith("EleutherAI/pythia-70m,step3000,")]
    (root / "scores.csv").write_text("\n".join(kept) + "\n")
    msg = _error(capsys, [str(root / "x"), "--scores", str(root / "scores.csv"), "--out", str(root / "c.json")])
    assert "no downstream score" in msg and "EleutherAI/pythia-70m@step3000" in msg and "--allow-missing" in msg
    assert str(root / "x" / "pythia-70m" / "step3000") in msg
    assert not (root / "c.json").exists()
    assert correlate.main([str(root / "x"), "--scores", str(root / "scores.csv"), "--out", str(root / "c.json"),
                           "--allow-missing", "--metric", "inter_sim"]) == 0
    assert "warning: skipped, no score: EleutherAI/pythia-70m@step3000" in capsys.readouterr().err
    entries = json.loads((root / "c.json").read_text())
    small = [e for e in entries if e["group"] == "EleutherAI/pythia-70m"]
    assert small and all(e["n"] == 4 and "step3000" not in [p["revision"] for p in e["points"]] for e in small)
    # a model without any score at all
    (root / "scores.csv").write_text("model,revision,task,score\nEleutherAI/pythia-12b,main,sciq/acc,0.5\n")
    assert "no score matches a result" in _error(
        capsys, [str(root / "x"), "--scores", str(root / "scores.csv"), "--out", str(root / "d.json")])


def test_bad_inputs(world, capsys):
    root, _ = world
    x, out = str(root / "x"), str(root / "c.json")
    bad = root / "bad.csv"
    bad.write_text("model,revision,score\nEleutherAI/pythia-70m,step1000,0.5\n")
    assert "needs the columns model,revision,task,score" in _error(capsys, [x, "--scores", str(bad), "--out", out])
    bad.write_text("model,revision,task,score\nEleutherAI/pythia-70m,step1000,sciq,high\n")
    assert f"{bad}:2: score 'high' is not a number" in _error(capsys, [x, "--scores", str(bad), "--out", out])
    assert "no metric 'isotropy'" in _error(capsys, [x, "--scores", str(root / "scores.csv"), "--metric", "isotropy",
                                                     "--out", out])
    assert "no layer 'block_99'" in _error(capsys, [x, "--scores", str(root / "scores.csv"), "--layer", "block_99",
                                                    "--out", out])
    (root / "c.json").write_text("[]")
    assert "pass --overwrite" in _error(capsys, [x, "--scores", str(root / "scores.csv"), "--out", out])
    assert "expected a result folder" in _error(capsys, [str(root / "scores.csv"), "--scores", str(bad), "--out", out])


def lm_eval_results(model_args, sciq_acc, *, shots=0, model_revision=None):
    """A results_<date>.json as lm-evaluation-harness (0.4.x) writes it (EvaluationTracker)."""
    pretrained = model_args["pretrained"] if isinstance(model_args, dict) else \
        model_args.split("pretrained=")[1].split(",")[0]
    return {
        "results": {
            "sciq": {"alias": "sciq", "acc,none": sciq_acc, "acc_stderr,none": 0.0136,
                     "acc_norm,none": sciq_acc - 0.1, "acc_norm_stderr,none": 0.0149},
            "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.02, "exact_match_stderr,strict-match": 0.004,
                      "exact_match,flexible-extract": 0.03, "exact_match_stderr,flexible-extract": "N/A"},
            "mmlu_anatomy": {"alias": "  - anatomy", "acc,none": 0.25, "acc_stderr,none": 0.03},
        },
        "groups": {"mmlu": {"alias": "mmlu", "acc,none": 0.2295, "acc_stderr,none": 0.0035}},
        "group_subtasks": {"mmlu": ["mmlu_anatomy"], "sciq": [], "gsm8k": []},
        "configs": {"sciq": {"task": "sciq", "dataset_path": "allenai/sciq", "num_fewshot": shots,
                             "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                             "metadata": {"version": 1.0}}},
        "versions": {"sciq": 1.0, "gsm8k": 3.0, "mmlu": 2, "mmlu_anatomy": 1.0},
        "n-shot": {"sciq": shots, "gsm8k": 5, "mmlu_anatomy": 0},
        "higher_is_better": {"sciq": {"acc": True, "acc_norm": True}, "gsm8k": {"exact_match": True}},
        "n-samples": {"sciq": {"original": 1000, "effective": 1000}, "gsm8k": {"original": 1319, "effective": 1319}},
        "config": {"model": "hf", "model_args": model_args, "model_num_parameters": 70426624,
                   "model_dtype": "torch.float16", "model_revision": model_revision or "main", "model_sha": "a39f36b1",
                   "batch_size": "auto", "batch_sizes": [64], "device": "cuda:0", "use_cache": None, "limit": None,
                   "bootstrap_iters": 100000, "gen_kwargs": None, "random_seed": 0, "numpy_seed": 1234,
                   "torch_seed": 1234, "fewshot_seed": 1234},
        "git_hash": "4e7e0d4", "date": 1764150000.123, "pretty_env_info": "PyTorch version: 2.5.1",
        "transformers_version": "4.46.3", "lm_eval_version": "0.4.9", "upper_git_hash": None,
        "tokenizer_pad_token": ["<|endoftext|>", "0"], "tokenizer_eos_token": ["<|endoftext|>", "0"],
        "tokenizer_bos_token": ["<|endoftext|>", "0"], "eot_token_id": 0, "max_length": 2048, "task_hashes": {},
        "model_source": "hf", "model_name": pretrained, "model_name_sanitized": pretrained.replace("/", "__"),
        "system_instruction": None, "system_instruction_sha": None, "fewshot_as_multiturn": False,
        "chat_template": None, "chat_template_sha": None, "start_time": 1234.5, "end_time": 1300.25,
        "total_evaluation_time_seconds": "65.75",
    }


def test_lm_eval_results_parsing(tmp_path):
    doc = lm_eval_results("pretrained=EleutherAI/pythia-70m,revision=step3000,dtype=float16", 0.755)
    got = {s.task: s for s in correlate.parse_lm_eval(doc, "r.json")}
    assert set(got) == {"sciq/acc", "sciq/acc_norm", "gsm8k/exact_match[strict-match]@5shot",
                        "gsm8k/exact_match[flexible-extract]@5shot", "mmlu_anatomy/acc", "mmlu/acc"}
    assert got["sciq/acc"].value == 0.755 and got["sciq/acc_norm"].value == pytest.approx(0.655)
    assert {(s.model, s.revision) for s in got.values()} == {("EleutherAI/pythia-70m", "step3000")}
    # model_args as a dict; revision from config.model_revision; n-shot in the task name
    doc = lm_eval_results({"pretrained": "EleutherAI/pythia-410m", "dtype": "float16"}, 0.8, shots=5,
                          model_revision="step1000")
    got = {s.task: s for s in correlate.parse_lm_eval(doc, "r.json")}
    assert got["sciq/acc@5shot"].value == 0.8 and got["sciq/acc@5shot"].revision == "step1000"
    assert got["sciq/acc@5shot"].model == "EleutherAI/pythia-410m"
    doc = lm_eval_results("pretrained=EleutherAI/pythia-160m", 0.7)
    assert {s.revision for s in correlate.parse_lm_eval(doc, "r.json")} == {"main"}


def test_lm_eval_folder_end_to_end(world, capsys):
    """lm-eval's own layout OUT/<model_name_sanitized>/results_<date>.json (samples_* ignored)."""
    root, truth = world
    scores = root / "lm-eval-out"
    for model in MODELS:
        for i, rev in enumerate(REVISIONS):
            d = scores / f"EleutherAI__{model}"
            d.mkdir(parents=True, exist_ok=True)
            args = f"pretrained=EleutherAI/{model},revision={rev},dtype=float16"
            (d / f"results_2026-11-26T10-{i:02d}-00.123456.json").write_text(
                json.dumps(lm_eval_results(args, truth["scores"][model, rev, "sciq/acc"]), indent=2))
            (d / f"samples_sciq_2026-11-26T10-{i:02d}-00.123456.jsonl").write_text("{}\n")
    out = root / "c.json"
    assert correlate.main([str(root / "w"), "--scores", str(scores), "--metric", "embed_out.isotropy",
                           "--task", "sciq/acc", "--out", str(out)]) == 0
    entries = json.loads(out.read_text())
    assert len(entries) == 2
    for e in entries:
        model = e["group"].split("/")[-1]
        revs = REVISIONS[1:]
        _check(e, [truth["weights"][model, r]["embed_out"]["isotropy"] for r in revs],
               [truth["scores"][model, r, "sciq/acc"] for r in revs])
    # a second file with another value for the same model, revision and task is refused
    d = scores / "EleutherAI__pythia-70m"
    (d / "results_2026-11-27T00-00-00.json").write_text(json.dumps(lm_eval_results(
        "pretrained=EleutherAI/pythia-70m,revision=step1000", 0.123)))
    msg = _error(capsys, [str(root / "w"), "--scores", str(scores), "--out", str(root / "d.json")])
    assert "two scores for EleutherAI/pythia-70m@step1000 sciq/acc" in msg


def test_constant_series_is_null(tmp_path):
    rng = np.random.default_rng()
    for i, rev in enumerate(["step1", "step2", "step3", "step4"]):
        write_weights(tmp_path / "w" / rev, rng, "pythia-70m", rev)
    (tmp_path / "s.csv").write_text("model,revision,task,score\n" + "".join(
        f"pythia-70m,step{i},t,0.5\n" for i in range(1, 5)))
    from isojax.report import collect
    res = collect.load([tmp_path / "w"])
    entries = correlate.correlate(res, correlate.load_scores([tmp_path / "s.csv"]),
                                  [correlate.Spec("embed_out.isotropy", None)])
    assert len(entries) == 1 and entries[0]["n"] == 4
    assert entries[0]["pearson"] == {"r": None, "p": None} and entries[0]["spearman"]["rho"] is None
    json.dumps(entries, allow_nan=False)


def test_help_speaks_to_users():
    text = correlate.build_parser().format_help()
    assert "DESIGN.md" not in text and "p_method" in text and "permutation" in text


def test_only_finite_points_count(world, capsys):
    """NaN and infinite scores leave their pairs out: n counts the finite pairs and the statistics
    are scipy.stats' (p: the exact permutation p) on them; below 3 finite pairs every coefficient
    and p is null together; each such series gets one log line naming it."""
    root, truth = world
    lines = (root / "scores.csv").read_text().splitlines()
    bad = {("pythia-70m", "step3000"): "nan", ("pythia-70m", "step13000"): "inf",
           ("pythia-410m", "step1000"): "nan", ("pythia-410m", "step3000"): "-inf", ("pythia-410m", "step13000"): "nan"}
    for (model, rev), text in bad.items():
        lines = [f"EleutherAI/{model},{rev},sciq/acc,{text}" if line.startswith(f"EleutherAI/{model},{rev},sciq/acc,")
                 else line for line in lines]
    (root / "scores.csv").write_text("\n".join(lines) + "\n")
    out = root / "c.json"
    assert correlate.main([str(root / "x"), "--scores", str(root / "scores.csv"), "--metric", "inter_sim",
                           "--layer", "final_ln", "--task", "sciq/acc", "--out", str(out)]) == 0
    entries = {e["group"]: e for e in json.loads(out.read_text())}
    small, large = entries["EleutherAI/pythia-70m"], entries["EleutherAI/pythia-410m"]
    revs = ["step1000", "step71000", "step143000"]
    assert small["n"] == 3 and [p["revision"] for p in small["points"]] == revs
    x = [truth["layers"]["pythia-70m", r][-1]["inter_sim"] for r in revs]
    y = [truth["scores"]["pythia-70m", r, "sciq/acc"] for r in revs]
    for key, coef, ref in (("pearson", "r", sps.pearsonr), ("spearman", "rho", sps.spearmanr),
                           ("kendall", "tau", sps.kendalltau)):
        assert small[key][coef] == pytest.approx(ref(x, y).statistic, abs=1e-12), key
        assert small[key]["p"] == pytest.approx(_exact_p(lambda a, b: ref(a, b).statistic, np.array(x), np.array(y)),
                                                abs=1e-12), key
    assert large["n"] == 2 and large["p_method"] is None
    assert large["pearson"] == {"r": None, "p": None} and large["spearman"] == {"rho": None, "p": None}
    assert large["kendall"] == {"tau": None, "p": None}
    err = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert err == [
        "isojax: sciq/acc ~ inter_sim at final_ln (EleutherAI/pythia-70m): 2 of 5 points left out, their score or "
        "metric is NaN or infinite",
        "isojax: sciq/acc ~ inter_sim at final_ln (EleutherAI/pythia-410m): 3 of 5 points left out, their score or "
        "metric is NaN or infinite; fewer than 3 finite points, so every coefficient and p is null"]
    nan = float("nan")
    assert correlate.statistics([1, 2, 3, 4], [0.1, nan, 0.3, float("inf")])["pearson"] == {"r": None, "p": None}
    got = correlate.statistics([1, 2, 3, 4, 5], [0.1, nan, 0.3, 0.2, 0.5])
    assert got["spearman"]["rho"] == pytest.approx(sps.spearmanr([1, 3, 4, 5], [0.1, 0.3, 0.2, 0.5]).statistic)


def test_report_shows_no_p_without_its_coefficient():
    """An earlier version's correlation.json (NaN scores: r null, p 0.0, n counting the NaN points)
    is shown with neither, and n the finite points."""
    from isojax.report import correlation
    entry = {"metric": "inter_sim", "layer": "final_ln", "task": "sciq/acc", "by": "checkpoint", "group": "m", "n": 4,
             "pearson": {"r": None, "p": 0.0}, "spearman": {"rho": None, "p": 0.0}, "kendall": {"tau": 0.5, "p": 0.3},
             "points": [{"value": 0.1, "score": v} for v in (0.2, None, 0.4, 0.5)]}
    sec = correlation.section([entry], ["c.json"])
    full, pivot = sec.items[-1].table, sec.items[0].table
    assert full.rows == [["checkpoint", "m", "sciq/acc", "inter_sim", "final_ln", 3, "–", "–", "–", "–", "0.500", "0.3"]]
    assert pivot.rows == [["sciq/acc", 3, "–", "–", "–", "–", "0.500 ns", "0.3"]]


def test_report_table_shows_n_and_p_and_marks_what_is_not_significant():
    """Table 1 in the report: rho = 1.000 at n = 4 has the exact p 2/4! = 0.083 (only the two monotone
    orderings reach |rho| = 1): shown with n and p and marked ns; at n = 8 (p = 2/8!) unmarked."""
    from isojax.report import correlation
    entries = []
    for group, n in (("four", 4), ("eight", 8)):
        x, y = np.arange(n, dtype=float), np.exp(np.arange(n))
        entries.append({"metric": "inter_sim", "layer": "final_ln", "task": "sciq/acc", "by": "checkpoint",
                        "group": group, "n": n, **correlate.statistics(x, y)})
    pivot = correlation.section(entries, ["c.json"]).items[0].table
    assert pivot.columns == ["task"] + [f"{g} {c}" for g in ("four", "eight")
                                        for c in ("n", "r", "p", "ρ", "p", "τ", "p")]
    four, eight = pivot.rows[0][1:8], pivot.rows[0][8:]
    assert four[0] == 4 and four[3:5] == ["1.000 ns", format(2 / 24, ".2g")] and four[5:7] == ["1.000 ns", "0.083"]
    assert four[1].endswith(" ns") and float(four[2]) > correlation.ALPHA
    assert eight[0] == 8 and eight[3:] == ["1.000", format(2 / 40320, ".2g"), "1.000", format(2 / 40320, ".2g")]


def test_smallest_p_of_each_statistic():
    """The help and README state the smallest exact p: 1/n! for Pearson (one ordering can be the only
    one that far from 0), 2/n! for Spearman and Kendall (the reversed ranks reach the same value)."""
    import math
    import pathlib
    claim = "the smallest possible p\nis 1/n! for Pearson and 2/n! for Spearman and Kendall"
    assert claim in correlate.build_parser().format_help()
    readme = " ".join(pathlib.Path(correlate.__file__).parents[2].joinpath("README.md").read_text().split())
    assert " ".join(claim.split()) + " (the reversed ranks reach the same |statistic|): at n = 3, 1/6 and 1/3" in readme
    rng = np.random.default_rng()
    for n in (3, 4, 5):
        least = {"pearson": 1.0, "spearman": 1.0, "kendall": 1.0}
        for x, y in [(np.exp(np.arange(n)), np.exp(np.arange(n)))] + [
                (rng.normal(size=n), rng.normal(size=n)) for _ in range(200)]:
            for key, p in correlate.permutation_p(x, y).items():
                least[key] = min(least[key], p)
        assert least["pearson"] == pytest.approx(1 / math.factorial(n))
        assert least["spearman"] == pytest.approx(2 / math.factorial(n)) == least["kendall"]


def test_lm_eval_of_a_local_checkpoint(tmp_path):
    """lm-eval names a local checkpoint by its path (pretrained=/ckpts/tiny/step1000, revision main):
    its scores meet the run `tiny @ step1000` that weights and extract name it."""
    from isojax.run.names import checkpoint_name
    rng = np.random.default_rng()
    repo, scores, truth = tmp_path / "ckpts" / "tiny", tmp_path / "lm-eval-out", {}
    revs = ["step1000", "step2000", "step3000", "step4000"]
    for i, rev in enumerate(revs):
        (repo / rev).mkdir(parents=True)
        (repo / rev / "config.json").write_text("{}")
        model, revision = checkpoint_name(str(repo), rev)  # as `weights --model DIR --revisions ...` names it
        assert (model, revision) == ("tiny", rev)
        truth[rev] = write_weights(tmp_path / "w" / rev, rng, model, revision)["embed_out"]["isotropy"]
        folder = scores / str(repo / rev).strip("/").replace("/", "__")
        folder.mkdir(parents=True)
        (folder / "results_2026-11-26T10-00-00.json").write_text(json.dumps(
            lm_eval_results(f"pretrained={repo / rev},dtype=float16", 0.5 + 0.1 * i)))
    out = tmp_path / "c.json"
    assert correlate.main([str(tmp_path / "w"), "--scores", str(scores), "--metric", "embed_out.isotropy",
                           "--task", "sciq/acc", "--out", str(out)]) == 0
    [entry] = json.loads(out.read_text())
    assert entry["group"] == "tiny" and [p["revision"] for p in entry["points"]] == revs
    _check(entry, [truth[r] for r in revs], [0.5 + 0.1 * i for i in range(4)])
    # the same from a CSV that names the checkpoint by its path
    (tmp_path / "s.csv").write_text("model,revision,task,score\n" + "".join(
        f"{repo / r},,t,{i}\n" for i, r in enumerate(revs)))
    assert {(s.model, s.revision) for s in correlate.load_scores([tmp_path / "s.csv"])} == {
        ("tiny", r) for r in revs}
