"""``docs/design.md``'s map of the package ("Where things are") names every module.

The map is how a newcomer finds the room a concept lives in, so a module it leaves out is
one nobody finds; the check reads the map, not the code's own list, and fails naming the
modules missing from it (``__init__``/``__main__`` are their folder's and the package's door).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"


def map_entries(text: str) -> dict[str, str]:
    """The map's code block as {folder or top-level module: the words written on its lines}.
    An entry starts at a line's first column (``fxzero/optim/layout/  validation, layout, ...``,
    or ``fxzero/explainer/, parity_check/  ...`` for two folders); indented lines continue it."""
    block = text.split("## Where things are", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    keys: list[str] = []
    for line in block.splitlines():
        if line.startswith("fxzero/"):
            head, _, words = line.partition("  ")
            keys = [k if k.startswith("fxzero/") else f"fxzero/{k}" for k in re.split(r",\s*", head.strip())]
            for key in keys:
                entries[key] = entries.get(key, "") + " " + words
        elif line.startswith(" ") and keys:
            for key in keys:
                entries[key] += " " + line
    return entries


def missing_modules(entries: dict[str, str], modules: list[str]) -> list[str]:
    """Modules (``fxzero/a/b.py``) whose name the map does not give: a top-level module as its
    own entry or by file name anywhere, a module in a folder by name in that folder's entry."""
    everything = " ".join([*entries, *entries.values()])
    missing = []
    for module in modules:
        folder, name = module.rsplit("/", 1)
        stem = name.removesuffix(".py")
        if folder == "fxzero":
            found = module in entries or re.search(rf"\b{re.escape(name)}\b", everything) is not None
        else:
            found = re.search(rf"\b{re.escape(stem)}\b", entries.get(folder + "/", "")) is not None
        if not found:
            missing.append(module)
    return missing


def package_modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "fxzero").rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts
    )


def test_the_design_map_names_every_module() -> None:
    modules = package_modules()
    assert len(modules) >= 90  # the package's modules, found from the files (100 on 2026-11-28)
    assert missing_modules(map_entries(DESIGN.read_text()), modules) == []


def test_the_map_check_finds_a_module_left_out() -> None:
    text = "## Where things are\n\n```\nfxzero/rooms/   alpha (the first), beta\n                gamma\nfxzero/top.py   one\n```\n"
    modules = ["fxzero/rooms/alpha.py", "fxzero/rooms/gamma.py", "fxzero/rooms/delta.py", "fxzero/top.py", "fxzero/other.py"]
    assert missing_modules(map_entries(text), modules) == ["fxzero/rooms/delta.py", "fxzero/other.py"]
