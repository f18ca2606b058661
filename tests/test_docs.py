"""The docs pages are claims, so each kind of claim has a check here.

* Every ```python block in ``docs/*.md`` runs at world size 1, the blocks of one page in order in
  one namespace (a page may build a model once and use it in later blocks). A block whose first
  line is ``# requires: <what>`` (``torchrun``, ``ranks``: several processes) is only compiled:
  it must at least be valid Python.
* Each figure quoted in a paragraph that links a results file under ``benchmarks/results/``
  appears in one of the files that paragraph links, so a figure cannot drift from its source.
* Each message a ``troubleshooting.md`` heading quotes still occurs in fxzero's source, so the
  page cannot list messages fxzero no longer raises.
* Every relative link of a page points at a file that exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
REQUIRES = re.compile(r"#\s*requires:")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_LINK = re.compile(r"\]\(((?:\.\./)+benchmarks/results/[^)#\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
# a figure: a decimal (1.008, 3.64e-03, 0.2578x) or a whole number with a unit (874 MiB, 15 s)
DECIMAL = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?)")
WITH_UNIT = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)\s?(?:MiB|ms|µs|us|s|%)(?![\w])")


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, outside fenced code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def figures(paragraph: str) -> set[str]:
    prose = CODE_SPAN.sub(" ", LINK.sub("]", paragraph))
    return set(DECIMAL.findall(prose)) | set(WITH_UNIT.findall(prose))


def occurs(figure: str, text: str) -> bool:
    return re.search(rf"(?<![\d]){re.escape(figure)}(?![\d])", text) is not None


def test_the_docs_have_pages_with_code():
    assert len(PAGES) >= 11, [p.name for p in PAGES]
    assert sum(len(python_blocks(p)) for p in PAGES) >= 10


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_of_a_page_runs(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files (checkpoints) write here
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    torch.compiler.reset()
    try:
        for index, block in enumerate(python_blocks(page)):
            code = compile(block, f"{page.name}[block {index}]", "exec")
            first = block.lstrip().splitlines()[0] if block.strip() else ""
            if REQUIRES.match(first):
                continue  # needs several processes: compiled above, not run
            exec(code, namespace)
    finally:
        torch.compiler.reset()


def test_figures_next_to_a_results_link_are_in_the_linked_file():
    checked, missing = 0, []
    for page in PAGES:
        for paragraph in paragraphs(page.read_text()):
            links = RESULTS_LINK.findall(paragraph)
            if not links:
                continue
            sources = [(page.parent / link).resolve() for link in links]
            for source in sources:
                assert source.is_file(), f"{page.name} links {source}, which does not exist"
            text = "\n".join(source.read_text() for source in sources if source.suffix != ".png")  # a picture quotes nothing
            for figure in sorted(figures(paragraph)):
                checked += 1
                if not occurs(figure, text):
                    missing.append(f"{page.name}: {figure} not in {', '.join(s.name for s in sources)}")
    assert checked >= 40, checked
    assert not missing, "\n".join(missing)


def test_the_figure_check_finds_a_figure_that_drifted():
    assert figures("took 1.008x, [x](../benchmarks/results/a.md) 874 MiB, `2.13.0` and 15 s") == {"1.008", "874", "15"}
    assert occurs("874", "peak 874.1 MiB") and not occurs("874", "peak 1874 MiB") and not occurs("1.03", "1.031")


def source_messages() -> list[str]:
    """Every string literal of fxzero's source, an f-string's replacement fields as ``…``."""
    out = []
    for path in (ROOT / "fxzero").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values))
    return out


def quoted_messages() -> list[str]:
    """The message of each ``### `...` `` heading of troubleshooting.md, and each further message
    its ``Also ...`` line quotes."""
    text = (DOCS / "troubleshooting.md").read_text()
    found = re.findall(r"^### `(.+)`$", text, re.M)
    for also in re.findall(r"^Also (.+?)(?:\.|\*\*)(?:\s|$)", text, re.M | re.S):
        found.extend(re.findall(r"`([^`]+)`", also))
    return found


def in_source(message: str, literals: list[str]) -> bool:
    pattern = ".*?".join(re.escape(part) for part in message.split("…"))
    return any(re.search(pattern, literal, re.S) for literal in literals)


def test_every_message_troubleshooting_lists_is_still_raised():
    literals, messages = source_messages(), quoted_messages()
    assert len(messages) >= 150, len(messages)
    gone = [m for m in messages if not in_source(m, literals)]
    assert not gone, gone
    assert not in_source("fxzero: a message … never raised", literals)


def test_the_troubleshooting_page_covers_every_raise_of_fxzero():
    """Each ``raise X("...")`` / ``warnings.warn("...")`` with a message of its own text has an
    entry: one of the page's quoted messages occurs in it."""
    messages = quoted_messages()
    uncovered = []
    for path in sorted((ROOT / "fxzero").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.exc if isinstance(node, ast.Raise) else node
            if not isinstance(call, ast.Call) or not call.args:
                continue
            if isinstance(node, ast.Call) and not (isinstance(call.func, ast.Attribute) and call.func.attr == "warn"):
                continue
            literal = call.args[0]
            if isinstance(literal, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "…" for v in literal.values)
            elif isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                text = literal.value
            else:
                continue  # a message built elsewhere: its literal is covered where it is written
            if text.strip("…") and not any(in_source(m, [text]) for m in messages):
                uncovered.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:80]}")
    assert not uncovered, "\n".join(uncovered)


def test_relative_links_point_at_files():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
