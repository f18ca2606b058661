"""``fxzero --help`` and each command's ``--help`` are plain text: no reST markup from the
docstrings they are made of. (The console script and ``python -m fxzero`` both call
:func:`fxzero.cli.main`; tests/test_package.py runs the script.)"""

from __future__ import annotations

import re

import pytest

from fxzero.cli import main
from fxzero.help_text import plain_text

_MARKUP = re.compile(r"``|:[a-z]+:`|`[^`\n]+`|::$|\*\*", flags=re.M)


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["explain"], ["parity"]], ids=["fxzero", "explain", "parity"])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(command, capsys)
    assert text.startswith(f"usage: fxzero {command[0] + ' ' if command else ''}")
    assert _MARKUP.findall(text) == [], text


def test_plain_text_drops_the_markup_and_keeps_the_layout() -> None:
    text = "Run :func:`~fxzero.explain` (:mod:`the tool <fxzero.explainer>`), ``opt.step()``, **once**::\n\n    fxzero explain x.py\n"
    assert plain_text(text) == "Run explain (the tool), opt.step(), once:\n\n    fxzero explain x.py\n"
    assert plain_text("An example ::\n\n    x\n") == "An example\n\n    x\n"
