"""The examples of magi-solver's README run and print what their comments say."""

import contextlib
import io
import re
import shlex
from pathlib import Path

from magi_solver import cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_python_example_prints_what_its_comments_say():
    (code,) = _blocks("python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    expected = [line.rsplit(": ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    printed = out.getvalue().splitlines()
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected):
        assert got.startswith(want.rstrip(".")), (got, want)


def test_magi_plan_example_runs():
    commands = [c.strip() for b in _blocks("bash") for c in b.splitlines() if c.startswith("magi-plan")]
    assert commands
    for command in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(shlex.split(command)[1:]) == 0
        assert "imbalance (max/mean area): 1.0133" in out.getvalue()
