"""What a user reads when something is wrong (issue 48, items 7-13): one short `error:` or `warning:`
line, never argparse's usage block or a Python warning's source line, and words that say what is
wrong. References: the rules themselves (one line, its first word), the numbers in the files."""

from __future__ import annotations

import importlib

import pytest

COMMANDS = {  # module, arguments that are otherwise fine
    "isojax.extract": ["--out", "OUT"],
    "isojax.weights.command": ["--out", "OUT", "--model", "random:pythia-70m"],
    "isojax.report.build": ["RESULTS", "--out", "OUT"],
    "isojax.report.correlate": ["RESULTS", "--scores", "SCORES"],
    "converters.__main__": ["SRC", "--out", "OUT"],
}
MISTAKES = {
    "isojax.extract": [["--max-tokens", "0"], ["--max-tokens", "-5"], ["--max-tokens", "1.5"],
                       ["--max-tokens", "abc"], ["--skip-positions", "-1"], ["--max-tokens-per-source", "0"],
                       ["--process-id", "-1"], ["--seq-len", "x"], ["--unit", "word"], ["--isoscore-zeta", "2"]],
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
        assert mistake[0] in line or "unrecognized" in line, line
    with pytest.raises(SystemExit) as e:  # a required argument left out
        main([])
    assert e.value.code == 2 and "required" in one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:  # the usage is still there on --help
        main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing made
