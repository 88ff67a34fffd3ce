"""Run checkpoints: what load reads back equals what save wrote, bit for bit, for arrays written
whole and a chunk of rows at a time; only the last two steps stay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.device import checkpoints as checkpointing
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


DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64, jnp.int8, jnp.int16, jnp.int32, jnp.int64,
          jnp.uint32, jnp.bool_, jnp.float8_e4m3fn]


@pytest.mark.parametrize("sliced", [False, True])
def test_every_dtype_round_trips_bit_for_bit(tmp_path, monkeypatch, sliced):
    """bfloat16 (the accelerator default's sample) and float8 are what .npy cannot describe: they
    came back as void ('|V2') and no run in bf16 could resume."""
    if sliced:
        monkeypatch.setattr(checkpointing, "SLICE_BYTES", 64)
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        tree = {np.dtype(d).name: jnp.asarray(rng.normal(size=(6, 11)) * 50).astype(d) for d in DTYPES}
        tree["bf16_scalar"] = jnp.asarray(1.5, jnp.bfloat16)
        ckpt = checkpointing.Checkpointer(tmp_path / "ck")
        ckpt.save(1, tree, {"step": 1})
        ckpt.close()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        got = checkpointing.load(tmp_path / "ck", 1, abstract)
        for k in tree:
            a, b = np.asarray(tree[k]), np.asarray(got[k])
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert a.tobytes() == b.tobytes(), k  # bit for bit, NaN payloads and -0 included


def _saved(tmp_path, steps=(1, 2)):
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    for step in steps:
        ckpt.save(step, _tree(step), {"step": step})
    ckpt.close()
    want = _tree(steps[-1])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)


def _shard(tmp_path, step, leaf="sums__hi"):
    return next((tmp_path / "ck" / str(step) / "process_0").glob(f"{leaf}.*.npy"))


@pytest.mark.parametrize("damage", ["zeroed", "flipped", "truncated", "missing", "meta_truncated", "meta_edited"])
def test_damaged_files_are_named(tmp_path, damage):
    abstract = _saved(tmp_path)
    f, meta = _shard(tmp_path, 2), tmp_path / "ck" / "2" / "process_0" / "meta.json"
    data = bytearray(f.read_bytes())
    if damage == "zeroed":  # same size, a block of zeros (4 KB in the case)
        data[-64:] = bytes(64)
        f.write_bytes(data)
    elif damage == "flipped":
        data[-5] ^= 0x10
        f.write_bytes(data)
    elif damage == "truncated":
        f.write_bytes(data[:-7])
    elif damage == "missing":
        f.unlink()
    elif damage == "meta_truncated":
        meta.write_text(meta.read_text()[:40])
    else:  # still valid JSON, one number changed
        meta.write_text(meta.read_text().replace('"step": 2', '"step": 7'))
    with pytest.raises(checkpointing.Damaged):
        checkpointing.load(tmp_path / "ck", 2, abstract)
    checkpointing.load(tmp_path / "ck", 1, abstract)  # the step before is whole


class _Runner:
    def __init__(self, abstract):
        self.abstract, self.acc = abstract, None

    def load(self, acc):
        self.acc = acc


def test_resume_falls_back_past_a_damaged_newest_step(tmp_path, capsys):
    from isojax.run.loop import resume
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    for step in (1, 2):
        ckpt.save(step, _tree(step), {"settings": {"a": 1}, "cursor": [step], "done": {"tokens": 10 * step}})
    ckpt.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _tree(0))
    f = _shard(tmp_path, 2)
    data = bytearray(f.read_bytes())
    data[-4096:] = bytes(4096) if len(data) > 8192 else bytes(len(data) - 128)
    data[-1] ^= 0xFF
    f.write_bytes(data)
    runner = _Runner(abstract)
    cursor, done = resume(runner, tmp_path / "ck", {"a": 1}, {"tokens": 0})
    assert cursor == [1] and done == {"tokens": 10}
    for a, b in zip(jax.tree.leaves(_tree(1)), jax.tree.leaves(runner.acc)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    err = capsys.readouterr().err
    assert "step 2" in err and "damaged" in err and "falling back to step 1" in err
    assert not (tmp_path / "ck" / "2").exists()  # the damaged step is gone; a new step 2 can be written
    with pytest.raises(UserError, match="other settings"):
        resume(runner, tmp_path / "ck", {"a": 2}, {"tokens": 0})
    _shard(tmp_path, 1).write_bytes(b"")
    with pytest.raises(UserError, match="reads back whole"):
        resume(runner, tmp_path / "ck", {"a": 1}, {"tokens": 0})


def test_disk_full_is_called_so_and_leaves_nothing_behind(small_disk):
    disk = small_disk("disk", 64)
    big = {"x": jnp.ones((64, 1024), jnp.float32)}  # 256 KB: does not fit
    ckpt = checkpointing.Checkpointer(disk / "ck")
    ckpt.save(1, {"x": jnp.ones((4, 4), jnp.float32)}, {"step": 1})
    ckpt.save(2, big, {"step": 2})
    with pytest.raises(UserError, match="disk full"):
        ckpt.close()
    assert sorted(p.name for p in (disk / "ck").iterdir()) == ["1"]  # no partial .tmp- keeps the disk full
    assert checkpointing.latest(disk / "ck") == (1, {"step": 1})


def test_remove_keeps_what_isojax_did_not_write(tmp_path):
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    ckpt.save(1, _tree(1), {"step": 1})
    ckpt.close()
    (tmp_path / "ck" / "my_model.pt").write_bytes(b"mine")
    checkpointing.remove(tmp_path / "ck")
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["my_model.pt"]
    (tmp_path / "ck" / "my_model.pt").unlink()
    checkpointing.remove(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_result_files_hold_every_sampled_and_summed_value_exactly(tmp_path):
    """The other files a run writes from device arrays: a bfloat16 sample goes to samples.zarr as
    float32 (every bf16 value exactly), per-token counts as int64, unit sums as float64."""
    import ml_dtypes
    import tensorstore as ts

    from isojax.run.results import _write_data
    rng = np.random.default_rng(3)
    sample = rng.normal(size=(3, 7, 5)).astype(ml_dtypes.bfloat16)
    sums = rng.normal(size=(3, 11, 5))
    count = rng.integers(0, 1 << 40, 11)
    final = {"token": {"count_V": count, "intra_sim_SxV": rng.normal(size=(3, 11))}, "sample": lambda s: sample[s]}
    _write_data(tmp_path, {"layers": [{"name": "embed"}]}, final, ["embed", "block_1", "final_ln"], lambda s: sums[s])
    read = lambda name: ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / name)}}
                                ).result().read().result()
    got = read("samples.zarr/states")
    assert got.dtype == np.float32 and np.array_equal(got.astype(ml_dtypes.bfloat16).view(np.uint16), sample.view(np.uint16))
    assert read("tokens.zarr/count").dtype == np.int64 and np.array_equal(read("tokens.zarr/count"), count)
    assert read("tokens.zarr/unit_sum").tobytes() == sums.tobytes()
