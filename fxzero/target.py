"""TARGET: the ``file.py[:function]`` / ``package.module[:function]`` convention of the
command line (``python -m fxzero explain|parity TARGET``).

Why a module of its own: both commands load TARGETs with the same rules and errors, and
``fxzero parity``'s rank processes load the very same TARGET again to re-create the
user's model (a model class defined in a file run as a TARGET cannot be imported by
name in another process, so the rank is sent the TARGET, not the model).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["TargetError", "load_target", "resolve_target"]


class TargetError(ValueError):
    """TARGET cannot be loaded or returned something the command cannot use."""


def _import_file(path: Path) -> Any:
    if path.is_dir():
        raise TargetError(
            f"TARGET {str(path)!r} is a directory; TARGET must be a Python file (path/to/file.py[:function]) "
            "or an importable module (package.module[:function])"
        )
    if not path.is_file():
        raise TargetError(f"TARGET file {str(path)!r} does not exist")
    sys.path.insert(0, str(path.resolve().parent))  # so the file's own imports resolve
    name = f"_fxzero_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"TARGET file {str(path)!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            raise TargetError(f"TARGET module {name!r} not found (give a .py path or an importable module)") from error
        raise


def _split(target: str) -> tuple[str, str, bool]:
    location, _, function = target.partition(":")
    is_file = location.endswith(".py") or "/" in location or "\\" in location
    return location, function, is_file


def resolve_target(target: str) -> str:
    """``target`` with a file path made absolute, so another process (started elsewhere,
    or after a ``chdir``) loads the same file."""
    location, function, is_file = _split(target)
    if not is_file:
        return target
    return f"{Path(location).resolve()}:{function}" if function else str(Path(location).resolve())


def load_target(target: str, default_function: str, returns: str) -> Callable[[], Any]:
    """The factory function that ``target`` names (``default_function`` when it names
    none); ``returns`` describes what the function must return, for the error text."""
    location, function, is_file = _split(target)
    function = function or default_function
    module = _import_file(Path(location)) if is_file else _import_module(location)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise TargetError(
            f"TARGET {target!r}: {location} has no function {function!r}; "
            f"define {function}() returning {returns} or name one as {location}:FUNCTION"
        )
    return factory
