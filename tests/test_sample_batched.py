"""The sample's read-outs batched over states (stats.sr._states_readout, _cross_matrix, and
sample_metrics / sample_cka around them) as accelerators run them, here on the CPU backend, against
numpy float64 written out plainly, on fresh random states, with chunk boundaries forced small."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.stats import finalize as fz
from isojax.stats import sample_readout as sr
from isojax.stats import measures


def states_of(s, k, d, seed):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 3.0, size=(s, 1, d))  # anisotropic, a different shape per state
    return (rng.normal(size=(s, k, d)) * scale + rng.normal(size=(s, 1, d))).astype(np.float32)


def ratio(x):  # sigma_1^2 / sum sigma^2 of a batch, from its singular values
    sv = np.linalg.svd(x, compute_uv=False)
    return sv[0] ** 2 / (sv ** 2).sum()


def inter_sim_standardized(x):  # every distinct pair's cosine of the z-scored points, averaged
    z = (x - x.mean(0)) / x.std(0)
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    cos = u @ u.T
    k = len(x)
    return (cos.sum() - np.trace(cos)) / (k * k - k)


def centered_cross(x, y):
    x, y = x - x.mean(0), y - y.mean(0)
    return float(sum((x[:, i] @ y[:, j]) ** 2 for i in range(x.shape[1]) for j in range(y.shape[1])))


def test_states_readout_batch_anisotropy_of_a_chunk_of_states():
    x = states_of(3, 2 * sr.BATCH + 37, 6, seed=11)  # 37 points past the last batch are left out
    with jax.enable_x64(True):
        ratios, median, _ = jax.device_get(sr._states_readout(tuple(jnp.asarray(v) for v in x), 2))
    assert ratios.shape == (3, 2, 2) and median.shape == (3,)
    for s, v in enumerate(x.astype(np.float64)):
        for b in range(2):
            batch = v[b * sr.BATCH:(b + 1) * sr.BATCH]
            want = [ratio(batch - batch.mean(0)), ratio(batch)]
            np.testing.assert_allclose(ratios[s, b], want, rtol=1e-11)
        assert median[s] == np.median(np.abs(v))


def test_states_readout_geometry_without_batches_and_cross_matrix():
    x = states_of(4, 50, 7, seed=12)
    x64 = x.astype(np.float64)
    with jax.enable_x64(True):
        ratios, median, standardized = jax.device_get(sr._states_readout(tuple(jnp.asarray(v) for v in x), 0))
        wide = jax.device_get(sr._cross_matrix(tuple(jnp.asarray(v[:5]) for v in x)))  # K < D: the K x K Grams
        tall = jax.device_get(sr._cross_matrix(tuple(jnp.asarray(v) for v in x)))
    assert ratios is None
    np.testing.assert_allclose(standardized, [inter_sim_standardized(v) for v in x64], rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(median, [np.median(np.abs(v)) for v in x64])
    for cross, n in ((tall, 50), (wide, 5)):
        want = [[centered_cross(a[:n], b[:n]) for b in x64] for a in x64]
        np.testing.assert_allclose(cross, want, rtol=1e-11)


@pytest.mark.parametrize("chunk_states", [1, 2])
def test_sample_metrics_dispatches_every_state_before_reading_and_chunks_change_nothing(monkeypatch, chunk_states):
    """Jitted measures (the accelerators' way), chunks of 1 and 2 of 5 states: every state is asked
    for and dispatched before the first value is read; the values are numpy float64's."""
    s, k, d = 5, 2 * sr.BATCH, 4
    x = states_of(s, k, d, seed=13)
    x64 = x.astype(np.float64)
    monkeypatch.setattr(measures, "on_host", lambda: False)
    monkeypatch.setattr(sr, "SAMPLE_CHUNK_BYTES", chunk_states * 3 * 8 * k * d)
    assert sr.sample_chunk(k, d, s) == chunk_states
    events = []
    values = measures.sample_values
    monkeypatch.setattr(measures, "sample_values", lambda *a: events.append("read") or values(*a))

    def states(i):
        events.append(f"state {i}")
        return jnp.asarray(x[i])

    got = sr.sample_metrics(states, k, [f"s{i}" for i in range(s)], intrinsic=False, extra=("linearity",))
    assert events[:events.index("read")] == [f"state {i}" for i in range(s)]
    assert events.count("read") == s
    for i, m in enumerate(got):
        halves = [x64[i, :sr.BATCH], x64[i, sr.BATCH:]]
        centered = [ratio(b - b.mean(0)) for b in halves]
        assert m["anisotropy_batch_mean"] == pytest.approx(np.mean(centered), rel=1e-11)
        assert m["anisotropy_batch_std"] == pytest.approx(np.std(centered, ddof=1), rel=1e-8)
        assert m["anisotropy_uncentered_batch_mean"] == pytest.approx(np.mean([ratio(b) for b in halves]), rel=1e-11)
        assert m["sample_abs_median"] == np.median(np.abs(x64[i]))
        if i == 0:
            assert m["linearity"] is None and m["block_influence"] is None
            continue
        a, b = (v - v.mean(0) for v in (x64[i - 1], x64[i]))
        a, b = a / np.linalg.norm(a), b / np.linalg.norm(b)
        fit = np.linalg.lstsq(a, b, rcond=None)[0]
        assert m["linearity"] == pytest.approx(1 - np.sum((a @ fit - b) ** 2), rel=1e-11)
    with jax.enable_x64(True):
        cka = sr.sample_cka(lambda i: jnp.asarray(x[i]), k, [f"s{i}" for i in range(s)])["matrix"]
    cross = np.array([[centered_cross(a, b) for b in x64] for a in x64])
    want = cross / np.sqrt(np.outer(np.diag(cross), np.diag(cross)))
    np.testing.assert_allclose(cka, want, rtol=1e-11)
