"""A docstring as terminal help: reST markup removed, layout kept.

Why: the command line's help texts are the modules' docstrings (one text, read in the source
and in ``fxzero COMMAND --help``), and reST's markup (double backquotes around literals, roles
such as ``:func:``, the ``::`` that introduces an example) is noise in a terminal. Only the
markup goes; line breaks and the indentation of examples stay.
"""

from __future__ import annotations

import re

__all__ = ["plain_text"]

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"(?<![\w`])`([^`\n]+)`(?![\w`])")
_STRONG = re.compile(r"\*\*(\S(?:[^*\n]*\S)?)\*\*")
_EXAMPLE = re.compile(r"(\S)( ?)::$", flags=re.M)


def _role_text(match: re.Match[str]) -> str:
    """``:func:`~fxzero.explain``` -> ``explain``; ``:mod:`text <target>``` -> ``text``."""
    text = match.group(1)
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if titled:
        return titled.group(1)
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def plain_text(text: str | None) -> str | None:
    """``text`` (reST) as plain text: roles and literals by their text, ``**strong**`` unmarked,
    a paragraph's closing ``::`` (what introduces an example) as ``:``."""
    if text is None:
        return None
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EXAMPLE.sub(lambda m: m.group(1) + ("" if m.group(2) else ":"), text)
    return re.sub(r"^[ \t]*::[ \t]*$\n?", "", text, flags=re.M)
