"""The documentation site builds without a warning, and its API page covers ``fxzero.__all__``.

Why in the suite: a docstring of the user API that Sphinx cannot parse, a page missing from the
toctree, a link to a page or heading that does not exist, all fail here, not on a site nobody
rebuilt. The build is the one ``docs/conf.py`` documents (``sphinx-build -W --keep-going -b html``,
the pinned Sphinx and MyST of the ``docs`` and ``test`` extras).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fxzero

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.mark.slow  # builds the whole site: 7 s
def test_the_docs_build_without_warnings(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)]
    build = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"{' '.join(command)}\n{build.stdout}\n{build.stderr}"
    assert build.stderr == "", build.stderr  # -q: only warnings would print
    api = (tmp_path / "api.html").read_text()
    assert 'id="fxzero.DistributedOptimizer.step"' in api  # autodoc ran, not a page of raw directives
    assert 'id="fxzero.lightning.FxzeroStrategy"' in api  # the integrations document without their packages' import


def test_links_to_repository_markdown_outside_the_docs_build_and_broken_ones_still_warn(tmp_path: Path) -> None:
    """What docs/_ext/repo_links.py changes, on a two-file site of its own (no autodoc: ~1 s)."""
    (tmp_path / "outside.md").write_text("# Not a page\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\n"
        "extensions = ['myst_parser', 'repo_links']\nsource_suffix = {'.md': 'markdown'}\n"
    )
    (site / "index.md").write_text("# Links\n\n[results](../outside.md) and [gone](../missing.md)\n")
    command = [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(site), str(tmp_path / "html")]
    build = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    assert [line for line in build.stderr.splitlines() if "WARNING" in line] == [
        f"{site / 'index.md'}:3: WARNING: 'myst' cross-reference target not found: '../missing.md' [myst.xref_missing]"
    ]
    assert list((tmp_path / "html" / "_downloads").glob("*/outside.md"))


def test_the_api_page_documents_every_exported_name() -> None:
    documented = set(re.findall(r"^\.\. auto\w+:: fxzero\.(\w+)", (DOCS / "api.md").read_text(), flags=re.M))
    exported = set(fxzero.__all__) - {"__version__", "mxfp8"}  # the version and the mxfp8 module have their own lines
    assert exported - documented == set(), "document each name of fxzero.__all__ in docs/api.md"


def test_the_test_extra_builds_the_docs_with_the_docs_extras_pins() -> None:
    """CI installs ``.[test]`` only: the build there must use the versions ``.[docs]`` allows, and
    ``constraints.txt`` (what CI installs with) pins each of them, since their versions decide
    which warnings the ``-W`` build fails on."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib  # type: ignore[no-redef]
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["docs"] and set(extras["docs"]) <= set(extras["test"])
    pinned = {Requirement(line).name for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert {Requirement(line).name for line in extras["docs"]} <= pinned


def test_the_api_page_has_an_example_for_every_exported_name() -> None:
    """Each name of ``fxzero.__all__`` is used in a ```python block of docs/api.md (they run:
    ``tests/test_docs.py``), and the backend's options and the command line have sections."""
    text = (DOCS / "api.md").read_text()
    code = "\n".join(re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M))
    missing = [name for name in fxzero.__all__ if name != "__version__" and f"fxzero.{name}" not in code]
    assert missing == [], "give each name an example in docs/api.md"
    assert "## The backend's options" in text and "## The command line" in text
