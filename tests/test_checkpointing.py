"""Run checkpoints: what load reads back equals what save wrote, bit for bit, for arrays written
whole and a chunk of rows at a time; only the last two steps stay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax import checkpointing
from isojax.errors import UserError


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"sums": {"hi": jnp.asarray(rng.normal(size=(5, 7, 3)).astype(np.float32)),
                     "lo": jnp.asarray(rng.normal(size=(5, 7, 3)).astype(np.float32) * 1e-8)},
            "counts": jnp.asarray(rng.integers(0, 1 << 30, (5, 7)).astype(np.int32)),
            "uneven": jnp.asarray(rng.normal(size=(4, 9, 3)).astype(np.float32)),  # 36 rows: a short last chunk
            "empty": jnp.zeros((5, 0, 3), jnp.float32), "scalar": jnp.asarray(np.int32(seed))}


def test_save_load_round_trip_whole_and_sliced(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "SLICE_BYTES", 64)  # the [5, 7, 3] arrays go 5 rows of 3 at a time
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    for step in (1, 2, 3):
        ckpt.save(step, _tree(step), {"step": step})
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["2", "3"]
    step, meta = checkpointing.latest(tmp_path / "ck")
    assert step == 3 and meta == {"step": 3}
    want = _tree(3)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
    got = checkpointing.load(tmp_path / "ck", 3, abstract)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_to_host_by_chunks_equals_the_array(monkeypatch):
    """The path taken when the devices have no room for a copy: chunks gathered into one array."""
    monkeypatch.setattr(checkpointing, "SLICE_BYTES", 64)
    for leaf in jax.tree.leaves(_tree(7)):
        got = checkpointing._to_host(leaf)
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        np.testing.assert_array_equal(got, np.asarray(leaf))


def test_pool_reserved_then_written_through_page_locked_memory(tmp_path, monkeypatch):
    """The GPU path on CPU devices (which have pinned_host memory too): reserve grows the pool in the
    background, save waits for it, and the chunks written from page-locked views read back equal."""
    monkeypatch.setattr(checkpointing, "SLICE_BYTES", 64)
    monkeypatch.setattr(checkpointing, "_pinned",
                        lambda d: jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host"))
    put = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: put.append(s) or real_put(x, s, **kw))
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    ckpt.reserve(_tree(4))
    ckpt.wait()
    reserved = list(put)
    ckpt.save(4, _tree(4), {"step": 4})
    ckpt.close()
    assert len(reserved) == len(jax.devices()) and all(s.memory_kind == "pinned_host" for s in reserved)
    assert any(getattr(s, "memory_kind", None) == "pinned_host" for s in put[len(reserved):])  # the chunks
    want = _tree(4)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(checkpointing.load(tmp_path / "ck", 4, abstract))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_clear_removes_checkpoints_and_refuses_anything_else(tmp_path):
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    ckpt.save(1, _tree(1), {"step": 1})
    ckpt.close()
    (tmp_path / "ck" / ".tmp-2-process_0").mkdir()  # a write cut short
    checkpointing.clear(tmp_path / "ck")
    assert list((tmp_path / "ck").iterdir()) == []
    mine = tmp_path / "mine"
    (mine / "2024").mkdir(parents=True)
    (mine / "2024" / "photo.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match="did not write"):
        checkpointing.clear(mine)
    assert (mine / "2024" / "photo.jpg").read_bytes() == b"x"
    checkpointing.clear(tmp_path / "absent")  # nothing to do
