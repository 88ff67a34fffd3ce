"""isojax.stats.accumulators + isojax.stats.finalize against float64 numpy references written here from the
definitions (pairwise cosines, SVD / eigvalsh of the float64 covariance)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.stats import finalize as fz
from isojax.stats import sample_readout as sr
from isojax.stats import accumulators as stats
from isojax.stats import measures
from isojax.stats.options import StatsOptions

TOL = 2e-5  # absolute, for dimensionless metrics (cosines, ratios)
RTOL = 2e-6  # relative, for metrics that carry the states' scale (norms, spectra)
INTRA = (("intra_sim", 1),)  # IntraSim's per-token sums: a step measure (stats/measures/intra_sim.py)


def _init(s, d, v, **kw):
    """Zeroed accumulators with IntraSim's per-token sums of v token ids."""
    acc = stats.init_accumulators(s, d, **kw)
    return acc.replace(step=measures.init_sums(INTRA, kw.get("num_groups", 1), s, v, d)[1])


def _with_tokens(acc, *args, opts=StatsOptions(), **kw):
    """stats.update with IntraSim's per-token sums where acc holds them (_init)."""
    on = INTRA if acc.step else ()
    return stats.update(acc, *args, opts=opts, observe=measures.observer(on, opts), plan=measures.batch_planner(on, opts),
                        vocab_rows=acc.step[0].count_SxV.shape[1] if acc.step else 0, **kw)


def _merge(a, b):
    """stats.merge, and the per-token sums' (intra_sim.py Sums.merge)."""
    return stats.merge(a, b).replace(step=tuple(x.merge(y) for x, y in zip(a.step, b.step, strict=True)))


_update = jax.jit(_with_tokens, donate_argnums=0)


def _feed(acc, x_SxNxD, ids_N, valid_N, groups=None, centers_SxD=None, batch=8192):
    """Feed states in batches of `batch` rows (the last one padded with garbage rows marked
    invalid, so every test shares one compiled shape); batch b goes to group groups[b]."""
    s, n, d = x_SxNxD.shape
    pad = -n % batch
    x_SxNxD = np.concatenate([x_SxNxD, np.full((s, pad, d), 7.0, x_SxNxD.dtype)], 1)
    ids_N = np.concatenate([ids_N, np.zeros(pad, np.int32)])
    valid_N = np.concatenate([valid_N, np.zeros(pad, bool)])
    for b, start in enumerate(range(0, n + pad, batch)):
        sl = slice(start, start + batch)
        acc = _update(acc, x_SxNxD[:, sl], ids_N[sl], valid_N[sl],
                      0 if groups is None else groups[b], centers_SxD)
    # Finish before numpy's reference starts: on two cores, XLA's and BLAS's thread pools
    # running at once slow both several-fold.
    return jax.block_until_ready(acc)


def _ref(x_NxD, ids_N=None, vocab_size=0, center_D=None):
    """Float64 reference of one state from the definitions."""
    x = np.asarray(x_NxD, np.float64)
    n = len(x)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    su = u.sum(0)
    cov = (x - x.mean(0)).T @ (x - x.mean(0)) / n
    eig = np.linalg.eigvalsh(cov)[::-1]
    eig_unc = np.linalg.eigvalsh(x.T @ x / n)[::-1]
    eig_unit = np.linalg.eigvalsh(np.cov(u.T, bias=True))[::-1]
    sv = np.sqrt(np.clip(eig, 0, None))
    p = sv / sv.sum()
    out = {"count": n, "inter_sim": (su @ su - n) / (n * n - n),
           "anisotropy": eig[0] / eig.sum(), "anisotropy_uncentered": eig_unc[0] / eig_unc.sum(),
           "unit_anisotropy": eig_unit[0] / eig_unit.sum(),
           "effective_rank": np.exp(-(p * np.log(p)).sum()),
           "mean_norm": np.linalg.norm(x, axis=1).mean(),
           "mean_sq_norm": (x * x).sum(1).mean(), "norm_of_mean": np.linalg.norm(x.mean(0)),
           "eig": eig}
    if center_D is not None:
        c = x - np.asarray(center_D, np.float64)
        cu = (c / np.linalg.norm(c, axis=1, keepdims=True)).sum(0)
        out["centered_inter_sim"] = (cu @ cu - n) / (n * n - n)
    if vocab_size:
        count = np.bincount(ids_N, minlength=vocab_size)
        tok = np.stack([np.bincount(ids_N, u[:, k], vocab_size) for k in range(x.shape[1])], 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            intra = np.where(count >= 2, ((tok * tok).sum(1) - count) / (count**2 - count), np.nan)
        seen = count >= 2
        out.update(count_V=count, intra_V=intra, intra_tokens=int(seen.sum()),
                   intra_sim=intra[seen].mean(),
                   intra_sim_weighted=(intra[seen] * count[seen]).sum() / count[seen].sum())
    return out


def _check(layer, ref, spectrum=None):
    assert layer["count"] == ref["count"]
    for key in ("inter_sim", "anisotropy", "anisotropy_uncentered", "unit_anisotropy",
                "centered_inter_sim", "intra_sim", "intra_sim_weighted"):
        if key in ref:
            assert abs(layer[key] - ref[key]) < TOL, (key, layer[key], ref[key])
    for key in ("mean_norm", "mean_sq_norm", "norm_of_mean", "effective_rank"):
        np.testing.assert_allclose(layer[key], ref[key], rtol=RTOL, err_msg=key)
    if "intra_tokens" in ref:
        assert layer["intra_tokens"] == ref["intra_tokens"]
    if spectrum is not None:  # eigenvalues, relative to the largest
        np.testing.assert_allclose(spectrum, ref["eig"], atol=RTOL * ref["eig"][0])


def _zipf_ids(rng, n, vocab_size, a=1.2):
    return ((rng.zipf(a, n) - 1) % vocab_size).astype(np.int32)


def test_o_n_formulas_match_pairwise_definitions():
    rng = np.random.default_rng(1)
    n, d, v = 1500, 16, 64
    x = (rng.normal(size=(n, d)) + rng.normal(size=d)).astype(np.float32)
    ids = rng.integers(0, 7, n).astype(np.int32)
    acc = _feed(_init(1, d, v), x[None], ids, np.ones(n, bool))
    layer = fz.finalize(acc, ["s"])["layers"][0]
    x64 = x.astype(np.float64)
    u = x64 / np.linalg.norm(x64, axis=1, keepdims=True)
    cos = u @ u.T
    off = ~np.eye(n, dtype=bool)
    assert abs(layer["inter_sim"] - cos[off].mean()) < TOL
    intra = [cos[np.ix_(ids == t, ids == t)][off[: (ids == t).sum(), : (ids == t).sum()]].mean()
             for t in range(7)]
    assert abs(layer["intra_sim"] - np.mean(intra)) < TOL
    sv = np.linalg.svd(x64 - x64.mean(0), compute_uv=False)  # Razzhigaev et al. section 2.3
    assert abs(layer["anisotropy"] - sv[0] ** 2 / (sv**2).sum()) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parallel", "isotropic"])
def test_million_vectors_every_metric(kind):
    rng = np.random.default_rng(2 if kind == "parallel" else 3)
    n, d, v = 1 << 20, 16, 64
    if kind == "parallel":  # cos ~ 0.999 around a common direction, large norms
        direction = rng.normal(size=d)
        x = 100.0 * (direction / np.linalg.norm(direction) + 0.011 * rng.normal(size=(n, d)))
    else:
        x = rng.normal(size=(n, d)) * rng.uniform(0.5, 2.0, size=d)
    x = x.astype(np.float32)
    ids = _zipf_ids(rng, n, v)
    acc = _feed(_init(1, d, v), x[None], ids, np.ones(n, bool))
    out = fz.finalize(acc, ["s"])
    ref = _ref(x, ids, v)
    if kind == "parallel":
        assert ref["inter_sim"] > 0.998 and ref["intra_sim"] > 0.998
    else:
        assert abs(ref["inter_sim"]) < 1e-3
    _check(out["layers"][0], ref, out["spectra"]["centered_SxD"][0])
    np.testing.assert_array_equal(out["token"]["count_V"], ref["count_V"])
    np.testing.assert_allclose(out["token"]["intra_sim_SxV"][0], ref["intra_V"], atol=TOL)


@pytest.mark.slow
def test_long_stream_of_nearly_equal_vectors_does_not_drift():
    """2048 batch sums of nearly equal vectors added to the same rows: plain float32
    accumulation stagnates (each add rounds to ulp(total) the same way), compensation not."""
    rng = np.random.default_rng(10)
    batches, n, d, v = 2048, 512, 16, 64
    direction = rng.normal(size=d)
    x = direction / np.linalg.norm(direction) + 3e-4 * rng.normal(size=(batches * n, d))
    x = (40.0 * x).astype(np.float32)
    ids = np.where(rng.random(batches * n) < 0.9, 5, 9).astype(np.int32)

    @jax.jit
    def feed(acc, x_BxNxD, ids_BxN):
        def body(acc, xs):
            return _with_tokens(acc, xs[0][None], xs[1], jnp.ones(n, bool)), None
        return jax.lax.scan(body, acc, (x_BxNxD, ids_BxN))[0]

    acc = feed(_init(1, d, v), x.reshape(batches, n, d),
               ids.reshape(batches, n))
    out = fz.finalize(acc, ["s"])
    ref = _ref(x, ids, v)
    assert ref["inter_sim"] > 0.99999
    _check(out["layers"][0], ref, out["spectra"]["centered_SxD"][0])
    np.testing.assert_allclose(out["token"]["intra_sim_SxV"][0], ref["intra_V"], atol=TOL)


@pytest.mark.slow
def test_zipf_per_token_intra_sim_and_bands():
    rng = np.random.default_rng(4)
    n, d, v, s = 200_000, 16, 3000, 2
    ids = _zipf_ids(rng, n, v, a=1.1)
    # Each token has its own direction: IntraSim near 1 for every token, InterSim low.
    dirs = rng.normal(size=(v, d))
    x = np.stack([5 * dirs[ids] + rng.normal(size=(n, d)),
                  dirs[ids] + 0.02 * rng.normal(size=(n, d))]).astype(np.float32)
    # Three groups (all data in group 0) only to share the compiled shape of the group tests.
    acc = _feed(_init(s, d, v, num_groups=3), x, ids, np.ones(n, bool))
    out = fz.finalize(acc, ["a", "b"])
    for k in range(s):
        ref = _ref(x[k], ids, v)
        _check(out["layers"][k], ref)
        got = out["token"]["intra_sim_SxV"][k]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref["intra_V"]))
        np.testing.assert_allclose(got, ref["intra_V"], atol=TOL)
        for band in out["layers"][k]["intra_sim_by_band"]:
            sel = (ref["count_V"] >= band["lo"]) & (ref["count_V"] < band["hi"])
            assert band["tokens"] == sel.sum()
            if sel.any():
                assert abs(band["intra_sim"] - ref["intra_V"][sel].mean()) < TOL
        bands = out["layers"][k]["intra_sim_by_band"]
        assert sum(b["tokens"] for b in bands) == ref["intra_tokens"]


@pytest.mark.parametrize("segment_sum,token_chunk,gram_block,sorted_max_d", [
    ("scatter", 4096, 512, 1024), ("scan", 64, 8, 1024), ("scatter", 64, 4, 1024), ("scatter", 64, 4, 0)])
def test_segment_sum_modes_token_chunks_and_gram_blocks(segment_sum, token_chunk, gram_block, sorted_max_d):
    """The accelerator default (scatter), the chunked per-token update (~500 distinct ids in
    rounds of 64: 8 rounds per batch, into 512 rather than 8192 rows), with and without XLA's
    sorted-indices hint, and the Gram from its upper blocks (2 x 2 and 4 x 4 at D = 16) against
    the float64 reference."""
    rng = np.random.default_rng(11)
    n, d, v, batch = 32_768, 16, 500, 8192
    ids = _zipf_ids(rng, n, v)
    mix = rng.normal(size=(d, d))  # correlated coordinates: the Gram's off-diagonal blocks matter
    x = ((rng.normal(size=(v, d)) @ mix)[ids] + 0.1 * rng.normal(size=(n, d))).astype(np.float32)
    valid = rng.random(n) < 0.95
    assert StatsOptions().segment_sum_mode() == "scan"  # the CPU default
    opts = StatsOptions(segment_sum=segment_sum, token_chunk=token_chunk, gram_block=gram_block,
                        sorted_scatter_max_d=sorted_max_d)  # 0: no sorted hint (as for D > 1024)
    update = jax.jit(functools.partial(_with_tokens, opts=opts))
    acc = _init(1, d, v)
    for start in range(0, n, batch):
        sl = slice(start, start + batch)
        acc = update(acc, x[None, sl], ids[sl], valid[sl])
    out = fz.finalize(acc, ["s"])
    ref = _ref(x[valid], ids[valid], v)
    _check(out["layers"][0], ref, out["spectra"]["centered_SxD"][0])
    np.testing.assert_allclose(out["token"]["intra_sim_SxV"][0], ref["intra_V"], atol=TOL)
    np.testing.assert_array_equal(out["token"]["count_V"], ref["count_V"])


@pytest.mark.slow
def _assert_close(a, b, key):
    """Equal, floats (also inside lists and dicts: rogue_dims, inter_sim_by_position) to 1e-7 relative."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-7 * max(1, abs(a)) or (a != a and b != b), key
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), key
        for x, y in zip(a, b):
            _assert_close(x, y, key)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            _assert_close(a[k], b[k], f"{key}.{k}")
    else:
        assert a == b, key


def test_merge_of_halves_equals_one_pass():
    rng = np.random.default_rng(5)
    n, d, v, s = 1 << 16, 16, 3000, 2
    x = (rng.normal(size=(s, n, d)) + 20 * rng.normal(size=(s, 1, d))).astype(np.float32)
    ids = _zipf_ids(rng, n, v)
    valid = np.ones(n, bool)
    groups = rng.integers(0, 3, n // 8192)
    names = ["p", "q", "r"]
    for group_spectra in (True, False):
        init = lambda: _init(s, d, v, num_groups=3,
                                               group_spectra=group_spectra)
        whole = fz.finalize(_feed(init(), x, ids, valid, groups), ["a", "b"], names)
        h = n // 2
        first = _feed(init(), x[:, :h], ids[:h], valid[:h], groups[: h // 8192])
        second = _feed(init(), x[:, h:], ids[h:], valid[h:], groups[h // 8192:])
        merged = fz.finalize(jax.jit(_merge)(first, second), ["a", "b"], names)
        for layer_w, layer_m in zip(whole["layers"], merged["layers"]):
            for key, val in layer_w.items():
                if key != "intra_sim_by_band":
                    _assert_close(val, layer_m[key], key)
        for name in names:
            for layer_w, layer_m in zip(whole["groups"][name]["layers"],
                                        merged["groups"][name]["layers"]):
                assert layer_w.keys() == layer_m.keys()
                for key, val in layer_w.items():
                    _assert_close(val, layer_m[key], key)
        np.testing.assert_array_equal(whole["token"]["count_V"], merged["token"]["count_V"])
        np.testing.assert_allclose(whole["token"]["intra_sim_SxV"],
                                   merged["token"]["intra_sim_SxV"], rtol=1e-7)
        np.testing.assert_allclose(whole["spectra"]["centered_SxD"],
                                   merged["spectra"]["centered_SxD"], rtol=1e-6)


def test_valid_mask_excludes_padding():
    rng = np.random.default_rng(6)
    n, d, v = 40_000, 16, 64
    x = (rng.normal(size=(n, d)) + 3).astype(np.float32)
    ids = _zipf_ids(rng, n, v)
    valid = rng.random(n) < 0.7
    x_pad = x.copy()  # padding holds garbage that must not leak: huge, inf, nan
    x_pad[~valid] = rng.choice([1e30, np.inf, np.nan], size=(int((~valid).sum()), 1))
    acc = _feed(_init(1, d, v), x_pad[None], ids, valid)
    out = fz.finalize(acc, ["s"])
    ref = _ref(x[valid], ids[valid], v)
    _check(out["layers"][0], ref, out["spectra"]["centered_SxD"][0])
    np.testing.assert_array_equal(out["token"]["count_V"], ref["count_V"])
    np.testing.assert_allclose(out["token"]["intra_sim_SxV"][0], ref["intra_V"], atol=TOL)


@pytest.mark.parametrize("group_spectra", [True, False])
def test_groups_and_their_combination(group_spectra):
    rng = np.random.default_rng(7)
    n, d, v, batch = 8192 * 10, 16, 3000, 8192
    groups = rng.choice(3, n // batch)
    groups[:3] = [0, 1, 2]
    offsets = 4 * rng.normal(size=(3, d))  # each source has its own mean
    row_group = np.repeat(groups, batch)
    x = (rng.normal(size=(n, d)) + offsets[row_group]).astype(np.float32)
    x = np.stack([x, np.abs(x)])
    ids = rng.integers(0, v, n).astype(np.int32)
    acc = _init(2, d, v, num_groups=3, group_spectra=group_spectra)
    out = fz.finalize(_feed(acc, x, ids, np.ones(n, bool), groups), ["s", "t"],
                      ["a", "b", "c"])
    for k in range(2):
        _check(out["layers"][k], _ref(x[k], ids, v), out["spectra"]["centered_SxD"][k])
    for g, name in enumerate("abc"):
        ref = _ref(x[1, row_group == g])
        group = out["groups"][name]
        assert group["tokens"] == ref["count"]
        layer = group["layers"][1]
        assert "intra_sim" not in layer
        if not group_spectra:
            assert "anisotropy" not in layer
            ref = {k: ref[k] for k in ("count", "inter_sim", "mean_norm", "norm_of_mean")}
            layer = {**layer, "mean_sq_norm": 0.0, "effective_rank": 0.0}
            ref.update(mean_sq_norm=0.0, effective_rank=0.0)
        _check(layer, ref)


def test_centered_inter_sim_second_pass():
    """The centered pass's step measure (stats/measures/centered_inter_sim.py) against float64: its sums in the
    layer part, updated from each state's Rows.center_D, merged halves (Sums.merge) as one pass."""
    from isojax.stats import measures
    from isojax.stats.measures import centered_inter_sim as centered
    rng = np.random.default_rng(8)
    n, d = 1 << 17, 16
    x = (rng.normal(size=(n, d)) * 0.05 + rng.normal(size=d)).astype(np.float32)
    center = x.astype(np.float64).mean(0).astype(np.float32)  # the first pass's mean
    on = (("centered_inter_sim", 1),)
    update = jax.jit(functools.partial(stats.update, observe=measures.observer(on)))
    halves = []
    for part in (x[: n // 2], x[n // 2:]):
        acc = stats.init_accumulators(1, d).replace(
            layer_steps=measures.init_sums(on, 1, 1, 0, d)[0])
        for start in range(0, len(part), 8192):
            rows = part[start:start + 8192]
            acc = update(acc, rows[None], np.zeros(len(rows), np.int32), np.ones(len(rows), bool), 0, center[None])
        halves.append(acc)
    acc = jax.block_until_ready(stats.merge(*halves))
    got = centered.readout(centered.merged(jax.tree.map(lambda v: np.asarray(v)[None], acc.layer_steps[0])),
                           acc.layer_count())
    ref = _ref(x, center_D=center)
    assert ref["inter_sim"] > 0.99 and abs(ref["centered_inter_sim"]) < 1e-3
    assert abs(got[0]["centered_inter_sim"] - ref["centered_inter_sim"]) < TOL
    out = fz.finalize(acc, ["s"])  # the rest of the layer part as usual; centered_inter_sim is the measure's
    _check(out["layers"][0], {k: v for k, v in ref.items() if k != "centered_inter_sim"})
    assert "centered_inter_sim" not in out["layers"][0] and out["layers"][0]["intra_sim"] is None
    with pytest.raises(ValueError, match="center"):  # the measure on, no centers
        update(acc, x[None, :8], np.zeros(8, np.int32), np.ones(8, bool), 0)


def test_bfloat16_states_and_update_state_in_a_scan():
    rng = np.random.default_rng(9)
    s, n, d, v = 3, 8192, 32, 40
    x = jnp.asarray(rng.normal(size=(s, n, d)) + 2, jnp.bfloat16)
    ids = rng.integers(0, v, n).astype(np.int32)
    valid = np.ones(n, bool)

    @jax.jit
    def scan_update(acc, x_SxNxD, ids_N, valid_N):  # as the model step calls it: traced s
        def body(acc, s_and_x):
            return stats.update_state(acc, s_and_x[0], s_and_x[1], ids_N, valid_N, 0,
                                      observe=measures.observer(INTRA)), None
        return jax.lax.scan(body, acc, (jnp.arange(s), x_SxNxD))[0]

    acc = _init(s, d, v)
    for half in (slice(0, n // 2), slice(n // 2, n)):
        acc = scan_update(acc, x[:, half], ids[half], valid[half])
    out = fz.finalize(acc, ["a", "b", "c"])
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    spectral = ("anisotropy", "anisotropy_uncentered", "unit_anisotropy", "effective_rank", "mean_sq_norm")
    for k in range(s):
        ref = _ref(x64[k], ids, v)
        # bf16 states take the bf16 Gram (deviations rounded to bf16, float32 accumulation):
        # Gram-derived metrics within 1e-4 relative (README, "bfloat16"), the rest exact as usual.
        for key in spectral:
            assert abs(out["layers"][k][key] - ref[key]) < 1e-4 * max(1.0, abs(ref[key])), key
            out["layers"][k][key] = ref[key]  # checked above; the rest is checked exactly below
        _check(out["layers"][k], ref)


def test_accumulator_bytes():
    from isojax.stats.measures.intra_sim import sums_bytes
    acc = stats.init_accumulators(3, 8, num_groups=2)
    assert stats.accumulator_bytes(3, 8, num_groups=2) == sum(
        leaf.nbytes for leaf in jax.tree.leaves(acc))
    s, v, d = 26, 50304, 2048  # pythia-1.4b; eval_shape, nothing allocated
    tokens = jax.eval_shape(lambda: measures.init_sums(INTRA, 1, s, v, d)[1])
    assert sums_bytes(s, d, v) == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tokens)) \
        == 2 * s * v * d * 4 + s * v * 4


@pytest.mark.slow
def test_the_compiled_step_updates_grams_and_token_sums_in_place():
    """The step keeps one copy of every accumulator: XLA once copied the Grams inside the layer
    scan (separate hi and lo arrays) and after it (the last two states observed outside any
    loop), which at gpt-neox-20b did not fit 4 x 80 GB. No copy of an array of a Gram's or the
    per-token sums' shape may appear in the optimized program."""
    import dataclasses
    import re

    from isojax.hf.family.presets import preset
    from isojax.hf.loading import random_params
    from isojax.model.decoder import Decoder
    from isojax.device.runner import Runner
    cfg = dataclasses.replace(preset("pythia-70m"), hidden_size=192, intermediate_size=768, num_layers=2,
                              num_heads=4, vocab_size=96)
    runner = Runner(Decoder(cfg), random_params(cfg), token_stats=True)
    rows = [np.ones((4, 16), np.int32)] * 4
    hlo = runner._step.lower(runner.params, runner.acc, *rows, jnp.int32(0), runner.centers_SxD).compile().as_text()
    gram = ",".join(map(str, runner.acc.m2_HxSxDxD.hl.shape[-4:]))  # H, S, D, D, 2 without the device axis
    tokens = ",".join(map(str, runner.acc.step[0].sum_SxVxD.hi.shape))  # IntraSim's per-token sums
    copies = [line for line in hlo.splitlines() if re.search(r"\bcopy\(", line) and (gram in line or tokens in line)]
    assert not copies, copies[:4]


def test_accelerator_spectra_equal_numpy_eigvalsh():
    """What finalize runs on accelerators (the states' covariances reduced to tridiagonal form in
    one batch, then all states' tridiagonals bisected in one call, in float64 by XLA) against what it runs on
    CPUs (numpy eigvalsh of the same covariances), for all groups together and each group, on
    two anisotropic states of different scales (each must get its own eigenvalues back)."""
    rng = np.random.default_rng(11)
    g, n, d = 3, 400, 40
    centered = lambda v: np.einsum("gnd,gne->gde", v - v.mean(1, keepdims=True), v - v.mean(1, keepdims=True))
    pair = lambda m: stats.DFPair(jnp.asarray(np.stack([m, m - m.astype(np.float32)], -1).astype(np.float32)))
    states = []
    for scale in (1.0, 30.0):
        x_GxNxD = scale * (rng.normal(size=(g, n, d)) * np.linspace(0.01, 2.0, d) + 4.0 * rng.normal(size=d))
        x_GxNxD[1] += 1.5 * scale  # the groups differ in mean: the combination adds Chan's term
        u_GxNxD = x_GxNxD / np.linalg.norm(x_GxNxD, axis=-1, keepdims=True)
        args = (np.full(g, float(n)), x_GxNxD.sum(1), u_GxNxD.sum(1), pair(centered(x_GxNxD)), pair(centered(u_GxNxD)))
        states.append((x_GxNxD, args))
    zeta = np.float64(0.75)  # IsoScore*'s shrinkage of each group's covariance toward the layer's
    with jax.enable_x64(True):
        got_S, want_S = ([fz._read_states(lambda s: fz._whole_spectra(*states[s][1], per_group=True), 2, on_cpu=cpu),
                          fz._read_states(lambda s: fz._group_spectra(*states[s][1], zeta), 2, on_cpu=cpu, top_ratios=True)]
                         for cpu in (False, True))
        got_S, want_S = zip(*got_S), list(zip(*want_S))
    for (x_GxNxD, _), (whole, groups), (ref_whole, ref_groups) in zip(states, got_S, want_S):
        assert whole[0].shape == ref_whole[0].shape == (3, d) and groups[0].shape == ref_groups[0].shape == (g, 2, d)
        for eig, ref in ((whole[0], ref_whole[0]), (groups[0], ref_groups[0])):
            assert np.all(np.diff(eig, axis=-1) <= 0)  # descending
            np.testing.assert_allclose(eig, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
        np.testing.assert_allclose(whole[1], ref_whole[1], rtol=1e-14)
        np.testing.assert_allclose(groups[2], ref_groups[2], rtol=1e-14)
        # the whole population's covariance is numpy's own, from the pooled rows
        cov = np.cov(x_GxNxD.reshape(-1, d).T, bias=True)
        np.testing.assert_allclose(whole[0][0], np.linalg.eigvalsh(cov)[::-1], rtol=0,
                                   atol=1e-10 * np.linalg.eigvalsh(cov).max())
        # each group: its centered spectrum, and sigma_1^2 / sum sigma^2 of its second moment and of
        # its unit vectors' covariance (Lanczos), from numpy on the group's own rows
        layer_cov = np.cov(x_GxNxD.reshape(-1, d).T)  # ddof 1: IsoScore*'s C0, every group's rows
        for k in range(g):
            x = x_GxNxD[k]
            u = x / np.linalg.norm(x, axis=-1, keepdims=True)
            cov = np.cov(x.T, bias=True)
            np.testing.assert_allclose(groups[0][k][0], np.linalg.eigvalsh(cov)[::-1], rtol=0,
                                       atol=1e-10 * np.linalg.eigvalsh(cov).max())
            shrunk = np.linalg.eigvalsh((1 - zeta) * np.cov(x.T) + zeta * layer_cov)[::-1]
            np.testing.assert_allclose(groups[0][k][1], shrunk, rtol=0, atol=1e-10 * shrunk.max())
            for j, m in enumerate((x.T @ x / n, np.cov(u.T, bias=True))):
                e = np.linalg.eigvalsh(m)
                for got in (groups[1][k, j], ref_groups[1][k, j]):
                    np.testing.assert_allclose(got, e[-1] / e.sum(), rtol=1e-12)


def test_read_outs_compiled_ahead_are_not_compiled_again(caplog):
    """finalize.compile_ahead (run while the devices measure) compiles the accelerators' float64
    read-outs from shapes alone; the calls finalize and sample_metrics then make compile nothing."""
    import logging

    g, h, s, d = 3, 3, 5, 24  # shapes no other test compiles
    device = jax.devices()[0]  # finalize's device arrays are committed to a device
    fz.compile_ahead((h, s, d, d), g, 2 * sr.BATCH, device)
    rng = np.random.default_rng(2)
    m = rng.normal(size=(h, d, d))
    pair = stats.DFPair(jax.device_put(np.stack([m @ m.transpose(0, 2, 1), np.zeros((h, d, d))], -1).astype(np.float32),
                                       device))
    x = jax.device_put(rng.normal(size=(2 * sr.BATCH, d)).astype(np.float32), device)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True), jax.enable_x64(True):
        args = [(np.full(g, 50.0), rng.normal(size=(g, d)), rng.normal(size=(g, d)), pair, pair) for _ in range(s)]
        fz._read_states(lambda i: fz._whole_spectra(*args[i], per_group=True), s, on_cpu=False)
        eigs = fz._read_states(lambda i: fz._group_spectra(*args[i], np.float64(0.75)), s, on_cpu=False, top_ratios=True)
        ratios = np.asarray(sr._states_readout((x,) * s, 2)[0][0])
    compiled = [r.getMessage()[:80] for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [c for c in compiled if any(f in c for f in ("_spectra", "_bisect", "_tridiagonal_forms",
                                                           "_top_ratios", "_states_readout"))], compiled
    assert len(eigs) == s and eigs[0][0].shape == (g, 2, d) and eigs[0][1].shape == (g, 2) and ratios.shape == (2, 2)
