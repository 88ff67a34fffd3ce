"""The registry of measures (isojax.stats.measures) against what reads it: the README's measures table
holds each registered measure's row exactly, once, and no other row names a registered metric; a
layer that lacks a registered measure (results of an older isojax) reads it as null in layers.csv,
isojax.load and the report's figures, never as a number."""

import json
import re
from pathlib import Path

import numpy as np

from isojax.stats import measures

README = Path(__file__).resolve().parents[1] / "README.md"


def table_rows() -> list[str]:
    """The rows of the README's geometry measures table (`| key | definition | paper |`)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("| key | definition | paper |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.strip().startswith("|"):
            break
        rows.append(line.strip())
    return rows


def test_the_readme_measures_table_has_each_registered_row_and_no_other_row_names_one():
    rows = table_rows()
    registered = {m.readme_row for m in measures.MEASURES.values()}
    for name, m in measures.MEASURES.items():
        assert rows.count(m.readme_row) == 1, f"README: the row of {name} is missing or not as registered"
    names = set(measures.names())
    for row in rows:
        keys = set(re.findall(r"`([a-z_0-9]+)`", row.split("|")[1]))
        assert not keys & names or row in registered, f"README: a row names {keys & names} unlike the registry: {row}"
    for m in measures.MEASURES.values():  # each row's key cell names its metrics, and its paper is its last cell
        assert {f"`{x.name}`" for x in m.metrics} <= set(re.findall(r"`[a-z_0-9]+`", m.readme_row.split("|")[1]))
        assert m.readme_row.split("|")[-2].strip() == m.paper


def test_every_module_of_the_package_with_a_measure_is_registered():
    found = sorted(p.stem for p in Path(measures.__file__).parent.glob("*.py")
                   if "MEASURE = Measure(" in p.read_text(encoding="utf-8"))
    assert list(measures.MEASURES) == found and found
    assert len(set(measures.names())) == len(measures.names())


def test_results_without_the_registered_measures_read_them_as_null(tmp_path):
    """metrics.json of an older isojax: layers.csv, isojax.load and the report read n/a, never a number
    (a dict-valued measure, gride: each of its columns, gride_2 ... gride_64)."""
    import isojax
    from isojax.report.collect import _extract_run
    from isojax.run.results import write_layers_csv
    folder = tmp_path / "old"
    folder.mkdir()
    layers = [{"name": n, "count": 10, "inter_sim": 0.1, "null_eigenvalues": 0} for n in ("embed", "block_1")]
    (folder / "metrics.json").write_text(json.dumps({"model": "m", "tokens": 10, "layers": layers}))
    df = isojax.load(folder)
    lacking = [key for key in measures.columns() if key not in layers[0]]
    assert "inter_sim" in measures.columns() and "isoscore" in lacking
    for key in lacking:
        assert df[key].isna().all(), key
    assert df["inter_sim"].tolist() == [0.1, 0.1]
    write_layers_csv(tmp_path / "layers.csv", layers)
    head, *rows = (tmp_path / "layers.csv").read_text().splitlines()
    cols = head.split(",")
    for key in lacking:
        assert all(row.split(",")[cols.index(key)] == "" for row in rows), key
    got = _extract_run(folder).data["layers"]
    assert all(layer[key] is None for layer in got for key in lacking)
    assert [layer["count"] for layer in got] == [10, 10]


def test_the_first_state_has_no_pairs_measure_and_an_off_measure_is_null(monkeypatch):
    import dataclasses
    x = np.random.default_rng(0).normal(size=(30, 4))
    first = measures.sample_readout(None, x)
    assert all(first[k] is None for k in measures.names(("pairs",)))
    assert first.keys() == set(measures.names(("sample", "pairs")))
    on = measures.sample_readout(x, x + 1.0)
    assert on["block_influence"] is not None
    off = {k: dataclasses.replace(m, on_by_default=k != "block_influence") for k, m in measures.MEASURES.items()}
    monkeypatch.setattr(measures, "MEASURES", off)
    assert measures.sample_readout(x, x + 1.0)["block_influence"] is None


def test_a_dict_valued_measure_is_a_column_per_key_in_layers_csv(tmp_path):
    """gride = {"2": id, ..., "64": id} in metrics.json: gride_2 ... gride_64 in layers.csv, null where it is
    null or absent (no sample), and its metrics.json value without a sample is {key: null}."""
    from isojax.run.results import flat_layer, write_layers_csv
    keys = measures.MEASURES["gride"].metrics[0].keys
    assert keys == ("2", "4", "8", "16", "32", "64") and measures.nulls()["gride"] == dict.fromkeys(keys)
    layers = [{"name": "block_1", "gride": {k: float(i) for i, k in enumerate(keys)}},
              {"name": "block_2", "gride": None}, {"name": "block_3", "gride": dict.fromkeys(keys)}, {"name": "x"}]
    write_layers_csv(tmp_path / "layers.csv", layers)
    head, *rows = (tmp_path / "layers.csv").read_text().splitlines()
    cols = head.split(",")
    assert "gride" not in cols
    assert [rows[0].split(",")[cols.index(f"gride_{k}")] for k in keys] == [str(float(i)) for i in range(6)]
    assert all(row.split(",")[cols.index(f"gride_{k}")] == "" for row in rows[1:] for k in keys)
    assert all("gride" not in flat_layer(layer) for layer in layers)


def test_measure_flag_takes_only_the_measures_off_by_default(tmp_path):
    """--measure NAME turns on a registered read-out measure that is off by default (the 1- and 2-device
    run of test_spectral_measures checks their values with and without it); any other name, a measure
    on by default or a step measure (which has a flag of its own), is one `error:` line and exit 2
    before anything is written; isojax.measure(measures=...) refuses them with a UserError."""
    import os
    import subprocess
    import sys

    import pytest

    import isojax
    from isojax.errors import UserError
    off = measures.optional()
    assert off and all(not measures.MEASURES[n].on_by_default and measures.MEASURES[n].reads != "step" for n in off)
    assert measures.check_optional([off[0], off[0]]) == (off[0],)
    on_by_default = next(n for n, m in measures.MEASURES.items() if m.on_by_default)
    for wrong in ("no_such_measure", on_by_default, "logit_lens", f"{off[0]},nope"):
        out = tmp_path / wrong.replace(",", "_")
        proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--measure", wrong, "--out", str(out)],
                              capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: unknown measure"), proc.stderr
        assert ", ".join(off) in lines[0] and not out.exists()
    with pytest.raises(UserError, match="unknown measure"):
        isojax.measure(measures=["no_such_measure"], max_tokens=64)
