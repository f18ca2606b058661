"""The summary :func:`fxzero.explain` prints first: the bucket table, each graph's schedule,
the collectives of a step. One screen, lines of at most 120 characters.

Why it is the default: the first questions about a layout ("how many buckets, how much
padding, how large is each rank's shard, does each reduction launch early in backward,
is each gather waited late in forward, what goes over the wire") are answered by a table
and a schedule; the rewritten graph code (``full=True`` / ``--full``) is for the next
question, *why* a node sits where it does. It is deterministic (no addresses, timings or
paths), so tests hold it as golden text.
"""

from __future__ import annotations

import itertools
import textwrap
from typing import TYPE_CHECKING

from . import collectives, layout, schedule

if TYPE_CHECKING:
    from .explained import Explained

__all__ = ["render_summary"]

WIDTH = 120
_ALIGN = ("right", "right", "left", "right", "right", "right", "right", "right", "right", "left")
_HEADERS = ("bucket", "params", "first .. last param", "elements", "padded", "pad %", "shard/rank", "grad bytes", "gather bytes", "graphs")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _span(names: tuple[str, ...]) -> str:
    if not names:
        return "-"
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return span if len(span) <= 36 else span[:35] + "…"


def _conditions(explained: "Explained") -> list[str]:
    size = explained.bucket_size
    dp = explained.optimizer.dp
    head = (
        f"fxzero explain: {explained.model}, world size {dp.size}, bucket size "
        f"{'none (one per dtype)' if size is None else f'{size:,}'}, inner compiler {explained.inner_compiler}, "
        f"overlap_param_gather {'on' if explained.overlap else 'off'}"
    )
    return [*_wrapped("", [head]), *_wrapped("", [collectives.backend_note(dp)])]


def _table(explained: "Explained") -> list[str]:
    facts = layout.bucket_facts(explained)
    elements, padded, pad = layout.totals(facts)
    dtypes = sorted({f"{f.param_dtype} params, {f.grad_dtype} grads" for f in facts})
    mx = " (MXFP8: codes + scales)" if explained.optimizer.config.mxfp8_param_gather else ""
    rows = [
        [f.index, len(f.params), _span(f.params), f.elements, f.padded, f"{f.padding_percent:.1f}", f.shard,
         f.grad_bytes, f.gather_bytes, ", ".join(map(str, f.graphs)) or "eager"]
        for f in facts
    ]  # fmt: skip
    head = (
        f"{_plural(len(facts), 'bucket')}: {elements:,} param elements in {padded:,} buffer elements "
        f"({pad:.1f}% padding), {'; '.join(dtypes)}{mx}"
    )
    return [head, *_columns([list(_HEADERS), *rows])]


def _columns(rows: list[list[object]]) -> list[str]:
    """Rows as aligned columns two spaces apart, a rule under the header (numbers to the right)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADERS))]
    lines = ["  ".join(c.rjust(w) if a == "right" else c.ljust(w) for c, w, a in zip(row, widths, _ALIGN)).rstrip() for row in cells]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def _wrapped(head: str, items: list[str], indent: int = 4) -> list[str]:
    """``head`` and ``items`` joined by commas, in lines of at most :data:`WIDTH` characters."""
    return textwrap.wrap(head + ", ".join(items), WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False)


def _part_lines(part: schedule.PartSchedule, explained: "Explained") -> list[str]:
    dp = explained.optimizer.dp
    head = f"  {part.kind:<9}{part.nodes:>4} nodes: "
    lines = []
    for what, verb in (("wait", f"{collectives.gather_name(dp)} waited for"), ("launch", f"{collectives.reduction_name(dp)} launched for")):
        events = part.of(what)
        if events:
            first, *rest = [f"{e.bucket} at node {e.node} ({e.percent(part.nodes)}%)" for e in events]
            lines += _wrapped((head if not lines else " " * len(head)) + f"{verb} bucket ", [first, *(f"bucket {r}" for r in rest)], len(head))
    return lines or [head + "nothing of fxzero's"]


def _schedule(explained: "Explained") -> list[str]:
    lines = ["schedule: node k/N of each compiled graph; forward graphs run in order, backward graphs in reverse"]
    for graph in schedule.schedules(explained):
        buckets = ", ".join(map(str, graph.buckets)) or "none"
        lines.append(f"graph {graph.id}: {_plural(graph.params, 'param')} of buckets {buckets}")
        for part in graph.parts:
            lines += _part_lines(part, explained)
    if not explained.overlap:
        lines.append("gathers: finished inside step() (overlap_param_gather off: the forward graphs wait for none)")
    spans = schedule.spanning(explained)
    listed = "; ".join(f"{b} (graphs {', '.join(map(str, g))})" for b, g in spans.items())
    lines += _wrapped("buckets read by several graphs: ", [listed or "none"])
    if spans:
        waited = " and is waited by the first forward to run" if explained.overlap else ""
        lines.append(f"  (such a bucket launches where its last grads arrive{waited})")
    for flag in schedule.exposed(explained):
        lines += _wrapped("", [flag.describe(collectives.reduction_name(explained.optimizer.dp))])
    return lines


def collective_lines(explained: "Explained") -> list[str]:
    """fxzero's collectives per step over the data-parallel group, and the model's own in its graphs."""
    opt = explained.optimizer
    dp = opt.dp
    counts = [f"{c} x {op}" for op, c in sorted(opt.collectives_per_step.items())] or ["none"]
    lines = _wrapped("collectives per step, c10d names (as torch.profiler shows them): ", counts)
    group = f"  data-parallel group: ranks {collectives.group_ranks(dp)}"
    if opt.runtime.reduced.mesh_norms is not None:
        group += " (the grad norm's all-reduce runs once more over each other mesh dim)"
    others = collectives.replica_ranks(dp)
    if others is not None:
        group += (f"; instances: {dp.replica_count}, this rank's shard all-reduced over ranks {others} "
                  "(one allreduce per bucket, the only collective leaving the instance)")  # fmt: skip
    lines += _wrapped("", [group])
    model = collectives.model_collectives(explained)
    for (graph, part), found in itertools.groupby(model, key=lambda c: (c.graph, c.part)):
        lines += _wrapped(f"the model's own in graph {graph} {part}: ", [c.describe() for c in found])
    if not model:
        lines.append("the model's own in its graphs: none")
    return lines


def _ownership(explained: "Explained") -> list[str]:
    balance = explained.optimizer.balance
    return [] if balance is None else ["", *_wrapped("", [balance.describe()])]


def render_summary(explained: "Explained") -> str:
    sections = [
        _conditions(explained),
        _table(explained) + _ownership(explained),
        _schedule(explained),
        collective_lines(explained),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"
