"""GPT-2, OPT, Falcon and the Llama family (Llama, Mistral, Qwen2, OLMo, OLMo-2) against Hugging Face
PyTorch float32: random checkpoints of several shapes built with transformers' own classes
(norms and biases randomized), all L+2 states, packed rows, and an extract run's metrics against
float64 metrics of Hugging Face's states."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import TOKENIZER_JSON, max_rel_error, need
from isojax import load_model
from isojax.errors import UserError
from isojax.hf.family import from_hf_dict

VOCAB = 320

# family -> shapes: (config kwargs of the transformers class) with tiny widths; kv heads 1, 2 and 4.
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
SHAPES = {
    "llama": [dict(LLAMA, num_key_value_heads=2), dict(LLAMA, num_key_value_heads=1, num_hidden_layers=3,
                                                       attention_bias=True, mlp_bias=True, head_dim=32,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                                       tie_word_embeddings=True)],
    "mistral": [dict(LLAMA, num_key_value_heads=2, sliding_window=4096),
                dict(LLAMA, num_key_value_heads=3, sliding_window=None, hidden_size=96, num_attention_heads=6)],
    "qwen2": [dict(LLAMA, num_key_value_heads=2), dict(LLAMA, num_key_value_heads=1, num_hidden_layers=3,
                                                       tie_word_embeddings=True)],
    "olmo": [dict(LLAMA, num_key_value_heads=4), dict(LLAMA, num_key_value_heads=2, clip_qkv=0.5)],
    "olmo2": [dict(LLAMA, num_key_value_heads=4), dict(LLAMA, num_key_value_heads=2, num_hidden_layers=3)],
    "gpt2": [dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
             dict(vocab_size=VOCAB, n_embd=96, n_layer=3, n_head=2, n_inner=80, n_positions=64,
                  activation_function="gelu")],
    "opt": [dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, word_embed_proj_dim=64),
            dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=80, num_hidden_layers=3, num_attention_heads=2,
                 max_position_embeddings=64, word_embed_proj_dim=64, enable_bias=False,
                 layer_norm_elementwise_affine=False, tie_word_embeddings=False)],
    # multi-query with one shared norm (Falcon-7B), multi-head sequential with biases, and the new
    # architecture with grouped queries and two norms (Falcon-40B) or one
    "falcon": [dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
               dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
                    num_kv_heads=4, parallel_attn=False, bias=True, tie_word_embeddings=False),
               dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                    new_decoder_architecture=True, num_kv_heads=2, bias=True, ffn_hidden_size=96),
               dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1)],
    # multi-query with head_dim given (gemma-2b: 8 heads of 256, 1 key/value head); grouped, untied,
    # the released files' legacy hidden_act "gelu" (the tanh GELU in transformers)
    "gemma": [dict(LLAMA, num_key_value_heads=1, head_dim=32),
              dict(LLAMA, num_key_value_heads=2, head_dim=16, num_hidden_layers=3, hidden_act="gelu",
                   tie_word_embeddings=False)],
    # partial rotary (phi-2: 0.4 of heads of 80; here 0.5 of 16 and 0.25 of 32), parallel attention and
    # MLP through one LayerNorm, gelu_new; grouped key/value heads in the second
    "phi": [dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
            dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, partial_rotary_factor=0.25, hidden_act="gelu")],
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "olmo": ("OlmoConfig", "OlmoForCausalLM"),
           "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
           "opt": ("OPTConfig", "OPTForCausalLM"), "falcon": ("FalconConfig", "FalconForCausalLM"),
           "gemma": ("GemmaConfig", "GemmaForCausalLM"), "phi": ("PhiConfig", "PhiForCausalLM")}
CASES = [(family, i) for family, shapes in SHAPES.items() for i in range(len(shapes))]
FAST = {("llama", 0), ("falcon", 0), ("gpt2", 0), ("gemma", 0), ("phi", 0)}  # pytest -m "not slow": one per reader's code path


def build(directory, family: str, seed: int = 0, tokenizer: bool = False, **kwargs):
    """A transformers model of the family with random weights, norms and biases randomized too,
    saved with save_pretrained (safetensors)."""
    torch = need("torch")
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.ndim == 1:  # norm scales
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    if tokenizer:
        from transformers import PreTrainedTokenizerFast
        PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON)).save_pretrained(directory)
    return model


def hf_states(model, ids) -> np.ndarray:
    """Hugging Face's L+1 hidden states plus the raw last block (a forward hook on the last layer:
    HF's last entry is after the final norm), [L+2, T, D] float64."""
    torch = need("torch")

    trunk = model.base_model
    layers = getattr(trunk, "layers", None) or getattr(trunk, "h", None) or trunk.decoder.layers
    captured = {}
    hook = layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = trunk(torch.as_tensor(np.asarray(ids, np.int64))[None], output_hidden_states=True)
    finally:
        hook.remove()
    hs = [h[0].double().numpy() for h in out.hidden_states]
    return np.stack(hs[:-1] + [captured["x"][0].double().numpy(), hs[-1]])


@pytest.mark.parametrize("family,shape", [pytest.param(f, i, marks=[] if (f, i) in FAST else pytest.mark.slow)
                                          for f, i in CASES], ids=[f"{f}-{i}" for f, i in CASES])
def test_states_match_hugging_face(tmp_path, family, shape):
    kwargs = SHAPES[family][shape]
    model = build(tmp_path, family, seed=shape, **kwargs)
    ours = load_model(tmp_path)
    assert ours.config.family == family
    layers = ours.config.num_layers
    rng = np.random.default_rng(shape)
    # ids from 3: OLMo's and OPT's pad token (1) embeds to zero, a vector no relative error is defined for
    a, b = rng.integers(3, VOCAB, size=29), rng.integers(3, VOCAB, size=18)
    ref_a, ref_b = hf_states(model, a), hf_states(model, b)
    got = ours.hidden_states(a)
    assert got.shape == (layers + 2, 29, ours.config.hidden_size)
    for s, name in enumerate(ours.config.state_names):
        assert max_rel_error(got[s], ref_a[s]) < 1e-5, name
    assert max_rel_error(got[-2], ref_a[-1]) > 1e-2  # the raw last block is not the final norm's output
    # both sequences packed in one row (positions restart), padding after them
    t = 64
    tokens, seg, pos = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
    tokens[0, :29], tokens[0, 29:47] = a, b
    seg[0, :29], seg[0, 29:47] = 1, 2
    pos[0, :29], pos[0, 29:47] = np.arange(29), np.arange(18)
    packed = ours.hidden_states_packed(tokens, seg, pos)
    assert max_rel_error(packed[:, 0, :29], ref_a) < 1e-5
    assert max_rel_error(packed[:, 0, 29:47], ref_b) < 1e-5


def test_gemma_embedding_normalizer_is_rounded_to_the_weights_dtype(tmp_path):
    """Gemma's embeddings times sqrt(d) with the normalizer in the weights' dtype, as transformers:
    in bfloat16, sqrt(48) = 6.928 is 6.9375, and the embed state is Hugging Face's bit for bit (the
    product by the float32 normalizer, rounded once, differs)."""
    torch = need("torch")

    model = build(tmp_path, "gemma", **dict(SHAPES["gemma"][0], hidden_size=48, head_dim=12))
    ids = np.arange(3, 40)
    with torch.no_grad():
        ref = model.to(torch.bfloat16).base_model(torch.as_tensor(ids)[None], output_hidden_states=True)
    got = load_model(tmp_path, dtype="bfloat16").hidden_states(ids)
    np.testing.assert_array_equal(got[0], ref.hidden_states[0][0].float().numpy())


def test_parameter_counts_match_hugging_face(tmp_path):
    """ModelConfig.param_count (FLOPs and the manifest use it) counts what transformers builds."""
    for family, shape in CASES:
        kwargs = SHAPES[family][shape]
        model = build(tmp_path / f"{family}{shape}", family, **kwargs)
        cfg = from_hf_dict(json.loads((tmp_path / f"{family}{shape}" / "config.json").read_text()))
        want = sum(p.numel() for p in model.parameters())  # tied: one copy, as named_parameters dedups
        assert cfg.param_count() == want, (family, shape)


GOOD = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 16}


@pytest.mark.parametrize("bad,message", [
    ({"model_type": "bloom"}, "gpt_neox, llama, mistral, qwen2, olmo, olmo2, gpt2, opt, falcon, gemma, phi"),
    ({"some_new_feature": 1}, "some_new_feature"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"model_type": "gpt2", "reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({"model_type": "opt", "do_layer_norm_before": False, "ffn_dim": 16}, "do_layer_norm_before"),
    ({"model_type": "opt", "word_embed_proj_dim": 16, "ffn_dim": 16}, "word_embed_proj_dim"),
    ({"model_type": "falcon", "alibi": True}, "alibi"),
    ({"model_type": "falcon", "new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn"),
    ({"model_type": "gemma", "head_dim": 8, "hidden_activation": "gelu"}, "hidden_activation"),
    ({"model_type": "gemma", "head_dim": 8, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma", "num_key_value_heads": 2}, "lacks head_dim"),
    ({"model_type": "phi", "qk_layernorm": True}, "qk_layernorm"),
    ({"model_type": "phi", "hidden_act": "gelu_10"}, "hidden_act"),
])
def test_config_refusals_name_the_attribute(bad, message):
    raw = {**GOOD, **bad}
    if raw["model_type"] in ("gpt2", "opt", "falcon"):
        raw.pop("num_key_value_heads")
        raw.pop("intermediate_size")
    with pytest.raises(UserError, match=message):
        from_hf_dict(raw)


def test_mistral_context_is_capped_at_its_sliding_window():
    """Sequences no longer than the window see exactly the causal attention."""
    cfg = from_hf_dict({**GOOD, "model_type": "mistral", "max_position_embeddings": 4096, "sliding_window": 1024})
    assert cfg.max_position_embeddings == 1024


def test_mismatched_weights_are_refused_by_name(tmp_path):
    import safetensors.numpy

    build(tmp_path, "llama", **SHAPES["llama"][0])
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


EXTRACT_CASES = [("llama", 0), ("olmo2", 0), ("gpt2", 0), ("opt", 0), ("falcon", 2), ("gemma", 0), ("phi", 1)]


@pytest.mark.parametrize("family,shape", [pytest.param(f, s, marks=[] if f == "llama" else pytest.mark.slow)
                                          for f, s in EXTRACT_CASES])
def test_extract_metrics_match_float64_reference(tmp_path, monkeypatch, family, shape):
    """`python -m isojax.extract --model <folder>` on each family: its metrics equal float64 ones
    from Hugging Face's states (the GPT-NeoX test's reference), the tokenizer the folder's own."""
    from test_extract import reference_metrics, write_pile_jsonl
    from tokenizers import Tokenizer

    from isojax.extract import main
    monkeypatch.setenv("ISOJAX_CACHE", str(tmp_path / "cache"))
    kwargs = dict(SHAPES[family][shape], vocab_size=50304)
    model = build(tmp_path / "ckpt", family, tokenizer=True, **kwargs)
    docs = write_pile_jsonl(tmp_path / "pile.jsonl", 16, seed=4)
    out = tmp_path / "out"
    assert main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "pile.jsonl"), "--unit", "document",
                 "--seq-len", "64", "--batch-tokens", "256", "--out", str(out), "--no-plots"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "ckpt" / "tokenizer.json"))
    ids = [np.array(tok.encode(text, add_special_tokens=False).ids) for _, text in docs]
    ref = reference_metrics([hf_states(model, i) for i in ids], ids)
    assert metrics["tokens"] == sum(map(len, ids))
    for got, want in zip(metrics["layers"], ref, strict=True):
        assert got["count"] == want["count"]
        for key in ("inter_sim", "intra_sim", "anisotropy"):
            assert abs(got[key] - want[key]) < 2e-5, (got["name"], key, got[key], want[key])
        assert abs(got["mean_norm"] - want["mean_norm"]) < 2e-5 * want["mean_norm"]


def family_config(family: str, shape: int):
    """The ModelConfig isojax reads from the transformers config of SHAPES[family][shape]."""
    import transformers
    raw = getattr(transformers, CLASSES[family][0])(**SHAPES[family][shape]).to_dict()
    return from_hf_dict(raw)


def test_kernel_choice_per_family(capsys, monkeypatch):
    """The packed attention kernel takes every family with any number of key/value heads, learned
    positions (no rotary), q/k norms and clipping, where its head dims apply; its probe is asked
    about what changes the kernel. The fused MLPs an exact GELU with a bias or a SiLU-gated MLP
    without biases; the LayerNorm-pair kernel only two LayerNorms of one state. Fallbacks are
    logged; an explicit choice that cannot run is refused. (Whether the kernels run here is their
    own tests' matter: the probe is taken as passed, or failed where it says so.)"""
    from isojax.kernels import packed_attention
    probes = []
    monkeypatch.setattr(packed_attention, "works", lambda **args: probes.append(args) or None)
    from isojax.device.kernel_choice import choose_attention, choose_mlp_kernel, choose_norm_kernel, layer_norm_pair

    llama = family_config("llama", 1)
    assert llama.head_dim == 32 and llama.kv_heads == 1
    assert choose_attention("packed", False, llama, "bfloat16", 128)[0] == "packed"
    families = {("gpt2", 0): (16, 0, False, False), ("opt", 0): (16, 0, False, False), ("olmo", 1): (16, 16, False, True),
                ("olmo2", 0): (16, 16, True, False)}
    for (family, shape), probe in families.items():
        probes.clear()
        cfg = family_config(family, shape)
        assert choose_attention("packed", False, cfg, "bfloat16", 128)[0] == "packed"
        assert choose_attention("packed", True, cfg, "bfloat16", 128)[0] == "packed"
        assert probes == [dict(zip(("head_dim", "rotary_dims", "qk_norm", "clip"), probe))] * 2, family
    monkeypatch.setattr(packed_attention, "works", lambda **args: "no" if args["qk_norm"] else None)
    with pytest.raises(UserError, match="attention packed no"):
        choose_attention("packed", False, family_config("olmo2", 0), "bfloat16", 128)
    assert choose_attention("packed", True, family_config("olmo2", 0), "bfloat16", 128)[0] == "cudnn"
    assert "packed attention does not run here (no)" in capsys.readouterr().err
    with pytest.raises(UserError, match="gated"):  # no Hopper GPU here
        choose_mlp_kernel("mosaic", llama, "bfloat16", 65536)
    assert choose_mlp_kernel("auto", llama, "bfloat16", 65536)[0] == "xla"
    from isojax.kernels import mlp
    monkeypatch.setattr(mlp, "available", lambda: True)  # a Hopper GPU where the gated probe passes
    monkeypatch.setattr(mlp, "works", lambda gated=False: None if gated else "only the gated kernel here")
    swiglu = dataclasses.replace(family_config("llama", 0), intermediate_size=128)  # widths that tile
    assert choose_mlp_kernel("mosaic", swiglu, "bfloat16", 65536)[0] == "mosaic"
    auto = choose_mlp_kernel("auto", swiglu, "bfloat16", 65536)  # no faster in the step: not by default
    assert auto[0] == "xla" and "no faster than XLA's path" in auto[1]
    with pytest.raises(UserError, match="does not apply to 65600 rows"):
        choose_mlp_kernel("mosaic", swiglu, "bfloat16", 65536 + 64)
    with pytest.raises(UserError, match="does not apply"):
        choose_mlp_kernel("mosaic", dataclasses.replace(swiglu, mlp_bias=True), "bfloat16", 65536)
    from isojax.hf.family.presets import preset
    assert choose_mlp_kernel("auto", preset("pythia-70m"), "bfloat16", 65536)[0] == "xla"  # its probe fails here
    gemma_mlp = choose_mlp_kernel("auto", family_config("gemma", 0), "bfloat16", 65536)
    assert gemma_mlp[0] == "xla" and "do not apply to this gemma MLP (gelu_pytorch_tanh, gated" in gemma_mlp[1]
    falcon_7b, falcon_40b = family_config("falcon", 0), family_config("falcon", 2)
    assert not layer_norm_pair(falcon_7b) and layer_norm_pair(falcon_40b) and not layer_norm_pair(llama)
    with pytest.raises(UserError, match="other norms"):
        choose_norm_kernel("pallas", falcon_7b, "bfloat16", 65536)
    assert choose_norm_kernel("auto", falcon_7b, "bfloat16", 65536)[0] == "xla"
    gemma = family_config("gemma", 0)  # GeGLU and RMSNorm: XLA's MLP and norms; rotary heads of 32: packed
    assert (gemma.head_dim, gemma.kv_heads, gemma.hidden_act) == (32, 1, "gelu_pytorch_tanh")
    assert choose_mlp_kernel("auto", gemma, "bfloat16", 65536)[0] == "xla" and not layer_norm_pair(gemma)
    assert choose_norm_kernel("auto", gemma, "bfloat16", 65536)[0] == "xla"
    assert choose_attention("packed", False, gemma, "bfloat16", 128)[0] == "packed"
    phi = family_config("phi", 0)  # tanh GELU, one shared LayerNorm: XLA's; rotary dims 8 (< 16): cuDNN
    assert (phi.head_dim, phi.rotary_dims, phi.shared_input_norm) == (16, 8, True)
    assert choose_mlp_kernel("auto", phi, "bfloat16", 65536)[0] == "xla" and not layer_norm_pair(phi)
    assert choose_norm_kernel("auto", phi, "bfloat16", 65536)[0] == "xla"
    assert choose_attention("packed", True, phi, "bfloat16", 128)[0] == "cudnn"


@pytest.mark.slow
@pytest.mark.parametrize("family,shape,change", [("llama", 1, {}), ("falcon", 2, {}), ("gemma", 0, {}),
                                                 ("gpt2", 0, {}), ("opt", 0, {}),
                                                 ("olmo", 1, dict(clip_qkv=0.1, num_layers=1)),
                                                 ("olmo2", 0, dict(num_layers=1))])
def test_packed_attention_states_equal_plain_attention(family, shape, change):
    """The bf16 model with the grouped packed kernel (interpret mode) on packed rows: the states of
    plain attention within bf16 rounding (as GPT-NeoX's, tests/test_packed_attention.py); GPT-2's
    and OPT's learned positions (no rotary), OLMo's clip (here 0.1, which the random weights'
    q, k and v reach often) and OLMo-2's q/k norms (their weights randomized) included. OLMo's
    with one layer: with two, its bf16 states drift 2e-2 from float32's with either attention."""
    import jax
    import jax.numpy as jnp

    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder, collect_states
    from isojax.model.options import ForwardOptions
    from test_packed_attention import packed_rows

    cfg = dataclasses.replace(family_config(family, shape), **change)
    params = random_params(cfg, "bfloat16", seed=3)
    rng = np.random.default_rng(3)
    params = jax.tree_util.tree_map_with_path(  # q/k norm weights other than ones: each head its own
        lambda path, p: (p * (1 + 0.3 * rng.normal(size=p.shape))).astype(p.dtype)
        if any(getattr(key, "key", None) in ("q_norm", "k_norm") for key in path) else p, params)
    tokens = rng.integers(0, VOCAB, (1, 64)).astype(np.int32)
    seg, pos = packed_rows([[5, 40, 13]], 64)
    buf = jnp.zeros((cfg.num_states, 1, 64, cfg.hidden_size), jnp.float32)
    states = {}
    for attention in ("xla", "packed"):
        module = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, options=ForwardOptions(attention=attention))
        states[attention] = np.asarray(module.apply({"params": params}, tokens, seg, pos, buf, collect_states))
    real = seg > 0
    errors = [max_rel_error(states["packed"][s][real], states["xla"][s][real]) for s in range(cfg.num_states)]
    assert max(errors) < 2e-2, errors
    assert errors[0] == 0 and max(errors) > 0


def test_converted_checkpoint_gives_the_same_states(tmp_path):
    """`python -m isojax.convert` (Orbax) keeps the family: the converted checkpoint's states are the
    Hugging Face folder's."""
    from isojax.convert import convert_dir

    build(tmp_path / "hf", "falcon", **SHAPES["falcon"][2])
    convert_dir(tmp_path / "hf", tmp_path / "converted")
    ids = np.random.default_rng(0).integers(3, VOCAB, size=17)
    converted = load_model(tmp_path / "converted")
    assert converted.config == load_model(tmp_path / "hf").config
    np.testing.assert_array_equal(converted.hidden_states(ids), load_model(tmp_path / "hf").hidden_states(ids))


def test_names_of_a_bare_model_checkpoint(tmp_path):
    """GPT-2's hub checkpoints were saved from GPT2Model: names without "transformer." and the
    causal-mask buffers h.N.attn.bias; they read as the LM-head class's."""
    import safetensors.numpy

    model = build(tmp_path, "gpt2", **SHAPES["gpt2"][0])
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    bare = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.uint8))
    safetensors.numpy.save_file(bare, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = np.arange(3, 40)
    assert max_rel_error(load_model(tmp_path).hidden_states(ids), hf_states(model, ids)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family,shape", [("llama", 0), ("olmo2", 1), ("gpt2", 0), ("opt", 0), ("falcon", 2)])
def test_bfloat16_states_within_documented_tolerance(tmp_path, family, shape):
    """bf16 compute (norm statistics and softmax in float32): per-vector relative error against
    Hugging Face float32 under 3e-2, as README "bfloat16" documents for GPT-NeoX."""
    model = build(tmp_path, family, seed=shape, **SHAPES[family][shape])
    ids = np.random.default_rng(2).integers(3, VOCAB, size=40)
    got = load_model(tmp_path, dtype="bfloat16").hidden_states(ids)
    ref = hf_states(model, ids)
    errors = [max_rel_error(got[s], ref[s]) for s in range(len(ref))]
    assert 1e-5 < max(errors) < 3e-2, errors


def test_extract_refuses_an_unsupported_family_or_attribute_in_one_line(tmp_path, capsys):
    from isojax.extract import main

    build(tmp_path / "llama", "llama", **SHAPES["llama"][0])
    raw = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**raw, "some_new_feature": 1}))
    (tmp_path / "bloom").mkdir()
    (tmp_path / "bloom" / "config.json").write_text(json.dumps({"model_type": "bloom", "hidden_size": 64}))
    for model, needle in ((tmp_path / "bloom", "isojax runs gpt_neox, llama, mistral, qwen2, olmo, olmo2, gpt2, "
                                                "opt, falcon, gemma, phi"), (tmp_path / "llama", "some_new_feature")):
        assert main(["--model", str(model), "--out", str(tmp_path / "out"), "--max-tokens", "64"]) == 2
        err = capsys.readouterr().err
        assert "error:" in err and needle in err and "Traceback" not in err, err


@pytest.mark.slow
def test_jax_attention_takes_the_key_value_heads_itself():
    """attention "auto" hands jax.nn.dot_product_attention the G key/value heads (cuDNN's path on a
    GPU, XLA's here): the states of the plain attention, which repeats them per group."""
    import jax.numpy as jnp

    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder, collect_states
    from isojax.model.options import ForwardOptions
    from test_packed_attention import packed_rows

    cfg = family_config("llama", 0)
    assert 1 < cfg.kv_heads < cfg.num_heads
    params = random_params(cfg, seed=4)
    tokens = np.random.default_rng(4).integers(0, VOCAB, (1, 48)).astype(np.int32)
    seg, pos = packed_rows([[30, 12]], 48)
    buf = jnp.zeros((cfg.num_states, 1, 48, cfg.hidden_size), jnp.float32)
    states = [np.asarray(Decoder(cfg, options=ForwardOptions(attention=a)).apply(
        {"params": params}, tokens, seg, pos, buf, collect_states)) for a in ("xla", "auto")]
    real = seg > 0
    assert max_rel_error(states[1][:, real], states[0][:, real]) < 1e-6


@pytest.mark.slow
def test_gpt2_style_tokenizer_files_give_transformers_ids(tmp_path):
    """A checkpoint with vocab.json + merges.txt and no tokenizer.json (OPT's repositories ship
    that): the byte-level BPE isojax builds gives the ids of transformers' own pure-Python
    GPT2Tokenizer, and a model folder so laid out loads it instead of the bundled tokenizer."""
    from tokenizers import Tokenizer
    from transformers import GPT2Tokenizer

    from isojax.hf.tokenizer import byte_level_bpe
    Tokenizer.from_file(str(TOKENIZER_JSON)).model.save(str(tmp_path))  # vocab.json, merges.txt
    ref = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    ours = byte_level_bpe(tmp_path)
    book = (TOKENIZER_JSON.parents[2] / "tests" / "data" / "moby-dick.txt").read_text()[:4000]
    for text in (book, "  two leading spaces,\ttabs\n\nand lines", "naïve café — 東京 🚀 don't it's 12345"):
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text), text[:40]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert byte_level_bpe(tmp_path) is None  # another class's files: not read as GPT-2's
    model_dir = tmp_path / "opt"
    build(model_dir, "opt", **dict(SHAPES["opt"][0], vocab_size=50304))
    for name in ("vocab.json", "merges.txt"):
        (model_dir / name).write_bytes((tmp_path / name).read_bytes())
    loaded = load_model(model_dir)
    assert loaded.tokenizer.encode("don't", add_special_tokens=False).ids == ref.encode("don't")
    assert "vocab.json + merges.txt" in loaded.source["tokenizer"]
