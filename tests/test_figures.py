"""Figure review as a test: every figure isojax draws (a run's plots, the report's figures, the
weights command's figures), for a model of 2 blocks and one of 24, from synthetic inputs (no
model runs). Each figure is checked as it is saved, for what matplotlib can measure: tick
labels do not overlap, per-layer axes are labelled with integers or layer names, titles say
RANDOM WEIGHTS where the weights are random, legends cover no data point or bar."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from isojax import plots
from isojax.weights import isotropy
from isojax.weights import command as weights_cli
from isojax.plots import weights as weight_plots
from isojax.report import build
from isojax.report.collect import Run

from test_outputs_measures import fake_layer
from test_plots import _metrics
from test_report import REVISIONS, write_extract, write_weights

BLOCKS = (2, 24)
LAYER_LABEL = re.compile(r"\d+|embed|final_ln")


def _review_saves(mp) -> list:
    """From now on every figure saved is drawn and reviewed at its first save; returns the list
    that receives (file name, titles, number of layer axes) of each."""
    out = []
    orig = Figure.savefig

    def review(fig, fname, *args, **kwargs):
        # marked on the figure itself: an id() is reused once a closed figure is freed
        if not getattr(fig, "_isojax_reviewed", False):
            fig._isojax_reviewed = True
            out.append(_review(fig, str(fname)))
        return orig(fig, fname, *args, **kwargs)

    mp.setattr(Figure, "savefig", review)
    return out


@pytest.fixture
def drawn(monkeypatch):
    return _review_saves(monkeypatch)


def _shown(axis, ax) -> list:
    """Tick labels drawn: visible, not empty, their tick inside the view."""
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    span = hi - lo
    return [t for t in labels if t.get_visible() and t.get_text()
            and lo - 1e-9 * span <= t.get_position()[0 if axis == "x" else 1] <= hi + 1e-9 * span]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5


def _review(fig, name: str):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    titles = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    layer_axes = 0
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        titles.append(ax.get_title())
        for axis in ("x", "y"):
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _shown(axis, ax)]
            for i, (ta, a) in enumerate(boxes):
                for tb, b in boxes[i + 1:]:
                    assert not _overlap(a, b), f"{name}: {axis} tick labels {ta!r} and {tb!r} overlap"
        if ax.get_xlabel().startswith("layer"):
            layer_axes += 1
            ticks = ax.get_xticks()
            assert np.array_equal(ticks, np.round(ticks)), f"{name}: layer ticks at {ticks}"
            texts = [t.get_text() for t in _shown("x", ax)]
            assert len(texts) >= 2 and all(LAYER_LABEL.fullmatch(t) for t in texts), f"{name}: {texts}"
            assert texts[0] == "embed", f"{name}: {texts}"
        _no_line_hidden_without_a_word(ax, name)
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent(renderer)
            for line in ax.get_lines():
                xy = line.get_transform().transform(line.get_xydata())
                xy = xy[np.isfinite(xy).all(axis=1)]
                inside = ((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1))
                assert not inside.any(), f"{name}: the legend covers points of {line.get_label()!r}"
            for patch in ax.patches:
                if isinstance(patch, Rectangle) and patch.get_height():
                    assert not _overlap(box, patch.get_window_extent(renderer)), f"{name}: the legend covers a bar"
    return name, titles, layer_axes


def _no_line_hidden_without_a_word(ax, name: str) -> None:
    """A labelled line whose drawn data a later line of about its width repeats (to 0.5% of the y range)
    says so in its label."""
    drawn = [(line.get_label(), np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float),
              line.get_linewidth()) for line in ax.get_lines()]
    finite = np.concatenate([y[np.isfinite(y)] for _, _, y, _ in drawn] + [np.zeros(0)])
    tol = 0.005 * np.ptp(finite) if finite.size else 0.0
    for i, (label, x, y, width) in enumerate(drawn):  # a line wider by a point than the one over it shows
        if label.startswith("_") or not np.isfinite(y).any():
            continue
        over = [lb for lb, x2, y2, w2 in drawn[i + 1:] if x2.shape == x.shape and np.array_equal(x2, x)
                and np.array_equal(np.isnan(y2), np.isnan(y)) and np.all(np.abs(y2 - y)[np.isfinite(y)] <= tol)
                and width <= w2 + 1.0]
        assert not over or f"(same values as\n{over[-1]}, under it)" in label, \
            f"{name}: {label!r} hidden under {over[-1]!r}"


def test_intra_sim_by_band_names_a_line_hidden_under_another(tmp_path):
    """The report's intra_sim_by_band figure of a 6-block model whose block_6 and final_ln have the same
    IntraSim in every band: the drawn block_6 line holds its data, and its legend entry says it lies
    under final_ln (rings around the final_ln points); the other lines keep their plain labels."""
    from isojax.report import collect, states
    from isojax.report.document import Figures
    rng = np.random.default_rng(5)
    names = ["embed"] + [f"block_{i}" for i in range(1, 7)] + ["final_ln"]
    layers = [fake_layer(rng, n) for n in names]
    for layer in layers:
        layer["intra_sim_by_band"] = [{"lo": 2 ** k, "hi": 2 ** (k + 1), "tokens": 3, "intra_sim": float(rng.random())}
                                      for k in range(1, 6)]
    layers[-2]["intra_sim_by_band"] = [dict(b) for b in layers[-1]["intra_sim_by_band"]]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"model": "m", "revision": None, "weights": "pretrained",
                                                               "tokens": 100, "layers": layers}))
    kept = []

    class Kept(Figures):
        def add(self, fig, name, caption, table):
            kept.append(fig)
            return super().add(fig, name, caption, table)

    states.bands(collect.Results([collect._extract_run(tmp_path / "run")], [], []), Kept(tmp_path / "figs"))
    lines = {line.get_label().split("\n")[0]: line for line in kept[0].axes[0].get_lines()}
    assert list(lines) == ["embed", "block_3", "block_6", "final_ln"]
    want = [b["intra_sim"] for b in layers[-1]["intra_sim_by_band"]]
    assert lines["block_6"].get_ydata().tolist() == want == lines["final_ln"].get_ydata().tolist()
    assert lines["block_6"].get_label() == "block_6\n(same values as\nfinal_ln, under it)"
    assert lines["block_6"].get_markerfacecolor() == "none" and lines["block_6"].get_markersize() > \
        lines["final_ln"].get_markersize()
    assert [lines[n].get_label() for n in ("embed", "block_3", "final_ln")] == ["embed", "block_3", "final_ln"]
    legend = [t.get_text() for t in kept[0].axes[0].get_legend().get_texts()]
    assert "block_6\n(same values as\nfinal_ln, under it)" in legend
    _no_line_hidden_without_a_word(kept[0].axes[0], "intra_sim_by_band")


def _random_title(titles) -> bool:
    return any("RANDOM WEIGHTS" in t for t in titles)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("weights", ["random", "pretrained"])
def test_run_plots(tmp_path, drawn, blocks, weights):
    m = _metrics(n_blocks=blocks, weights=weights)
    for i, layer in enumerate(m["layers"]):
        layer["intrinsic_dimension"] = {"twonn": 8.0 + i, "mle": 9.0 + i, "mom": 7.5 + i}
    paths = plots.plot_metrics(m, tmp_path)
    assert len(drawn) == len(paths) == 6
    for name, titles, layer_axes in drawn:
        assert layer_axes == 1, name
        assert _random_title(titles) == (weights == "random"), (name, titles)


@pytest.fixture(scope="module")
def report_figures(tmp_path_factory):
    """A report from results of a 2-block and a 24-block model, all with random weights, at four
    revisions; figures reviewed as they are saved."""
    root = tmp_path_factory.mktemp("results")
    rng = np.random.default_rng(3)
    cka = {}
    for model, blocks in (("pythia-70m", BLOCKS[0]), ("pythia-410m", BLOCKS[1])):
        for rev in REVISIONS:
            metrics = write_extract(root / "x" / model / rev, rng, model, rev, blocks)
            for layer in metrics["layers"]:
                layer.update({k: v for k, v in fake_layer(rng, layer["name"]).items() if k not in layer})
                layer["intrinsic_dimension"] = {"twonn": float(rng.uniform(2, 30)), "mle": 1.0, "mom": 1.0}
                layer["anisotropy_batch_mean"] = float(rng.random())
            names = [layer["name"] for layer in metrics["layers"]]
            (root / "x" / model / rev / "cka.json").write_text(json.dumps(
                {"layers": names, "tokens": 100, "matrix": rng.random((len(names), len(names))).tolist()}))
            cka.setdefault(f"EleutherAI/{model}", {"final": REVISIONS[-1], "layers": names, "tokens": 100,
                                                   "checkpoints": {}})["checkpoints"][rev] = \
                rng.random((len(names), len(names))).tolist()
            doc = write_weights(root / "w" / model / rev, rng, model, rev, rows=2000)
            for path, d in ((root / "x" / model / rev / "metrics.json", metrics),
                            (root / "w" / model / rev / "weights.json", doc)):
                path.write_text(json.dumps({**d, "weights": "random"}))
    (root / "x" / "sweep_cka.json").write_text(json.dumps(cka))
    with pytest.MonkeyPatch.context() as mp:
        reviewed = _review_saves(mp)
        build.build([root], tmp_path_factory.mktemp("rep") / "report")
    return reviewed


@pytest.mark.slow
def test_report_figures(report_figures):
    names = {n.rsplit("/", 1)[-1].rsplit(".", 1)[0]: (titles, layers) for n, titles, layers in report_figures}
    for stem in ("inter_sim_by_layer", "anisotropy_by_layer", "intrinsic_dimension_twonn_by_layer",
                 "sources_inter_sim", "isotropy_embed_out_sizes", "svd2d_embed_out", "layernorm_training",
                 "isoscore_by_layer", "alpha_req_last_layer_training", "diff_erank_pooled_last_layer_training",
                 "inter_sim_by_position", "inter_sim_by_position_training", "cka_layers", "cka_training"):
        assert stem in names, sorted(names)
    for stem, (titles, layers) in names.items():
        assert _random_title(titles), (stem, titles)
        if stem.endswith("_by_layer"):
            assert layers == 1, stem
        if stem.startswith("sources_") or stem in ("inter_sim_by_position", "cka_layers"):
            assert layers == 2, stem  # one panel per model


def _run(random: bool) -> Run:
    return Run("weights", None, {"weights": "random" if random else "pretrained"}, None,
               "EleutherAI/pythia-70m", "main", "pythia-70m")


def test_titles_name_random_runs_among_trained_ones():
    from isojax.report.states import titled
    assert titled("I(W)", [_run(False)], final=True) == "I(W), final checkpoints"
    assert titled("I(W)", [_run(True), _run(True)], final=True) == "I(W) — RANDOM WEIGHTS"
    assert titled("I(W)", [_run(False), _run(True)]).endswith("RANDOM WEIGHTS: pythia-70m")


@pytest.mark.parametrize("scale", ["flat", "two_decades", "steep"])
def test_weights_matrix_figures(tmp_path, drawn, scale):
    """An embedding-like matrix (values ~0.02: tick labels such as -0.075 need room) whose
    normalized singular values fall by less than a decade, by two, or by eight."""
    rng = np.random.default_rng(0)
    decay = {"flat": np.ones(64), "two_decades": np.logspace(0, -2, 64), "steep": np.logspace(0, -8, 64)}[scale]
    W = 0.02 * rng.normal(size=(3000, 64)) * decay + 0.01
    weight_plots.matrix_plots(isotropy.analyze_matrix(W), "embed_in", tmp_path,
                              weights_cli.model_label("random:pythia-70m"), "embed_in")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["embed_in_singular_values.png", "embed_in_svd2d.png"]
    assert len(drawn) == 2
    for name, titles, _ in drawn:
        assert _random_title(titles), name


@pytest.mark.slow
def test_singular_values_axis(monkeypatch, tmp_path):
    """log only when the values span more than a decade, with at least three labelled ticks;
    the uncentered line drawn wide and pale under the centered one; a mathtext axis label."""
    rng = np.random.default_rng(1)
    got = {}

    def keep(fig, fname, *args, **kwargs):
        if "singular_values" in str(fname):
            fig.canvas.draw()
            ax = fig.axes[0]
            got[fname.name] = (ax.get_yscale(), [t.get_text() for t in _shown("y", ax)], ax.get_ylabel(),
                               {line.get_label(): line for line in ax.get_lines()})

    monkeypatch.setattr(Figure, "savefig", keep)
    for key, decay in (("flat", np.ones(32)), ("two", np.logspace(0, -2, 32))):
        weight_plots.matrix_plots(isotropy.analyze_matrix(rng.normal(size=(400, 32)) * decay), key, tmp_path,
                                  "m", "")
    scale, labels, ylabel, lines = got["flat_singular_values.png"]
    assert scale == "linear" and ylabel == r"$\sigma_k / \sigma_1$"
    scale, labels, _, lines = got["two_singular_values.png"]
    assert scale == "log" and len(labels) >= 5, labels  # 1, 2 and 5 times each power of ten
    un, ce = lines["uncentered"], lines["centered"]
    assert un.get_linewidth() > 2 * ce.get_linewidth() and un.get_zorder() < ce.get_zorder()
    assert isinstance(un, Line2D) and un.get_alpha() < 1


@pytest.mark.slow
def test_weights_sweep_figures(tmp_path, drawn):
    rows = [{"revision": f"step{s}", "step": s, **{f"{g}.{m}": float(np.cos(s / 3e4 + i))
                                                  for i, g in enumerate(("embed_in", "embed_out"))
                                                  for m in weights_cli.MATRIX_METRICS},
             **{f"final_ln.{m}": 0.5 for ms in weights_cli.LN_METRICS for m in ms}}
            for s in (0, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 143000)]
    weight_plots.sweep_plots(rows, ["embed_in", "embed_out"], weights_cli.MATRIX_METRICS, weights_cli.LN_METRICS,
                             tmp_path, weights_cli.model_label("random:pythia-70m"))
    assert len(drawn) == len(weights_cli.MATRIX_METRICS) + len(weights_cli.LN_METRICS)
    for name, titles, _ in drawn:
        assert _random_title(titles), name
