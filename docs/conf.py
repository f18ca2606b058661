"""Sphinx configuration of fxzero's documentation site.

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the
``docs`` extra installs the pinned Sphinx and MyST); ``tests/test_docs_build.py`` runs the
same build in the suite, warnings as errors, so a broken page or docstring fails a test.
The pages are Markdown (MyST) that also read well on GitHub; :doc:`api` is generated from
the docstrings of the user API (``fxzero.__all__``).
"""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout's fxzero, not another install of it
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import fxzero  # noqa: E402

project = "fxzero"
author = "fxzero developers"
copyright = "fxzero developers, BSD-3-Clause"
release = version = fxzero.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "repo_links"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# ---- MyST ---------------------------------------------------------------------------
# GitHub-style anchors for headings down to ####, so `[x](checkpointing.md#resuming)` resolves
# as it does on GitHub; a link to a heading that does not exist still warns.
myst_heading_anchors = 4
# Links to files of the repository outside docs/ (`../examples/train_gpt.py`) become download
# links (the file is copied next to the site); `_ext/repo_links.py` does the same for `.md` files
# (`../benchmarks/results/x.md`), which MyST would take for pages. A link to a file, page or
# heading that does not exist still warns (myst.xref_missing): no warning is suppressed.
suppress_warnings: list[str] = []

# ---- autodoc --------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# The integrations subclass classes of optional packages. Mocked, the site builds with the `docs`
# extra alone, and quickly (importing transformers and lightning costs seconds).
autodoc_mock_imports = ["lightning", "transformers"]


class _Unimportable(importlib.abc.MetaPathFinder):
    """Outside autodoc's mock (whose finder goes in front of this one while it imports a
    documented module) the mocked packages cannot be imported: Sphinx looks up a class's
    constructor through its bases' modules (``ClassDocumenter.get_overloaded_signatures``) and
    would import the real transformers and lightning for a mocked base (3 s), where installed.
    The build is then the same with the `docs` extra alone and with the `test` extra."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in autodoc_mock_imports:
            raise ModuleNotFoundError(f"{name} is mocked in the docs build", name=name)


sys.meta_path.insert(0, _Unimportable())

# ---- HTML -----------------------------------------------------------------------------
html_theme = "alabaster"  # Sphinx's own theme: nothing more to pin
html_title = f"fxzero {release}"
html_theme_options = {"description": "ZeRO-1 distributed optimizer as a torch.compile backend", "fixed_sidebar": True}
