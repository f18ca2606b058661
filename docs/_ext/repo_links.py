"""Links from a docs page to a Markdown file of the repository outside docs/.

Why: the pages read on GitHub as well as on the site, so they link repository files by their
relative paths (``[results](../benchmarks/results/model_suite-2026-11-27.md)``). MyST turns a
link to an existing file that is not a page into a download link (the file is copied next to the
site), except for a ``.md`` file: that suffix makes it a page, and since it is outside the source
directory, the link fails as "Unknown source document" (myst.xref_missing). This transform gives
such a link, where the file exists, the download link any other repository file gets. Nothing is
suppressed: a link to a file that does not exist still warns, as does any other broken link.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform


class RepoMarkdownLinks(SphinxTransform):
    default_priority = 500  # after parsing; before the download collector reads the doctree

    def apply(self, **kwargs: Any) -> None:
        srcdir = Path(self.env.srcdir).resolve()
        page_dir = Path(self.env.doc2path(self.env.docname)).resolve().parent
        for node in list(self.document.findall(addnodes.pending_xref)):
            target = self._outside_file(node, srcdir)
            if target is not None:
                node.replace_self(self._download(node, os.path.relpath(target, page_dir)))

    def _outside_file(self, node: addnodes.pending_xref, srcdir: Path) -> Path | None:
        """The existing ``.md`` file outside the docs a MyST link names, else None."""
        if node.get("refdomain") != "doc" or node.get("reftype") != "myst":
            return None
        docname = node.get("reftarget", "")
        if not os.path.isabs(docname):  # inside the source directory: a page, resolved as usual
            return None
        for suffix in self.config.source_suffix:
            path = Path(docname + suffix).resolve()
            if path.is_file() and srcdir not in path.parents:
                return path
        return None

    @staticmethod
    def _download(node: addnodes.pending_xref, relative: str) -> nodes.Element:
        link = addnodes.download_reference(
            refdomain=None, reftype="myst", reftarget=relative, refdoc=node.get("refdoc"), refexplicit=node.get("refexplicit")
        )
        link.source, link.line = node.source, node.line
        link += node.children
        return link


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_transform(RepoMarkdownLinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
