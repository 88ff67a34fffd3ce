"""`python -m isojax.weights --matrix PATH[:KEY]`: every format, written by its own library,
gives the metrics of `isotropy.analyze_matrix` on the array itself; bad input exits 2."""

import gzip
import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import save_file as np_save_safetensors

from conftest import need
from isojax.weights import isotropy
from isojax.weights import matrix_files
from isojax.weights import command as weights

torch = need("torch")
from safetensors.torch import save_file as torch_save_safetensors  # noqa: E402  (it imports torch)

MATRIX_KEYS = {"isotropy", "isotropy_one_sided", "isotropy_centered", "isotropy_pc_removed",
               "isotropy_scaled_centered", "mean_norm", "mean_vector_norm"}


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with isotropy.blas_threads(1):
        yield


def fresh(seed, n=240, d=24):
    """A drifted random matrix (so I(W), one-sided and centered values all differ)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) + rng.standard_normal(d) * 0.7).astype(np.float32)


def run_cli(args):
    return weights.main([str(a) for a in args])


def measured(tmp_path, *specs):
    out = tmp_path / "o"
    args = [a for s in specs for a in ("--matrix", s)]
    assert run_cli([*args, "--out", out, "--no-plots", "--overwrite"]) == 0
    return json.loads((out / "weights.json").read_text())


def write_text(path, W, header=False, words=None, end="\n", opener=open):
    """Word vectors as word2vec text / GloVe, values printed exactly (repr of the float)."""
    words = words or [f"w{i}" for i in range(len(W))]
    with opener(path, "wt", encoding="utf-8") as f:
        if header:
            f.write(f"{W.shape[0]} {W.shape[1]}{end}")
        for w, row in zip(words, W):
            f.write(w + " " + " ".join(repr(float(x)) for x in row) + end)


def _npy(p, W):
    np.save(p / "w.npy", W)
    return "w.npy"


def _npz_key(p, W):
    np.savez(p / "w.npz", emb=W, other=W[:3])
    return "w.npz:emb"


def _npz_single(p, W):
    np.savez_compressed(p / "w.npz", W)
    return "w.npz"


def _safetensors(p, W):
    np_save_safetensors({"a.emb": W, "bias": W[0]}, str(p / "w.safetensors"))
    return "w.safetensors:a.emb"


def _torch_nested(p, W):
    torch.save({"model": {"embed.weight": torch.from_numpy(W)}, "step": 7}, p / "w.pt")
    return "w.pt:model.embed.weight"


def _torch_bare(p, W):
    torch.save(torch.from_numpy(W), p / "w.bin")
    return "w.bin"


def _word2vec(p, W):
    write_text(p / "w.txt", W, header=True, end=" \r\n")  # fastText-style trailing space, CRLF
    return "w.txt"


def _glove_gz(p, W):
    write_text(p / "w.vec.gz", W, words=[f"wörd\xa0{i}" for i in range(len(W))], opener=gzip.open)
    return "w.vec.gz"


WRITERS = [_npy, _npz_key, _npz_single, _safetensors, _torch_nested, _torch_bare, _word2vec, _glove_gz]


@pytest.mark.parametrize("write", WRITERS, ids=[w.__name__.strip("_") for w in WRITERS])
def test_each_format_round_trips(tmp_path, monkeypatch, write):
    W = fresh(100 + WRITERS.index(write))
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, W)
    got = measured(tmp_path, spec)["tensors"]
    assert list(got) == [spec]
    ref = isotropy.analyze_matrix(W).metrics
    assert MATRIX_KEYS <= set(got[spec])
    for k in MATRIX_KEYS:
        assert got[spec][k] == pytest.approx(ref[k], rel=1e-12), k
    assert got[spec]["rows"] == W.shape[0] and got[spec]["dim"] == W.shape[1]
    assert got[spec]["file"] == spec.split(":")[0]


def test_bfloat16_and_float16_files(tmp_path):
    W = torch.from_numpy(fresh(5))
    torch_save_safetensors({"e": W.bfloat16(), "h": W.half()}, str(tmp_path / "w.safetensors"))
    torch.save({"e": W.bfloat16()}, tmp_path / "w.pt")
    specs = [f"{tmp_path}/w.safetensors:e", f"{tmp_path}/w.safetensors:h", f"{tmp_path}/w.pt:e"]
    got = measured(tmp_path, *specs)["tensors"]
    ref_bf16 = isotropy.analyze_matrix(W.bfloat16().float().numpy()).metrics
    ref_f16 = isotropy.analyze_matrix(W.half().numpy()).metrics
    for spec, ref, dtype in zip(specs, (ref_bf16, ref_f16, ref_bf16), ("bfloat16", "float16", "bfloat16")):
        assert got[spec]["dtype"] == dtype
        assert got[spec]["isotropy"] == pytest.approx(ref["isotropy"], rel=1e-12)
        assert got[spec]["isotropy_one_sided"] == pytest.approx(ref["isotropy_one_sided"], rel=1e-12)


def test_word2vec_and_glove_parse_to_the_matrix(tmp_path):
    W = fresh(11, n=70_000, d=3)  # more rows than one parsing chunk
    write_text(tmp_path / "w2v.txt", W, header=True)
    write_text(tmp_path / "glove.txt", W, end="\n\n")  # blank lines are skipped
    for name in ("w2v.txt", "glove.txt"):
        got = matrix_files.read_word_vectors(tmp_path / name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, W)
    (tmp_path / "tiny.txt").write_text("2 3\nthe 1 2 3\nof -0.5 1e-3 4.25\n")
    np.testing.assert_array_equal(matrix_files.read_word_vectors(tmp_path / "tiny.txt"),
                                  np.array([[1, 2, 3], [-0.5, 1e-3, 4.25]], np.float32))


def test_several_matrices_and_plots(tmp_path):
    for sub in ("a", "b"):  # same file name in two folders: distinct plot files
        (tmp_path / sub).mkdir()
        np.save(tmp_path / sub / "emb.npy", fresh(ord(sub)))
    specs = [str(tmp_path / "a/emb.npy"), str(tmp_path / "b/emb.npy")]
    out = tmp_path / "o"
    assert run_cli(["--matrix", specs[0], "--matrix", specs[1], "--out", out]) == 0
    got = json.loads((out / "weights.json").read_text())
    assert list(got["tensors"]) == specs
    assert got["tensors"][specs[0]]["isotropy"] != got["tensors"][specs[1]]["isotropy"]
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["emb_2_singular_values.png", "emb_2_svd2d.png", "emb_singular_values.png", "emb_svd2d.png"]
    assert set(np.load(out / "arrays.npz").files) >= {"emb_singular_values", "emb_2_proj2d"}


# ---- bad input: `error: <one line>`, exit 2, no output directory ----

def _bad_files(p):
    np.save(p / "three.npy", np.zeros((2, 3, 4), np.float32))
    np.save(p / "empty.npy", np.zeros((0, 4), np.float32))
    W = fresh(1, n=20, d=4)
    W[13, 2] = np.nan
    np.save(p / "nan.npy", W)
    np_save_safetensors({"w": np.where(np.eye(8, 4) > 0, np.inf, 1.0).astype(np.float32),
                         "v": np.ones(4, np.float32)}, str(p / "inf.safetensors"))
    np.savez(p / "many.npz", **{f"layer{i}": np.ones((2, 2)) for i in range(15)})
    torch.save({"model": {"emb": torch.ones(3, 2), "head": torch.ones(3, 2)}}, p / "sd.pt")
    np.save(p / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (p / "ragged.txt").write_text("a 1 2 3\nb 4 5 6\nc 7 8\n")
    (p / "word.txt").write_text("2 3\na 1 2 3\nb 4 x 6\n")
    (p / "short.txt").write_text("3 2\na 1 2\nb 3 4\n")
    (p / "bad.vec.gz").write_bytes(b"not gzip at all")
    (p / "w.csv").write_text("1,2\n3,4\n")
    data = (p / "inf.safetensors").read_bytes()
    (p / "cut.safetensors").write_bytes(data[:-9])


BAD = [
    (["nope.npy"], r"--matrix nope\.npy: no such file"),
    (["w.csv"], r"unknown file type '\.csv'; supported: \.npy, \.npz"),
    (["three.npy"], r"three\.npy has shape \(2, 3, 4\): the matrix metrics need a non-empty 2-D"),
    (["empty.npy"], r"has shape \(0, 4\)"),
    (["inf.safetensors:v"], r"inf\.safetensors \[v\] has shape \(4,\)"),
    (["nan.npy"], r"nan\.npy: the matrix holds NaN or infinite values \(the first in row 13\)"),
    (["inf.safetensors:w"], r"inf\.safetensors \[w\]: the matrix holds NaN or infinite values"),
    (["many.npz:layer99"], r"no array 'layer99' in .*many\.npz; it holds: layer9, .*\(and 5 more\)$"),
    (["many.npz"], r"many\.npz holds 15 arrays: name one as .*many\.npz:KEY"),
    (["sd.pt:model.embb"], r"no tensor 'model\.embb' in .*sd\.pt; it holds: model\.emb, model\.head"),
    (["inf.safetensors:x"], r"no tensor 'x' in .*inf\.safetensors; it holds: "),
    (["three.npy:x"], r"a \.npy file holds one matrix; drop ':x'"),
    (["obj.npy"], r"cannot read .*obj\.npy as \.npy"),
    (["ragged.txt"], r"ragged\.txt, line 3: 2 values after the word, expected 3 \(as the first vector says\)"),
    (["word.txt"], r"word\.txt, line 3: 'x' is not a number"),
    (["short.txt"], r"short\.txt: the header says 3 vectors, the file holds 2"),
    (["bad.vec.gz"], r"cannot read .*bad\.vec\.gz"),
    (["cut.safetensors:w"], r"truncated safetensors file: .*cut\.safetensors"),
    (["nan.npy", "nan.npy"], r"--matrix nan\.npy is given twice"),
]


@pytest.mark.parametrize("specs, msg", BAD, ids=[" ".join(s) for s, _ in BAD])
def test_bad_matrix_input(tmp_path, monkeypatch, capsys, specs, msg):
    _bad_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_cli([*[a for s in specs for a in ("--matrix", s)], "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(msg, err.strip()), err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


@pytest.mark.parametrize("extra, msg", [
    (["--model", "pythia-70m"], "--matrix takes no --model"),
    (["--revision", "step0"], "--matrix takes no --revision"),
    (["--tensor", "x"], "--matrix takes no --tensor"),
])
def test_matrix_combines_only_with_output_flags(tmp_path, capsys, extra, msg):
    np.save(tmp_path / "w.npy", fresh(2))
    assert run_cli(["--matrix", tmp_path / "w.npy", *extra, "--out", tmp_path / "o"]) == 2
    assert msg in capsys.readouterr().err
    assert run_cli(["--out", tmp_path / "o"]) == 2
    assert "give --model NAME_OR_PATH, or --matrix PATH[:KEY]" in capsys.readouterr().err


def test_pickled_code_is_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(3, 2), "x": Evil()}, tmp_path / "evil.pt")
    assert run_cli(["--matrix", f"{tmp_path}/evil.pt:w", "--out", tmp_path / "o"]) == 2
    assert "with weights_only=True (refusing to unpickle" in capsys.readouterr().err
    assert not marker.exists()


def test_colons_in_paths_and_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    W = fresh(3)
    np.save("a:b.npy", W)
    np_save_safetensors({"x:y": W}, "c.safetensors")
    got = measured(tmp_path, "a:b.npy", "c.safetensors:x:y")["tensors"]
    assert got["a:b.npy"]["isotropy"] == got["c.safetensors:x:y"]["isotropy"]
    assert got["c.safetensors:x:y"]["key"] == "x:y"


# ---- size bombs and damaged files (issue 26): refused from headers, before allocating ----

def _npz_claiming(path, shape, data=b"\0" * 16):
    """An .npz whose one member's header claims `shape` (float32) over `data` bytes."""
    import io
    import zipfile
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("w.npy", member.getvalue() + data)


def _bombs(p):
    _npz_claiming(p / "bomb.npz", (10**5, 10**5))  # ~250 bytes claiming 40 GB
    np.savez(p / "big.npz", w=np.ones((1000, 500), np.float32))  # honest, but over the (patched) memory
    lines = "".join(f"w{i} " + " ".join(f"{x:.4f}" for x in fresh(i, n=1, d=50)[0]) + "\n" for i in range(2000))
    data = bytearray(gzip.compress(lines.encode()))
    for i in range(1000, 1064):
        data[i] ^= 0xFF
    (p / "corrupt.vec.gz").write_bytes(bytes(data))
    (p / "wide.txt").write_text("w " + " ".join(["0.5"] * 200_000) + "\n")  # one 800 KB line
    (p / "huge_header.txt").write_text("100000000 300\na " + " ".join(["1"] * 300) + "\n")
    (p / "endless.txt").write_text("w " + "1 " * 1_000_000)  # 2 MB, no newline; the cap patched to 1 MB


BOMBS = [
    ("bomb.npz", r"bomb\.npz \[w\]: its header claims shape \(100000, 100000\) \(40,000,000,000 bytes\) "
                 r"but the archive holds 16 bytes"),
    ("big.npz", r"big\.npz \[w\] is \(1000, 500\) float32; .npz arrays are read whole .*more than the 0\.0 GiB"),
    ("corrupt.vec.gz", r"cannot read .*corrupt\.vec\.gz: Error -3 while decompressing"),
    ("wide.txt", r"wide\.txt: its 200,000 columns need a 200,000 x 200,000 float64 Gram matrix"),
    ("huge_header.txt", r"huge_header\.txt: the header's 100,000,000 x 300 float32 vectors"),
    ("endless.txt", r"endless\.txt, line 1: longer than 1 MB"),
]


@pytest.mark.parametrize("spec, msg", BOMBS, ids=[s for s, _ in BOMBS])
def test_size_bombs_and_damaged_files_are_refused(tmp_path, monkeypatch, capsys, spec, msg):
    _bombs(tmp_path)
    monkeypatch.chdir(tmp_path)
    if spec == "big.npz":
        monkeypatch.setattr(matrix_files, "available_bytes", lambda: 1 << 20)
    if spec == "huge_header.txt":
        monkeypatch.setattr(matrix_files, "available_bytes", lambda: 8 << 30)  # 240 GB claimed
    monkeypatch.setattr(matrix_files, "_MAX_LINE", 1 << 20, raising=False)
    assert run_cli(["--matrix", spec, "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(msg, err.strip()), err
    assert not (tmp_path / "o").exists()


def test_word_vectors_are_read_in_bounded_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix_files, "_BLOCK_BYTES", 4 * 24 * 7, raising=False)  # blocks of 7 rows
    W = fresh(5, n=50, d=24)
    (tmp_path / "w.txt").write_text("".join(f"w{i} " + " ".join(repr(float(x)) for x in row) + "\n"
                                            for i, row in enumerate(W)))
    np.testing.assert_array_equal(matrix_files.read_word_vectors(tmp_path / "w.txt"), W)
