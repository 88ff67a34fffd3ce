"""The HF PyTorch peer (bench/peer_hf.py) against a float64 per-sentence reference.

The reference runs every sentence alone (no padding, no mask) through Hugging Face, takes
the L+2 states (output_hidden_states plus the raw last block, checked by re-applying the
final LayerNorm) and does all the statistics in float64 numpy. The peer runs padded,
masked, multi-sentence batches in float32.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # the benchmark's PyTorch peer (bench/peer_hf.py), not isojax

from bench import common as workload, peer_hf

D, L, HEADS, VOCAB, FF = 64, 2, 4, 512, 256


@pytest.fixture(scope="module")
def model():
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=L, num_attention_heads=HEADS,
        intermediate_size=FF, rotary_pct=0.25, max_position_embeddings=2048,
        use_parallel_residual=True, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    lm = transformers.GPTNeoXForCausalLM(config).eval()
    # Random init has LayerNorm g=1, b=0; perturb them so final_ln is not a plain rescale.
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "layernorm" in name.lower() or "layer_norm" in name.lower():
                p.add_(0.3 * torch.randn_like(p))
    return lm.gpt_neox


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(7)
    lengths = np.concatenate([[1, 2, 57], rng.integers(1, 40, size=37)])
    rng.shuffle(lengths)
    tokens, offsets = workload.random_sentences(lengths, VOCAB, seed=3)
    return tokens, offsets


@pytest.fixture(scope="module")
def reference(model, corpus):
    return reference_stats(model, *corpus)


def reference_stats(base, tokens, offsets):
    """float64 per-sentence reference: Σû, per-token Σû, counts, Σx, Σxxᵀ, IntraSim."""
    S = L + 2
    raw = {}
    hook = base.layers[-1].register_forward_hook(lambda m, a, out: raw.__setitem__("x", out))
    unit_sum = np.zeros((S, D))
    token_sum = np.zeros((S, VOCAB, D))
    states_all = [[] for _ in range(S)]
    try:
        with torch.no_grad():
            for i in range(len(offsets) - 1):
                ids = torch.from_numpy(tokens[offsets[i]:offsets[i + 1]].astype(np.int64))[None]
                hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
                assert len(hs) == L + 1
                x_last = raw.pop("x")
                x_last = x_last[0] if isinstance(x_last, tuple) else x_last
                torch.testing.assert_close(base.final_layer_norm(x_last), hs[-1])
                states = list(hs[:-1]) + [x_last, hs[-1]]
                for s, h in enumerate(states):
                    x = h[0].double().numpy()
                    u = x / np.linalg.norm(x, axis=1, keepdims=True)
                    unit_sum[s] += u.sum(0)
                    np.add.at(token_sum[s], ids[0].numpy(), u)
                    states_all[s].append(x)
    finally:
        hook.remove()
    X = [np.concatenate(xs) for xs in states_all]
    return unit_sum, token_sum, np.bincount(tokens, minlength=VOCAB), X


@pytest.mark.parametrize("sort_by_length,pad_multiple", [(True, 1), (False, 8)])
def test_peer_matches_float64_reference(model, corpus, reference, sort_by_length, pad_multiple):
    tokens, offsets = corpus
    n = int(offsets[-1])
    unit_sum, token_sum, counts, X = reference

    r = peer_hf.run_peer((D, L, HEADS, VOCAB, FF), tokens, offsets, device="cpu",
                         dtype=torch.float32, model=model, batch_tokens=160,
                         sort_by_length=sort_by_length, pad_multiple=pad_multiple, warmup_batches=1,
                         finalize=True, keep_stats=True)
    stats, layers = r["stats"], r["metrics"]["layers"]
    assert r["batches"] > 4 and r["padding_fraction"] > 0  # padded, multi-row batches
    assert r["tokens_processed"] == stats.count == n
    assert [row["name"] for row in layers] == ["embed", "block_1", "block_2", "final_ln"]

    np.testing.assert_array_equal(stats.token_count_V.numpy(), counts)
    np.testing.assert_allclose(stats.token_sum_SxVxd.numpy(), token_sum, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(stats.unit_sum_Sxd.numpy(), unit_sum, rtol=2e-5, atol=1e-4)

    seen = counts >= 2
    c = counts[seen].astype(np.float64)
    for s, row in enumerate(layers):
        inter = (unit_sum[s] @ unit_sum[s] - n) / (n * n - n)
        intra = ((token_sum[s][seen] ** 2).sum(-1) - c) / (c * c - c)
        assert row["count"] == n
        assert row["inter_sim"] == pytest.approx(inter, abs=1e-6)
        assert row["intra_tokens"] == int(seen.sum())
        assert row["intra_sim"] == pytest.approx(intra.mean(), abs=1e-6)
        assert row["intra_sim_weighted"] == pytest.approx((intra * c).sum() / c.sum(), abs=1e-6)
        x = X[s]
        assert row["mean_norm"] == pytest.approx(np.linalg.norm(x, axis=1).mean(), rel=1e-5)
        sv = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2
        assert row["anisotropy"] == pytest.approx(sv[0] / sv.sum(), rel=1e-4)
        sv = np.linalg.svd(x, compute_uv=False) ** 2
        assert row["anisotropy_uncentered"] == pytest.approx(sv[0] / sv.sum(), rel=1e-4)
        np.testing.assert_allclose(stats.gram_Sxdxd[s].numpy(), x.T @ x,
                                   rtol=1e-4, atol=1e-4 * np.abs(x.T @ x).max())


def test_workload_lengths_and_ids():
    lengths = workload.sentence_lengths(3_000_000, seed=11)
    assert lengths.sum() >= 3_000_000 and lengths[:-1].sum() < 3_000_000
    assert lengths.min() >= 1 and lengths.max() <= 2048
    assert abs(lengths.mean() / 33 - 1) < 0.05
    assert 15 <= np.median(lengths) <= 30  # right-skewed, not a constant 33

    tokens, offsets = workload.random_sentences(lengths[:20000], 50304, seed=5)
    assert tokens.dtype == np.int32 and offsets[0] == 0
    np.testing.assert_array_equal(np.diff(offsets), lengths[:20000])
    assert tokens.min() >= 0 and tokens.max() < 50304
    top = np.bincount(tokens).max() / len(tokens)  # Zipf s=1: 1/H(50304) ≈ 0.088
    assert 0.07 < top < 0.11


def test_pythia_parameter_counts():
    # Non-embedding parameter counts published with Pythia (Biderman et al. 2023, Table 1).
    expected = {"pythia-70m": 18_915_328, "pythia-410m": 302_311_424, "pythia-1.4b": 1_208_602_624}
    for name, count in expected.items():
        assert workload.non_embedding_params(workload.PYTHIA_SHAPES[name]) == count
    d, n_layers = 2048, 24
    assert workload.flops_per_token(workload.PYTHIA_SHAPES["pythia-1.4b"]) == pytest.approx(
        2 * 1_208_602_624 + 2 * d * d * (n_layers + 2))


def test_flops_agree_with_isojax_config():
    config = pytest.importorskip("isojax.hf.family.presets")
    for name, shape in workload.PYTHIA_SHAPES.items():
        cfg = config.preset(name)
        assert shape == (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size,
                         cfg.intermediate_size)
        for gram in (False, True):
            assert workload.flops_per_token(shape, gram) == cfg.flops_per_token(gram)
