"""isojax.hf.files against checkpoints written by transformers / torch / safetensors."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import transformers

from isojax.hf import files as hf_files
from isojax.weights import isotropy
from isojax.errors import UserError
from conftest import need

torch = need("torch")
REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_neox(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.GPTNeoXForCausalLM(cfg).to(dtype)


def state(model):
    """Tensors under their checkpoint names (transformers 5 calls embed_out `lm_head` in memory)."""
    return {k.replace("lm_head.", "embed_out."): v.detach().float().numpy()
            for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    model = tiny_neox()
    model.save_pretrained(d, max_shard_size="20KB")
    assert len(list(d.glob("model-*.safetensors"))) > 1
    return d, state(model)


def test_sharded_safetensors_reads_every_tensor(sharded):
    d, ref = sharded
    r = hf_files.CheckpointReader(d)
    assert r.format == "safetensors"
    assert set(ref) <= set(r.names())
    for k, v in ref.items():
        got = r.read(k)
        assert r.shape(k) == v.shape and r.dtype(k) == "float32"
        np.testing.assert_array_equal(got, v)
    rows = r.rows("embed_out.weight")  # a matrix is read a block of rows at a time, not loaded
    assert isinstance(rows, isotropy.RowBlocks) and rows.shape == ref["embed_out.weight"].shape
    np.testing.assert_array_equal(rows[5:9], ref["embed_out.weight"][5:9])


def test_bfloat16_is_upcast(tmp_path):
    model = tiny_neox(1, torch.bfloat16)
    model.save_pretrained(tmp_path)
    r = hf_files.CheckpointReader(tmp_path)
    assert r.dtype("embed_out.weight") == "bfloat16"
    got = r.read("embed_out.weight")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, state(model)["embed_out.weight"])
    rows = r.rows("embed_out.weight")  # row blocks are upcast too, and clipped like numpy's
    assert rows.dtype == "bfloat16" and rows[90:200].dtype == np.float32
    np.testing.assert_array_equal(rows[90:200], state(model)["embed_out.weight"][90:])
    assert rows[200:300].shape == (0, 32)
    np.testing.assert_allclose(isotropy.analyze_matrix(rows).singular_values,
                               isotropy.analyze_matrix(got).singular_values, rtol=1e-12, atol=1e-12)


def test_bin_single_and_sharded_and_safetensors_preferred(tmp_path):
    model = tiny_neox(2)
    sd = model.state_dict()
    single = tmp_path / "single"
    single.mkdir()
    sd = {k.replace("lm_head.", "embed_out."): v for k, v in sd.items()}
    torch.save(sd, single / "pytorch_model.bin")
    r = hf_files.CheckpointReader(single)
    assert r.format == "bin"
    for k, v in state(model).items():
        np.testing.assert_array_equal(r.read(k), v)
    shards = tmp_path / "shards"
    shards.mkdir()
    keys = list(sd)
    parts = {"pytorch_model-00001-of-00002.bin": keys[:3], "pytorch_model-00002-of-00002.bin": keys[3:]}
    for fname, ks in parts.items():
        torch.save({k: sd[k] for k in ks}, shards / fname)
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    r = hf_files.CheckpointReader(shards)
    np.testing.assert_array_equal(r.read(keys[-1]), sd[keys[-1]].numpy())
    model.save_pretrained(single)  # now both formats: safetensors wins
    assert hf_files.CheckpointReader(single).format == "safetensors"


def test_truncated_safetensors(tmp_path):
    tiny_neox(3).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(UserError, match=r"truncated safetensors file: .*model\.safetensors"):
        hf_files.CheckpointReader(tmp_path)
    with open(f, "r+b") as fh:
        fh.truncate(20)  # inside the header
    with pytest.raises(UserError, match="truncated"):
        hf_files.CheckpointReader(tmp_path)
    f.write_bytes(b"\x0a" + bytes(7) + b"{not json}")
    with pytest.raises(UserError, match=r"corrupt safetensors file: .*model\.safetensors \(invalid JSON"):
        hf_files.CheckpointReader(tmp_path)


def test_float16_and_int_dtypes_reported(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(4)
    t = {"h": rng.standard_normal((6, 3)).astype(np.float16), "i": np.arange(4, dtype=np.int64)}
    save_file(t, str(tmp_path / "model.safetensors"))
    r = hf_files.CheckpointReader(tmp_path)
    assert (r.dtype("h"), r.dtype("i")) == ("float16", "int64")
    np.testing.assert_array_equal(r.read("h"), t["h"])
    np.testing.assert_array_equal(r.read("i"), t["i"])


def test_mapped_views_equal_reads_in_every_stored_dtype(sharded, tmp_path):
    """CheckpointReader.mapped (what load_model copies to the devices): the tensor as stored, a
    view of the mapped file, equal to `read` (bfloat16 kept, not upcast), in sharded files too."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    t = {"h": rng.standard_normal((6, 3)).astype(np.float16), "f": rng.standard_normal((2, 5)).astype(np.float32),
         "b": rng.standard_normal((4, 7)).astype(ml_dtypes.bfloat16), "i": np.arange(4, dtype=np.int64),
         "scalar": np.asarray(2.5, np.float32)}
    save_file(t, str(tmp_path / "model.safetensors"))
    r = hf_files.CheckpointReader(tmp_path)
    for name, want in t.items():
        got = r.mapped(name)
        assert got.dtype == want.dtype and got.shape == want.shape and not got.flags.writeable
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
    d, ref = sharded
    r = hf_files.CheckpointReader(d)
    for name, want in ref.items():
        np.testing.assert_array_equal(r.mapped(name), want)


def test_missing_shard_and_partial_open(sharded, tmp_path):
    d, _ = sharded
    shutil.copytree(d, tmp_path / "c")
    index = json.loads((tmp_path / "c/model.safetensors.index.json").read_text())["weight_map"]
    gone = index["embed_out.weight"]
    (tmp_path / "c" / gone).unlink()
    with pytest.raises(UserError, match=f"missing shard {gone} listed in .*index.json"):
        hf_files.CheckpointReader(tmp_path / "c")
    other = next(k for k, f in index.items() if f != gone)
    r = hf_files.CheckpointReader(tmp_path / "c", only=[other])  # the partly downloaded case
    assert r.read(other).size > 0
    with pytest.raises(UserError, match="missing shard"):
        r.read("embed_out.weight")


def test_missing_tensor_lists_close_names(sharded):
    with pytest.raises(UserError, match="not found.*close names: embed_out.weight"):
        hf_files.CheckpointReader(sharded[0]).read("embed_outt.weight")


def test_no_weights_and_missing_dir(tmp_path):
    with pytest.raises(UserError, match="no weights found in"):
        hf_files.CheckpointReader(tmp_path)
    with pytest.raises(UserError, match="not found"):
        hf_files.CheckpointReader(tmp_path / "nope")
    with pytest.raises(UserError, match="model not found: ./nope"):
        hf_files.resolve_checkpoint("./nope")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bin_refuses_pickled_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.zeros(2), "x": Evil(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"cannot load .*pytorch_model\.bin with weights_only=True"):
        hf_files.CheckpointReader(tmp_path)
    assert not marker.exists()


def test_hub_ids_and_presets_reach_snapshot_download(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hf_files.resolve_checkpoint("pythia-70m", "step1000") == tmp_path
    assert hf_files.resolve_checkpoint("pythia-160m-deduped", allow_patterns=["*.json"]) == tmp_path
    hf_files.resolve_checkpoint("EleutherAI/pythia-12b", "main")
    hf_files.resolve_checkpoint("org/name")
    assert calls == [("EleutherAI/pythia-70m", "step1000", None),
                     ("EleutherAI/pythia-160m-deduped", None, ["*.json"]),
                     ("EleutherAI/pythia-12b", "main", None), ("org/name", None, None)]
    with pytest.raises(UserError, match="model not found: pythia-71m"):
        hf_files.resolve_checkpoint("pythia-71m")


def test_hub_errors_become_user_errors(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    def raising(cls):
        def fake(*a, **kw):
            exc = cls.__new__(cls)
            Exception.__init__(exc, "404 Client Error")
            raise exc
        return fake

    for cls, msg in ((errors.RepositoryNotFoundError, "hub repo org/x not found"),
                     (errors.RevisionNotFoundError, "revision 'step9' not found in hub repo org/x"),
                     (errors.LocalEntryNotFoundError, "not in the Hugging Face cache"),
                     (ConnectionError, "cannot download org/x@step9: ConnectionError")):
        monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(cls))
        with pytest.raises(UserError, match=msg):
            hf_files.resolve_checkpoint("org/x", "step9")


def test_resolve_weights_fetches_only_needed_shards(monkeypatch, sharded):
    import huggingface_hub

    d, _ = sharded
    calls = []

    def fake(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append(allow_patterns)
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    hf_files.resolve_weights("pythia-70m", "step0", tensors=["embed_out.weight"])
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]["embed_out.weight"]
    assert calls == [["*.json"], ["*.json", "merges.txt", shard]]


def test_offline_cache_snapshot(tmp_path, sharded):
    """A real snapshot_download in offline mode finds a cached revision (no network)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--EleutherAI--pythia-70m"
    snap = repo / "snapshots" / commit
    shutil.copytree(sharded[0], snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "step1000").write_text(commit)
    code = ("from isojax.hf import files as hf_files; from isojax.errors import UserError\n"
            "print(hf_files.resolve_checkpoint('pythia-70m', 'step1000'))\n"
            "try: hf_files.resolve_checkpoint('pythia-70m', 'step2000')\n"
            "except UserError as e: print('error:', e)\n")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert pathlib.Path(lines[0]) == snap
    assert "not in the Hugging Face cache" in lines[1] and "step2000" in lines[1], lines
