"""plot_metrics: writes readable PNGs from a metrics dict, skipping missing / NaN values."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.image
import numpy as np
import pytest

from isojax import plots


def _layer(name, i, n, intra=True):
    t = i / max(n - 1, 1)
    d = {"name": name, "count": 1000, "inter_sim": 0.1 + 0.6 * t, "anisotropy": 0.05 + 0.4 * t,
         "anisotropy_uncentered": 0.2 + 0.7 * t, "mean_norm": 1.0 + 500.0 * t ** 3, "norm_of_mean": 0.5 + 200 * t ** 3,
         "effective_rank": 60.0 - 40 * t, "unit_anisotropy": 0.1}
    if intra:
        d.update(intra_sim=0.4 + 0.5 * t, intra_sim_weighted=0.5 + 0.45 * t, intra_tokens=300)
    return d


def _metrics(n_blocks=6, intra=True, weights="pretrained", sources=True):
    names = ["embed"] + [f"block_{i}" for i in range(1, n_blocks + 1)] + ["final_ln"]
    n = len(names)
    m = {"model": "pythia-70m", "revision": "step143000", "weights": weights, "unit": "sentence",
         "tokens": 12345, "sequences": 100, "layers": [_layer(nm, i, n, intra) for i, nm in enumerate(names)]}
    if sources:
        src_b = [_layer(nm, i, n, intra=False) for i, nm in enumerate(names)]
        for layer in src_b:
            layer["inter_sim"] *= 0.8
        src_b[3]["inter_sim"] = math.nan
        src_a = [_layer(nm, i, n, intra=False) for i, nm in enumerate(names)]
        m["sources"] = {"wiki": {"tokens": 6000, "layers": src_a},
                        "code": {"tokens": 6345, "layers": src_b}}
    return m


def _check_png(path):
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200


@pytest.mark.slow
def test_all_plots_written(tmp_path):
    m = _metrics()
    m["layers"][2]["intra_sim"] = math.nan  # a NaN point is a gap, not an error
    paths = plots.plot_metrics(m, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["anisotropy.png", "norms.png", "similarity.png", "sources_anisotropy.png",
                     "sources_inter_sim.png"]
    for p in paths:
        assert p.exists()
        _check_png(p)


def test_missing_intra_and_no_sources(tmp_path):
    m = _metrics(intra=False, sources=False)
    m["revision"] = None
    del m["layers"][0]["norm_of_mean"]
    paths = plots.plot_metrics(m, tmp_path)
    assert sorted(p.name for p in paths) == ["anisotropy.png", "norms.png", "similarity.png"]
    _check_png(tmp_path / "similarity.png")


@pytest.mark.slow
def test_many_layers(tmp_path):
    paths = plots.plot_metrics(_metrics(n_blocks=48), tmp_path)
    assert len(paths) == 5
    for p in paths:
        _check_png(p)


@pytest.mark.slow
@pytest.mark.parametrize("weights,expect", [("random", True), ("pretrained", False)])
def test_random_weights_in_title(tmp_path, monkeypatch, weights, expect):
    titles = []
    orig = plots.plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        return orig(fig, *args, **kwargs)

    monkeypatch.setattr(plots.plt.Figure, "savefig", spy)
    plots.plot_metrics(_metrics(weights=weights), tmp_path)
    assert len(titles) == 5
    assert all(("RANDOM WEIGHTS" in t) == expect for t in titles)
    assert all("pythia-70m" in t for t in titles)


def test_empty_metrics(tmp_path):
    assert plots.plot_metrics({"model": "x", "layers": []}, tmp_path) == []
    from isojax.plots.run import _value
    assert np.isnan(_value({}, "inter_sim"))


@pytest.mark.slow
def test_user_rc_does_not_change_the_figures(tmp_path):
    """Figures are drawn under isojax's style whatever the user's rcParams say (a matplotlibrc with
    text.usetex would cost a LaTeX run per label; here thick lines, big fonts, a red background)."""
    ref = plots.plot_metrics(_metrics(), tmp_path / "ref")
    with matplotlib.rc_context({"lines.linewidth": 6, "font.size": 20, "figure.facecolor": "red",
                                "axes.prop_cycle": matplotlib.cycler(color=["k"])}):
        got = plots.plot_metrics(_metrics(), tmp_path / "user")
    assert [p.name for p in got] == [p.name for p in ref]
    for a, b in zip(ref, got):
        assert np.array_equal(matplotlib.image.imread(a), matplotlib.image.imread(b)), a.name
