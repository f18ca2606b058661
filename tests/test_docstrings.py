"""Every public name of ``fxzero.__all__`` documents its call in Google style (rendered by
Sphinx's napoleon, docs/conf.py): ``Args:`` naming each parameter, ``Returns:`` when it returns
something, ``Raises:`` listing every exception its own body raises, and no exception that is not
an exception class. Dataclasses (``Config``, ``ParityReport``, ``StepResult``) document each field
under it, so their ``Args:`` points there; exception classes take their message only."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import re
import textwrap
from typing import Any, Callable

import pytest

import fxzero

SECTIONS = ("Args:", "Returns:", "Raises:", "Example::")


def _public() -> list[tuple[str, Any]]:
    found = []
    for name in fxzero.__all__:
        obj = getattr(fxzero, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException) and "__init__" not in vars(obj):
            continue  # an exception class: its one argument is the message
        found.append((name, obj))
    return found


def _sections(doc: str) -> dict[str, str]:
    """Each section's body, keyed by its heading line."""
    found: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        if line in SECTIONS:
            current = line
            found[current] = ""
        elif current is not None:
            if line and not line.startswith(" "):
                current = None
            else:
                found[current] += line + "\n"
    return found


def _own_raises(fn: Callable[..., Any]) -> set[str]:
    """Exception names raised by ``fn``'s own body (``raise X(...)``, not re-raises)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, (ast.Name, ast.Attribute)) and ast.unparse(exc)[:1].isupper():
                names.add(ast.unparse(exc).rsplit(".", 1)[-1])
    return names


def _listed(section: str) -> list[str]:
    return [m.rsplit(".", 1)[-1] for m in re.findall(r"^    ([\w.]+):", section, re.M)]


def _exception_class(name: str) -> bool:
    import fxzero.explainer.timeline
    import fxzero.model_output
    import fxzero.parity_check.plan
    import fxzero.testing

    places = (builtins, fxzero, fxzero.testing, fxzero.model_output, fxzero.parity_check.plan, fxzero.explainer.timeline)
    return any(isinstance(getattr(p, name, None), type) and issubclass(getattr(p, name), BaseException) for p in places)


def _call_parts(obj: Any) -> tuple[inspect.Signature, list[Callable[..., Any]], bool]:
    """The signature users call, the functions whose raises the docstring owes, whether it returns."""
    if inspect.isclass(obj):
        own = ("__post_init__",) if dataclasses.is_dataclass(obj) else ("__init__",)  # a dataclass's __init__ is generated
        bodies = [vars(obj)[n] for n in own if n in vars(obj)]
        return inspect.signature(obj), bodies, False
    returns = inspect.signature(obj).return_annotation not in ("None", None, inspect.Signature.empty)
    return inspect.signature(obj), [obj], returns


@pytest.mark.parametrize(("name", "obj"), _public(), ids=[n for n, _ in _public()])
def test_public_docstring_has_args_returns_and_raises(name: str, obj: Any) -> None:
    doc = inspect.getdoc(obj) or ""
    sections = _sections(doc)
    signature, bodies, returns = _call_parts(obj)
    if signature.parameters:
        assert "Args:" in sections, f"{name}: no Args: section"
        if not dataclasses.is_dataclass(obj):  # a dataclass's fields are documented under each
            documented = set(_listed(sections["Args:"].replace("*", "")))
            missing = [p for p in signature.parameters if p not in documented]
            assert not missing, f"{name}: Args: does not name {missing}"
    if returns:
        assert "Returns:" in sections and sections["Returns:"].strip(), f"{name}: no Returns: section"
    raised = set().union(*(_own_raises(b) for b in bodies))
    listed = _listed(sections.get("Raises:", ""))
    assert raised <= set(listed), f"{name}: raises {sorted(raised - set(listed))} without a Raises: entry"
    assert all(map(_exception_class, listed)), f"{name}: Raises: lists {listed}, not all exception classes"


def test_the_check_finds_a_missing_section() -> None:
    def documented(a: int) -> int:
        """Doc.

        Args:
            a: a number.

        Returns:
            It.
        """
        if a < 0:
            raise ValueError("a < 0")
        return a

    assert _sections(documented.__doc__) == {"Args:": "    a: a number.\n\n", "Returns:": "    It.\n"}
    assert _own_raises(documented) == {"ValueError"} and _listed(_sections(documented.__doc__)["Args:"]) == ["a"]
