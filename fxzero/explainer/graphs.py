"""The long form of :func:`fxzero.explain` (``full=True`` / ``--full``): every compiled graph's
code after fxzero's passes, with fxzero's nodes marked and named by bucket and params named
by module path, and (whole-param ownership) which rank owns each param.

Why a separate module: the summary answers *what* the layout and schedule are; this
answers *why* a node sits where it does (which op produced the grads a launch waits
for, which op first reads a gathered param). It is deterministic, like the summary.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from ..optim.layout.mesh import local_of
from .collectives import MODEL_COLLECTIVE, describe_group, gather_name, reduction_name
from .schedule import PARTS

if TYPE_CHECKING:
    from ..dump import InsertedNode
    from .explained import Explained
    from .recording import Graph, Recorded

__all__ = ["render_graphs"]

_FREES = re.compile(r";  (?:\w+ = )+None$")
_SUBGRAPH_FETCH = re.compile(r"^\s*(\w+) = self\.\1$")


def render_graphs(explained: "Explained") -> str:
    """The ownership table (whole-param ownership only) and every graph's marked code."""
    sections = [_ownership_table(explained.optimizer)] if explained.optimizer.balance is not None else []
    sections += [_graph_text(g, explained) for g in explained.graphs]
    return "\n\n".join(sections) + "\n"


def _ownership_table(optimizer: Any) -> str:
    """Under whole-param ownership: which rank owns (holds the state of, updates) each param."""
    rows = sorted(
        ([row.owner, row.label, row.bucket, local_of(row.param).numel()] for row in optimizer.param_table.rows),
        key=lambda r: (r[0], r[2]),
    )
    return "whole-param ownership, by param\n" + tabulate(rows, headers=["rank", "param", "bucket", "elements"], tablefmt="github")


# ---- the graphs ---------------------------------------------------------------------
def _early_handoffs(graph: "Graph", part: "Recorded", explained: "Explained") -> dict[str, int]:
    """Hand-offs of a backward that are not their bucket's last in it (name -> ordinal):
    they only add gradients into ``main_grad``; the last one launches the bucket."""
    by_bucket: dict[Any, list[str]] = {}
    for node in part.inserted:
        if node.launch:
            by_bucket.setdefault(explained.bucket_of(graph, node), []).append(node.name)
    return {name: k for names in by_bucket.values() for k, name in enumerate(names[:-1])}


def _node_label(node: "InsertedNode", bucket: Any, early: dict[str, int]) -> str:
    if node.name in early:
        return f"grads_bucket{bucket}_{early[node.name]}"
    return f"{'launch' if node.launch else 'wait'}_bucket{bucket}"


def _renames(graph: "Graph", part: "Recorded", explained: "Explained", early: dict[str, int]) -> dict[str, str]:
    """Graph identifiers shown under another name: params by module path, fxzero's
    nodes by what they do and for which bucket."""
    renames = {placeholder: path for placeholder, path, _ in explained.params_of(graph)}
    for node in part.inserted:
        renames[node.name] = _node_label(node, explained.bucket_of(graph, node), early)
    return renames


def _mark(node: "InsertedNode", bucket: Any, early: dict[str, int], dp: Any) -> str:
    if node.name in early:
        return f"  # <- fxzero: add these grads of bucket {bucket} into main_grad (they die here)"
    if node.launch:
        return f"  # <- fxzero: launch bucket {bucket}'s {reduction_name(dp)} (its grads from this graph are in)"
    return f"  # <- fxzero: wait for bucket {bucket}'s {gather_name(dp)} (and launch the next)"


def _marked_code(graph: "Graph", part: "Recorded", explained: "Explained") -> list[str]:
    early = _early_handoffs(graph, part, explained)
    renames = _renames(graph, part, explained, early)
    pattern = (
        re.compile(r"\b(" + "|".join(sorted(map(re.escape, renames), key=len, reverse=True)) + r")\b")
        if renames
        else None
    )
    marks = {f"{node.name} = torch.ops.fxzero": node for node in part.inserted}
    out = []
    for line in part.code.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or _SUBGRAPH_FETCH.match(line):
            continue
        line = _FREES.sub("", line)
        node = next((n for key, n in marks.items() if stripped.startswith(key)), None)
        if pattern is not None:
            line = pattern.sub(lambda m: renames[m.group(1)], line)
        if node is not None:
            line += _mark(node, explained.bucket_of(graph, node), early, explained.optimizer.dp)
        elif (found := MODEL_COLLECTIVE.search(stripped)) is not None:
            line += f"  # <- the model's own {found.group(1)} over {describe_group(found.group(2))}"
        out.append(line)
    return out


def _graph_text(graph: "Graph", explained: "Explained") -> str:
    params = explained.params_of(graph)
    buckets = ", ".join(map(str, explained.buckets_of(graph))) or "none"
    lines = [f"== graph {graph.id}: {len(params)} params of buckets {buckets} =="]
    lines += [f"# {placeholder} = {path} (bucket {bucket})" for placeholder, path, bucket in params]
    for kind in PARTS:
        part = graph.parts.get(kind)
        if part is not None:
            lines.append(f"-- graph {graph.id} {kind}, after fxzero's passes ({part.total} nodes; frees omitted) --")
            lines += _marked_code(graph, part, explained)
    return "\n".join(lines)
