"""The package's layout: no import circles among isojax's modules (function-level imports
included), folders import one way, the kernels import only JAX and isojax.numerics, and no module
runs over ~400 lines without saying why at its top (a line starting "Length:" in its first 20
lines)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "isojax"
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """isojax modules that `path` imports anywhere in its body (a package's __init__ is not counted
    for `from package import module`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # the lazy top-level package and the thin public shims are entry points, not layers
    return {m: imports_of(p, known) - {"isojax", m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(graph()) == []


def test_kernels_import_nothing_of_isojax_but_the_numerics():
    """kernels/ sits below the model: every module in it (its __init__ included) imports JAX and
    isojax.numerics, nothing else of isojax (which kernel runs where is device/kernel_choice.py's)."""
    g = graph()
    kernels = [m for m in g if m == "isojax.kernels" or m.startswith("isojax.kernels.")]
    assert len(kernels) > 3
    for m in kernels:
        assert g[m] <= {"isojax.numerics"}, (m, g[m])
    assert g["isojax.numerics"] == set()
    for path in (PACKAGE / "kernels").glob("*.py"):
        assert "flax" not in path.read_text(), path


def test_modules_say_why_they_are_long():
    for m, path in modules().items():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES:
            assert any(line.lstrip().startswith("Length:") for line in lines[:20]), \
                f"{m}: {len(lines)} lines and no 'Length:' reason at its top"


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else module


def test_no_two_way_arrows_between_folders():
    """Folders import one way, with no exception: the model calls the kernels, and both use the
    numerics below them (isojax.numerics)."""
    g = graph()
    edges = {(folder(a), folder(d)) for a, deps in g.items() for d in deps if folder(a) != folder(d)}
    assert ("model", "kernels") in edges
    two_way = {tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}
    assert two_way == set(), two_way


def test_model_reads_no_hugging_face_files():
    """model/ holds the shapes and the Flax modules; Hugging Face's config.json files, checkpoints and
    the presets are read by hf/ (isojax.hf.family), which imports model/, never the other way."""
    for m, deps in graph().items():
        if folder(m) == "model":
            assert not {d for d in deps if folder(d) == "hf"}, (m, deps)
            assert "json" not in (PACKAGE / "model" / f"{m.split('.')[-1]}.py").read_text().split(), m


def test_test_files_ask_for_reference_packages_through_need():
    """48.14: a reference package a host may lack (conftest.REFERENCE_PACKAGES: the GPU lane's host
    had no IsoScore) is never imported at a test file's top level, where its absence fails the whole
    file at collection: conftest.need() imports it where it is used, and skips that test, saying why."""
    from conftest import REFERENCE_PACKAGES
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in REFERENCE_PACKAGES for n in names):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def test_a_host_without_isoscore_or_skdim_skips_their_tests_saying_why(tmp_path):
    """The tests that compare against IsoScore and scikit-dimension, with both made unimportable:
    collected, skipped with the reason, and the rest of their files still run."""
    import subprocess
    import sys
    (tmp_path / "block.py").write_text(
        "import importlib.abc, sys\n"
        "class Blocker(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('IsoScore', 'skdim'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "import pytest\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n")
    p = subprocess.run([sys.executable, str(tmp_path / "block.py"), "-rps", "-p", "no:cacheprovider",
                        "tests/test_spectral_measures.py", "tests/test_geometry.py", "tests/test_intrinsic.py",
                        "-k", "isoscore_and_isoscore_star or argparse_error or estimators_equal_skdim"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "PASSED tests/test_spectral_measures.py::test_isoscore_zeta_outside_0_1_is_an_argparse_error" in p.stdout
    assert "SKIPPED [2] tests/conftest.py" in p.stdout and "reference package IsoScore is not installed" in p.stdout
    assert "reference package skdim is not installed" in p.stdout, p.stdout[-3000:]
