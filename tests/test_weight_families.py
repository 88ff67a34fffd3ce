"""python -m isojax.weights on random tiny checkpoints of every family it knows, built with
transformers' own classes and saved with save_pretrained: the right tensors, measured as an
independent float64 computation from the safetensors file says, tied embeddings once."""

import csv
import json

import numpy as np
import pytest
import transformers as T
from safetensors.numpy import load_file, save_file

from conftest import need
from isojax.weights import isotropy

from test_weights import close, ref_ln, ref_matrix, run_cli

torch = need("torch")

SMALL = dict(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
OPT = dict(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
           max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
LAYERNORM = ("layernorm", "rmsnorm", "layernorm_no_affine", "none")
B_KEYS = {"avgnorm_b", "norm_b", "b_over_g", "outlier_dims_b", "gao_sum", "b_parallel", "b_parallel_norm",
          "b_perp_norm", "b_perp_over_g"}

# name -> (config, class, embedding, unembedding (None: tied), final norm kind, its weight, its bias)
CASES = {
    "gpt2": (lambda: T.GPT2Config(vocab_size=120, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=0,
                                  eos_token_id=0),
             T.GPT2LMHeadModel, "transformer.wte.weight", None, "layernorm", "transformer.ln_f.weight",
             "transformer.ln_f.bias"),
    "opt": (lambda: T.OPTConfig(**OPT, word_embed_proj_dim=32), T.OPTForCausalLM, "model.decoder.embed_tokens.weight",
            None, "layernorm", "model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.bias"),
    "opt-350m-like": (lambda: T.OPTConfig(**OPT, word_embed_proj_dim=16, do_layer_norm_before=False),
                      T.OPTForCausalLM, "model.decoder.embed_tokens.weight", None, "none", None, None),
    "falcon": (lambda: T.FalconConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      bos_token_id=0, eos_token_id=0),
               T.FalconForCausalLM, "transformer.word_embeddings.weight", None, "layernorm",
               "transformer.ln_f.weight", "transformer.ln_f.bias"),
    "llama": (lambda: T.LlamaConfig(**SMALL), T.LlamaForCausalLM, "model.embed_tokens.weight", "lm_head.weight",
              "rmsnorm", "model.norm.weight", None),
    "llama-tied": (lambda: T.LlamaConfig(**SMALL, tie_word_embeddings=True), T.LlamaForCausalLM,
                   "model.embed_tokens.weight", None, "rmsnorm", "model.norm.weight", None),
    "mistral": (lambda: T.MistralConfig(**SMALL), T.MistralForCausalLM, "model.embed_tokens.weight",
                "lm_head.weight", "rmsnorm", "model.norm.weight", None),
    "qwen2": (lambda: T.Qwen2Config(**SMALL), T.Qwen2ForCausalLM, "model.embed_tokens.weight", "lm_head.weight",
              "rmsnorm", "model.norm.weight", None),
    "qwen2-tied": (lambda: T.Qwen2Config(**SMALL, tie_word_embeddings=True), T.Qwen2ForCausalLM,
                   "model.embed_tokens.weight", None, "rmsnorm", "model.norm.weight", None),
    "olmo": (lambda: T.OlmoConfig(**SMALL), T.OlmoForCausalLM, "model.embed_tokens.weight", "lm_head.weight",
             "layernorm_no_affine", None, None),
    "olmo2": (lambda: T.Olmo2Config(**SMALL), T.Olmo2ForCausalLM, "model.embed_tokens.weight", "lm_head.weight",
              "rmsnorm", "model.norm.weight", None),
    "gemma": (lambda: T.GemmaConfig(**SMALL, head_dim=16, num_key_value_heads=1), T.GemmaForCausalLM,
              "model.embed_tokens.weight", None, "rmsnorm", "model.norm.weight", None),
    "phi": (lambda: T.PhiConfig(**SMALL), T.PhiForCausalLM, "model.embed_tokens.weight", "lm_head.weight", "layernorm",
            "model.final_layernorm.weight", "model.final_layernorm.bias"),
    "gpt_neox-tied": (lambda: T.GPTNeoXConfig(**SMALL, tie_word_embeddings=True), T.GPTNeoXForCausalLM,
                      "gpt_neox.embed_in.weight", None, "layernorm", "gpt_neox.final_layer_norm.weight",
                      "gpt_neox.final_layer_norm.bias"),
}


def build(case: str, path, seed: int = 0) -> dict:
    """A random checkpoint of `case` with trained-looking embeddings and final norm; its tensors."""
    make, cls, embed, unembed, _, g, b = CASES[case]
    torch.manual_seed(seed)
    model = cls(make())
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in {embed, unembed} - {None}:
            params[name].mul_(40).add_(torch.randn(params[name].shape[1]) * 0.3)
        if g:
            params[g].uniform_(0.5, 1.5)
        if b:
            params[b].normal_(0, 0.2)
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with isotropy.blas_threads(1):
        yield


def measure(ckpt, out, *extra):
    assert run_cli(["--model", ckpt, "--out", out, "--no-plots", *extra]) == 0
    return json.loads((out / "weights.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_family(case, tmp_path):
    _, _, embed, unembed, norm, g, b = CASES[case]
    t = build(case, tmp_path / "ckpt")
    out = measure(tmp_path / "ckpt", tmp_path / "o")
    family = json.loads((tmp_path / "ckpt/config.json").read_text())["model_type"]
    assert (out["family"], out["tied"]) == (family, unembed is None)
    assert out["embed_in"]["tensor"] == embed
    close(out["embed_in"], ref_matrix(t[embed]))
    if unembed is None:  # tied: measured once, and said so
        assert out["embed_out"] == {"tied_to": "embed_in", "tensor": embed}
        assert all(not k.startswith("embed_out") for k in np.load(tmp_path / "o/arrays.npz").files)
    else:
        assert out["embed_out"]["tensor"] == unembed
        close(out["embed_out"], ref_matrix(t[unembed]))
    ln = out["final_ln"]
    assert (ln["norm"], ln["tensor_g"], ln["tensor_b"]) == (norm, g, b)
    assert set(ln) == {"norm", "tensor_g", "tensor_b"} | set(isotropy.NORM_KEYS)
    if norm == "layernorm":
        close(ln, ref_ln(t[g], t[b]))
    elif norm == "rmsnorm":  # weight only: what needs a bias is null, not 0; Gemma's gain is 1 + its weight
        gain = t[g].astype(np.float64) + (1.0 if family == "gemma" else 0.0)
        close(ln, {"avgnorm_g": np.linalg.norm(gain) / np.sqrt(t[g].size)})
        assert all(ln[k] is None for k in B_KEYS)
    else:  # no weights at all (OLMo's LayerNorm) or no final norm (OPT-350m)
        assert all(ln[k] is None for k in isotropy.NORM_KEYS)


def test_names_without_the_base_prefix(tmp_path):
    """Hub uploads of GPT-2 (`wte.weight`, `ln_f.weight`) and OPT (`decoder.embed_tokens.weight`)
    lack the base model's prefix; a tied checkpoint may store lm_head too (equal: still tied)."""
    t = build("gpt2", tmp_path / "gpt2")
    ref = measure(tmp_path / "gpt2", tmp_path / "o1")
    save_file({k.removeprefix("transformer."): v for k, v in t.items()}, str(tmp_path / "gpt2/model.safetensors"))
    out = measure(tmp_path / "gpt2", tmp_path / "o2")
    assert out["embed_in"]["tensor"] == "wte.weight" and out["final_ln"]["tensor_b"] == "ln_f.bias"
    for key in ("embed_in", "final_ln"):
        assert {k: v for k, v in out[key].items() if not k.startswith("tensor")} == \
            {k: v for k, v in ref[key].items() if not k.startswith("tensor")}
    t = build("opt", tmp_path / "opt")
    stored = {k.removeprefix("model."): v for k, v in t.items()}
    save_file({**stored, "lm_head.weight": stored["decoder.embed_tokens.weight"]}, str(tmp_path / "opt/model.safetensors"))
    out = measure(tmp_path / "opt", tmp_path / "o3")
    assert out["tied"] and out["embed_out"] == {"tied_to": "embed_in", "tensor": "decoder.embed_tokens.weight"}
    close(out["embed_in"], ref_matrix(t["model.decoder.embed_tokens.weight"]))


def test_tied_config_with_a_different_head(tmp_path, capsys):
    """As transformers: a stored lm_head that differs from the embedding is not tied to it."""
    t = build("falcon", tmp_path / "f")
    head = np.random.default_rng(0).normal(size=t["transformer.word_embeddings.weight"].shape).astype(np.float32)
    save_file({**t, "lm_head.weight": head}, str(tmp_path / "f/model.safetensors"))
    capsys.readouterr()
    out = measure(tmp_path / "f", tmp_path / "o")
    assert not out["tied"] and out["embed_out"]["tensor"] == "lm_head.weight"
    close(out["embed_out"], ref_matrix(head))
    assert "stores a different lm_head.weight: measured as two matrices" in capsys.readouterr().err


def test_unknown_family_and_missing_tensors(tmp_path, capsys):
    t = build("llama", tmp_path / "m")
    cfg_path = tmp_path / "m/config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "model_type": "bert"}))
    capsys.readouterr()  # save_pretrained's progress
    assert run_cli(["--model", tmp_path / "m", "--out", tmp_path / "o"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json has model_type 'bert'; the weights command knows " \
        "falcon, gemma, gpt2, gpt_neox, llama, mistral, olmo, olmo2, opt, phi, qwen2 (use --tensor NAME" in err
    out = measure(tmp_path / "m", tmp_path / "o", "--tensor", "lm_head.weight")  # --tensor: any family
    close(out["tensors"]["lm_head.weight"], ref_matrix(t["lm_head.weight"]))
    cfg_path.write_text(json.dumps(cfg))
    save_file({k: v for k, v in t.items() if k != "lm_head.weight"}, str(tmp_path / "m/model.safetensors"))
    assert run_cli(["--model", tmp_path / "m", "--out", tmp_path / "o2"]) == 2  # untied, no lm_head
    assert "holds no lm_head.weight, which a llama checkpoint has" in capsys.readouterr().err


def _hub_stand_in(monkeypatch, ckpts: dict):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, revision=None, **kw: str(ckpts[revision]))


def test_olmo_sweep_steps_from_revision_names(monkeypatch, tmp_path):
    """OLMo-2's revisions sweep like Pythia's: sweep.csv's step from the name; stage 2 has none."""
    revs = ["stage1-step0-tokens0B", "stage1-step1000-tokens5B", "stage2-ingredient1-step1000-tokens5B"]
    ckpts = {r: tmp_path / f"c{i}" for i, r in enumerate(revs)}
    tensors = {r: build("olmo2", p, seed=i) for i, (r, p) in enumerate(ckpts.items())}
    _hub_stand_in(monkeypatch, ckpts)
    out = tmp_path / "sweep"
    assert run_cli(["--model", "allenai/OLMo-2-0425-1B", "--revisions", ",".join(revs), "--out", out,
                    "--no-plots"]) == 0
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [(r["revision"], r["step"]) for r in rows] == [(revs[0], "0"), (revs[1], "1000"), (revs[2], "")]
    for r in rows:
        assert float(r["embed_out.isotropy"]) == pytest.approx(
            ref_matrix(tensors[r["revision"]]["lm_head.weight"])["isotropy"], rel=1e-6)
        assert r["final_ln.avgnorm_b"] == ""  # RMSNorm: no bias


@pytest.mark.slow
def test_tied_sweep_plots(monkeypatch, tmp_path):
    """A sweep of a tied RMSNorm model plots its one matrix and only the norm statistics it has."""
    ckpts = {r: tmp_path / r for r in ("step0", "step1000")}
    for i, p in enumerate(ckpts.values()):
        build("qwen2-tied", p, seed=i)
    _hub_stand_in(monkeypatch, ckpts)
    out = tmp_path / "sweep"
    assert run_cli(["--model", "Qwen/Qwen2-0.5B", "--revisions", "step0,step1000", "--out", out]) == 0
    header = (out / "sweep.csv").read_text().splitlines()[0].split(",")
    assert "embed_in.isotropy" in header and not any(h.startswith("embed_out.") for h in header)
    assert sorted(p.name for p in out.glob("sweep_*.png")) == sorted(
        [f"sweep_{m}.png" for m in ("isotropy", "isotropy_one_sided", "isotropy_centered", "isotropy_pc_removed",
                                    "isotropy_scaled_centered", "mean_norm", "mean_vector_norm")]
        + ["sweep_final_ln_avgnorm_g_avgnorm_b.png"])


@pytest.mark.slow
def test_olmo_sweep_through_the_loopback_hub(tmp_path):
    """The real hub client: an OLMo-2 repo with stage1-stepN-tokensM branches, sharded; only the
    shards holding the embedding, the unembedding and the final norm are downloaded."""
    from hub_server import LoopbackHub
    from test_hub import hub_env, run

    revs = ["stage1-step0-tokens0B", "stage1-step1000-tokens5B"]
    branches = {}
    for i, rev in enumerate(revs):
        torch.manual_seed(i)
        model = T.Olmo2ForCausalLM(T.Olmo2Config(**{**SMALL, "num_hidden_layers": 4, "hidden_size": 64}))
        model.save_pretrained(tmp_path / rev, max_shard_size="200KB")
        branches[rev] = tmp_path / rev
    weight_map = json.loads((tmp_path / revs[0] / "model.safetensors.index.json").read_text())["weight_map"]
    wanted = {weight_map[n] for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    assert set(weight_map.values()) - wanted  # a shard of layers alone
    hub = LoopbackHub().start()
    try:
        hub.add_model("tiny-org/olmo2", branches)
        p = run("-m", "isojax.weights", "--model", "tiny-org/olmo2", "--revisions", ",".join(revs), "--no-plots",
                "--out", tmp_path / "w", env=hub_env(hub.url, tmp_path / "home"))
        assert p.returncode == 0, p.stderr[-3000:]
        shards = {name.rsplit("/", 1)[-1] for name in hub.downloads("tiny-org/olmo2") if name.endswith(".safetensors")}
    finally:
        hub.stop()
    assert shards == wanted
    rows = list(csv.DictReader(open(tmp_path / "w" / "sweep.csv")))
    assert [(r["revision"], r["step"]) for r in rows] == [(revs[0], "0"), (revs[1], "1000")]
