"""What a user reads when something is wrong (issue 48, items 7-13): one short `error:` or `warning:`
line, never argparse's usage block or a Python warning's source line, and words that say what is
wrong. References: the rules themselves (one line, its first word), the numbers in the files."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

COMMANDS = {  # module, arguments that are otherwise fine
    "isojax.extract": ["--out", "OUT"],
    "isojax.weights.command": ["--out", "OUT", "--model", "random:pythia-70m"],
    "isojax.report.build": ["RESULTS", "--out", "OUT"],
    "isojax.report.correlate": ["RESULTS", "--scores", "SCORES"],
    "isojax.convert": ["SRC", "--out", "OUT"],
}
MISTAKES = {
    "isojax.extract": [["--max-tokens", "0"], ["--max-tokens", "-5"], ["--max-tokens", "1.5"],
                       ["--max-tokens", "abc"], ["--skip-positions", "-1"], ["--max-tokens-per-source", "0"],
                       ["--process-id", "-1"], ["--seq-len", "x"], ["--unit", "word"], ["--isoscore-zeta", "2"],
                       ["--dry-run", "--target", ""], ["--dry-run", "--target", " "]],  # 48.12: not this machine
}
EVERY = [["--no-such-option"], ["--out"]]  # an unknown option, an option without its value


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "usage" not in err, err
    return lines[0]


@pytest.mark.parametrize("module", COMMANDS)
def test_command_line_mistakes_are_one_error_line(module, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(module).main
    for mistake in MISTAKES.get(module, []) + EVERY:
        with pytest.raises(SystemExit) as e:
            main(COMMANDS[module] + mistake)
        assert e.value.code == 2, mistake
        line = one_error_line(capsys.readouterr().err)
        assert [m for m in mistake if m.startswith("--")][-1] in line or "unrecognized" in line, line
    with pytest.raises(SystemExit) as e:  # a required argument left out
        main([])
    assert e.value.code == 2 and "required" in one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:  # the usage is still there on --help
        main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_a_free_space_refusal_shows_need_above_free(tmp_path, monkeypatch):
    """48.9: 'need up to about 0.2 GB ... has 0.2 GB free' read as a contradiction."""
    import re

    from isojax import extract
    from isojax.device.memory import defaults_platform
    from isojax.errors import UserError
    from isojax.log import gb_apart
    from isojax.run.config import MeasureConfig
    from isojax.run.measure import peek_config
    from isojax.run.results import planned_output_bytes

    assert gb_apart(2_500_000_000, 1_000_000_000) == ("2.5 GB", "1.0 GB")
    assert gb_apart(230_000_000, 220_000_000) == ("0.23 GB", "0.22 GB")
    assert gb_apart(200_000_001, 200_000_000) == ("0.200000001 GB", "0.200000000 GB")
    config = MeasureConfig.build("random:pythia-70m", None, max_tokens=4096)
    need = planned_output_bytes(peek_config("random:pythia-70m"), config, defaults_platform() != "cpu")
    for free in (need - 1, need - need // 100, need // 2, 0):
        monkeypatch.setattr(extract.shutil, "disk_usage", lambda _, free=free: type("Usage", (), {"free": free}))
        with pytest.raises(UserError) as e:
            extract.check_free_space(tmp_path / "out", config)
        shown_need, shown_free = map(float, re.search(r"need up to about ([\d.]+) GB .* has ([\d.]+) GB free",
                                                      str(e.value)).groups())
        assert shown_need > shown_free, str(e.value)
        assert abs(shown_need - need / 1e9) <= 0.05 and abs(shown_free - free / 1e9) <= 0.05


def test_correlate_suggests_a_file_it_accepts(tmp_path, monkeypatch):
    """48.10: `correlate o/sw10 --out o/sw10` suggested o/sw10/correlation.json, inside an input."""
    import re

    from isojax.errors import UserError
    from isojax.run import outdir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "o" / "sw10").mkdir(parents=True)
    (tmp_path / "scores.csv").write_text("")
    (tmp_path / "elsewhere").mkdir()
    for out, inputs, want in (("o/sw10", ["o/sw10", "scores.csv"], "o/correlation.json"),
                              ("o/sw10", ["o", "scores.csv"], "correlation.json"),
                              ("o/sw10", ["o/sw10", "o", "scores.csv"], "correlation.json"),
                              ("elsewhere", ["o/sw10", "scores.csv"], "elsewhere/correlation.json"),
                              (str(tmp_path / "o"), ["o"], str(tmp_path / "correlation.json"))):
        with pytest.raises(UserError) as e:
            outdir.check_path(Path(out), inputs, folder=False)
        suggested = re.fullmatch(r"--out \S+ is a folder; give a file name, e\.g\. (\S+)", str(e.value)).group(1)
        assert suggested == want, (out, inputs, str(e.value))
        outdir.check_path(Path(suggested), inputs, folder=False)  # accepted


def test_mixed_corpora_say_what_differs(tmp_path, capsys):
    """48.11: two runs of the same file that differ only in --max-tokens were both labelled with the
    file's name; the error names the option and each one's value. A manifest from before
    corpus_options: its settings' max_tokens."""
    import json

    from isojax.report import build

    def run(folder, revision, fingerprint, max_tokens, old=False):
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"model": "m", "revision": revision, "tokens": 1,
                                                         "layers": [{"name": "embed", "inter_sim": 0.5}]}))
        options = {"unit": "sentence", "sources": None, "max_tokens": max_tokens, "max_tokens_per_source": None}
        (folder / "manifest.json").write_text(json.dumps({
            "model": "m", "revision": revision, "corpus": "data/a.txt", "corpus_fingerprint": fingerprint,
            "settings": {"max_tokens": max_tokens}, **({} if old else {"corpus_options": options})}))

    for old in (False, True):
        root = tmp_path / f"old{old}"
        run(root / "s1", "step1", "f1", 4096, old)
        run(root / "s2", "step2", "f2", 8192, old)
        assert build.main([str(root / "s1"), str(root / "s2"), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "they differ in --max-tokens" in err and "corpus f1 (--max-tokens 4,096)" in err and \
            "corpus f2 (--max-tokens 8,192)" in err, err
    run(tmp_path / "same" / "s1", "step1", "f1", 4096)
    run(tmp_path / "same" / "s2", "step2", "f2", 4096)
    assert build.main([str(tmp_path / "same"), "--out", str(tmp_path / "out")]) == 2
    assert "the same data and options: the files changed between the runs" in capsys.readouterr().err


def test_a_misspelt_hub_dataset_is_named_before_the_budget_is_judged(tmp_path):
    """48.13: `--data hub:<no such dataset> --max-tokens N` said that --max-tokens needs --source; the
    dataset is looked up first (a hub on 127.0.0.1, tests/hub_server.py)."""
    import os
    import subprocess
    import sys

    from hub_server import LoopbackHub

    (tmp_path / "data" / "data").mkdir(parents=True)
    (tmp_path / "data" / "data" / "train.jsonl").write_text('{"text": "A record."}\n')
    hub = LoopbackHub().start()
    url = hub.url
    try:
        hub.add_dataset("tiny-org/pile", {"main": tmp_path / "data"})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1",
                   HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                                            env.get("PYTHONPATH", "")]))
        code = ("import sys\nfrom isojax.data import load_corpus\nfrom isojax.errors import UserError\n"
                "try:\n    load_corpus([sys.argv[1]], max_tokens=100)\nexcept UserError as e:\n    print(e)\n")
        said = {name: subprocess.run([sys.executable, "-c", code, f"hub:{name}:train"], env=env, capture_output=True,
                                     text=True, timeout=120).stdout for name in ("tiny-org/pile", "tiny-org/plie")}
    finally:
        hub.stop()
    assert said["tiny-org/plie"].startswith(f"hub:tiny-org/plie: no such dataset on {url}"), said
    assert "name them with --source" in said["tiny-org/pile"], said  # a dataset that is there: as before
