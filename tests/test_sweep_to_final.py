"""Issue 46 item 6 across checkpoints: a sweep whose steps read out cka_debiased, procrustes_distance or
svcca (--measure) gets each state of each checkpoint against the same state of the final checkpoint,
on the same sampled tokens, in sweep.csv (NAME_to_final) and sweep_cka.json ("to_final"), equal to the
measures' independent float64 references (tests/test_measure_*.py: the unbiased HSIC on the n x n Grams,
scipy's orthogonal Procrustes, SVD then CCA by Cholesky whitening) on the step folders' samples.zarr;
a measure only some steps of a model read out is null there; without one, the files are as before."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from isojax.run import results, sweep, sweep_files
from isojax.stats import measures
from test_measure_cka_debiased import reference as cka_debiased
from test_measure_procrustes_distance import reference as procrustes_distance
from test_measure_svcca import reference as svcca

REFERENCES = {"cka_debiased": cka_debiased, "procrustes_distance": procrustes_distance, "svcca": svcca}
NAMES = ["embed", "block_1", "final_ln"]


def write_step(folder: Path, states_SxKxD, read_out=None, values=None) -> None:
    """A finished step folder: metrics.json (the layers, `values` {measure: value at every state but embed}),
    manifest.json (`measures`: read_out; None: no such key, as before it was recorded), samples.zarr."""
    folder.mkdir(parents=True)
    layers = [{"name": n, "inter_sim": 0.5, **{k: (None if i == 0 else v) for k, v in (values or {}).items()}}
              for i, n in enumerate(NAMES)]
    (folder / "metrics.json").write_text(json.dumps({"tokens": 500, "layers": layers}))
    manifest = {"corpus_fingerprint": "fp", **({} if read_out is None else {"measures": list(read_out)})}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    results.write_zarr(folder / "samples.zarr" / "states", np.asarray(states_SxKxD, np.float32))


def sweep_of(out: Path, read_out: dict, samples: dict, values=None) -> list[sweep.Step]:
    steps = []
    for (model, rev), x in samples.items():
        write_step(out / model / rev, x, read_out.get((model, rev)), (values or {}).get((model, rev)))
        steps.append(sweep.Step(model, rev, out / model / rev))
    return steps


def rows(out: Path) -> list[dict]:
    with open(out / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def samples_of(rng, k=40, d=6) -> dict:
    """Three checkpoints of model m: the final one's states, one near it (a rotation and noise), one with
    a state that does not vary (its measures null)."""
    final = rng.normal(size=(3, k, d)) * np.arange(1, d + 1)
    rotation = np.linalg.qr(rng.normal(size=(d, d)))[0]
    near = final @ rotation + 0.3 * rng.normal(size=final.shape)
    flat = rng.normal(size=final.shape)
    flat[1] = 2.0
    return {("m", "step1"): near, ("m", "step2"): flat, ("m", "step9"): final}


def close(got: list, want: list) -> bool:
    """Equal to 1e-8 relative (1e-10 absolute), null where the reference is."""
    return len(got) == len(want) and all((g is None) == (w is None)
                                         and (w is None or g == pytest.approx(w, rel=1e-8, abs=1e-10))
                                         for g, w in zip(got, want))


@pytest.mark.parametrize("host", [True, False])  # numpy on the CPU; jitted, the accelerators' way
def test_to_final_equals_the_float64_references_on_the_samples(tmp_path, monkeypatch, host):
    monkeypatch.setattr(measures, "on_host", lambda: host)
    samples = samples_of(np.random.default_rng(1))
    steps = sweep_of(tmp_path, {key: list(REFERENCES) for key in samples}, samples)
    sweep.write_sweep_csv(tmp_path, steps)
    got = rows(tmp_path)
    entry = json.loads((tmp_path / "sweep_cka.json").read_text())["m"]
    assert set(entry["to_final"]) == set(REFERENCES)
    final = samples["m", "step9"].astype(np.float32).astype(np.float64)  # as samples.zarr holds it
    for (_, rev), x in samples.items():
        x = x.astype(np.float32).astype(np.float64)
        for name, reference in REFERENCES.items():
            want = [reference(x[s], final[s]) for s in range(3)]
            assert close(entry["to_final"][name][rev], want), (name, rev)
            column = [r[f"{name}_to_final"] for r in got if r["revision"] == rev]
            assert column == ["" if v is None else repr(v) for v in entry["to_final"][name][rev]]
    assert entry["to_final"]["cka_debiased"]["step9"] == pytest.approx([1.0] * 3)  # each state against itself
    assert entry["to_final"]["procrustes_distance"]["step9"] == pytest.approx([0.0] * 3, abs=1e-12)
    assert entry["to_final"]["procrustes_distance"]["step2"][1] is None  # a state that does not vary


def test_a_measure_only_some_steps_read_out_is_null(tmp_path, capsys):
    """Of model m, every step read out cka_debiased (step2 before the manifest recorded it: from its values),
    only some svcca; model n read out none: its cka_debiased_to_final is null too."""
    rng = np.random.default_rng(2)
    samples = {**samples_of(rng), **{("n", rev): rng.normal(size=(3, 40, 6)) for rev in ("step1", "step9")}}
    read_out = {("m", "step1"): ["cka_debiased", "svcca"], ("m", "step9"): ["svcca", "cka_debiased"],
                ("n", "step1"): [], ("n", "step9"): []}
    steps = sweep_of(tmp_path, read_out, samples, values={("m", "step2"): {"cka_debiased": 0.3}})
    sweep.write_sweep_csv(tmp_path, steps)
    got = rows(tmp_path)
    assert "procrustes_distance_to_final" not in got[0] and "svcca_to_final" in got[0]
    doc = json.loads((tmp_path / "sweep_cka.json").read_text())
    assert list(doc["m"]["to_final"]) == ["cka_debiased"] and "to_final" not in doc["n"]
    want = [cka_debiased(samples["m", "step2"][s].astype(np.float32), samples["m", "step9"][s].astype(np.float32))
            for s in range(3)]
    assert close(doc["m"]["to_final"]["cka_debiased"]["step2"], want)
    for r in got:
        assert r["svcca_to_final"] == "" and (r["cka_debiased_to_final"] == "") == (r["model"] == "n"
                                                                                     or r["name"] == "block_1"
                                                                                     and r["revision"] == "step2")
    err = capsys.readouterr().err
    assert "svcca_to_final of m is null: 2 of its 3 checkpoints read svcca out" in err
    assert "n is null" not in err  # no step of n read out any


def test_without_the_measures_the_sweep_files_are_as_before(tmp_path):
    """No step read one out (an empty `measures`, or a manifest before it was recorded and no values):
    no column, no key; sweep.csv and sweep_cka.json byte for byte those of either."""
    samples = samples_of(np.random.default_rng(3))
    for name, read_out in (("empty", {key: [] for key in samples}), ("before", {})):
        sweep.write_sweep_csv(tmp_path / name, sweep_of(tmp_path / name, read_out, samples))
    assert not any(c.endswith("_to_final") for c in rows(tmp_path / "empty")[0])
    assert list(json.loads((tmp_path / "empty" / "sweep_cka.json").read_text())["m"]) == \
        ["final", "layers", "tokens", "checkpoints"]
    for file in ("sweep.csv", "sweep_cka.json"):
        assert (tmp_path / "empty" / file).read_bytes() == (tmp_path / "before" / file).read_bytes()
    assert sweep_files.read_out(tmp_path / "empty" / "m" / "step1") == []


def test_an_unreadable_manifest_is_one_error_and_the_earlier_files_stay(tmp_path):
    """A step's manifest.json that is not JSON: UserError naming it (the CLI's one `error:` line), the
    sweep's files written before unchanged, none half written."""
    from isojax.errors import UserError
    samples = samples_of(np.random.default_rng(4))
    steps = sweep_of(tmp_path, {key: ["svcca"] for key in samples}, samples)
    sweep.write_sweep_csv(tmp_path, steps)
    before = {f: (tmp_path / f).read_bytes() for f in ("sweep.csv", "sweep_cka.json")}
    (tmp_path / "m" / "step2" / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match=r"step2/manifest\.json: unreadable \(") as e:
        sweep.write_sweep_csv(tmp_path, steps)
    assert "\n" not in str(e.value)
    assert {f: (tmp_path / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".isojax-results.json", "m", "sweep.csv", "sweep_cka.json"]
