"""Where, in each compiled graph, fxzero launches a bucket's gradient reduction and waits
for a bucket's param gather.

Why node positions: overlap is decided by *where* in the graph a launch sits (a launch at
95% of backward overlaps with nothing) and a wait sits (a wait at node 3 of forward
hides nothing of the gather). Positions count every node of the graph fxzero's passes
produced (placeholders and output included), so ``k/N`` reads as "k-th of N".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .explained import Explained
    from .recording import Graph, Recorded

__all__ = ["Event", "GraphSchedule", "PartSchedule", "schedules"]

PARTS = ("forward", "inference", "backward")
"""The AOT graphs of one Dynamo graph, in the order a step runs them (joint is not recorded)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One node fxzero inserted: what it does, for which bucket, where."""

    what: Literal["launch", "wait", "handoff"]
    """``launch``: the bucket's last grads in this graph are in, the reduction may start;
    ``handoff``: earlier grads of the same bucket only added into ``main_grad``;
    ``wait``: the forward blocks until the bucket's param gather has landed."""
    bucket: int
    node: int

    def percent(self, total: int) -> int:
        return round(100 * self.node / total)


@dataclasses.dataclass(frozen=True)
class PartSchedule:
    kind: str
    nodes: int
    events: tuple[Event, ...]
    costs: tuple[tuple[float, int], ...] = ()
    """Each node's ``(FLOPs, bytes)``: the timeline's time axis."""

    def of(self, what: str) -> list[Event]:
        return [e for e in self.events if e.what == what]


@dataclasses.dataclass(frozen=True)
class GraphSchedule:
    id: str
    params: int
    buckets: tuple[int, ...]
    parts: tuple[PartSchedule, ...]


def _part(graph: "Graph", part: "Recorded", explained: "Explained") -> PartSchedule:
    mine = [(n, explained.bucket_of(graph, n)) for n in part.inserted]
    mine = [(n, b) for n, b in mine if b is not None]
    last_launch: dict[int, int] = {b: n.index for n, b in mine if n.launch}  # the last one wins
    events = []
    for node, bucket in mine:
        if not node.launch:
            events.append(Event("wait", bucket, node.index))
        else:
            events.append(Event("launch" if last_launch[bucket] == node.index else "handoff", bucket, node.index))
    return PartSchedule(part.kind, part.total, tuple(events), part.costs)


def schedules(explained: "Explained") -> list[GraphSchedule]:
    """Every compiled graph's launches, hand-offs and waits of this optimizer's buckets."""
    found = []
    for graph in explained.graphs:
        parts = tuple(_part(graph, graph.parts[k], explained) for k in PARTS if k in graph.parts)
        found.append(GraphSchedule(graph.id, len(explained.params_of(graph)), tuple(explained.buckets_of(graph)), parts))
    return found


def spanning(explained: "Explained") -> dict[int, list[str]]:
    """Buckets whose params are read by more than one compiled graph (graph breaks) -> graphs."""
    seen = {b.index: explained.graphs_of_bucket(b.index) for b in explained.optimizer.runtime.buckets}
    return {bucket: graphs for bucket, graphs in seen.items() if len(graphs) > 1}


EXPOSED_FROM = 0.9
"""A launch at or after this fraction of the last backward to run has nothing left to overlap."""
EXPOSED_SHARE = 0.5
"""Flag such a bucket only when it holds more than this share of the param elements: the last
bucket to launch always overlaps little; it matters when it carries much of the traffic."""


@dataclasses.dataclass(frozen=True)
class Exposed:
    """A bucket whose gradient reduction launches where no backward compute is left to hide it."""

    bucket: int
    graph: str
    node: int
    nodes: int
    share: float
    """The bucket's fraction of all param elements."""
    suggested_bucket_size: int

    def describe(self, reduction: str) -> str:
        return (
            f"no overlap: bucket {self.bucket} ({100 * self.share:.0f}% of the param elements) launches its {reduction} "
            f"at node {self.node} of {self.nodes} of graph {self.graph}'s backward, the last backward to run: nothing "
            f"is left to overlap it. Fix: a smaller bucket, e.g. --bucket-size {self.suggested_bucket_size} "
            f"(Config(bucket_size={self.suggested_bucket_size})), so the buckets of the last layers launch while the "
            "first layers' backward still runs"
        )


def _last_backward(explained: "Explained") -> "tuple[str, PartSchedule] | None":
    """Backward graphs run in the reverse of the forwards' order: the first graph's runs last."""
    for planned in schedules(explained):
        for part in planned.parts:
            if part.kind == "backward":
                return planned.id, part
    return None


def exposed(explained: "Explained") -> list[Exposed]:
    """Buckets launched in the last :data:`EXPOSED_FROM` of the last backward, holding at
    more than :data:`EXPOSED_SHARE` of the elements, with a bucket size that would split them in 4."""
    last = _last_backward(explained)
    buckets = explained.optimizer.runtime.buckets
    total = sum(b.param_data.numel() for b in buckets) or 1
    if last is None:
        return []
    graph, part = last
    found = []
    for event in part.of("launch"):
        size = buckets[event.bucket].param_data.numel()
        if event.node >= EXPOSED_FROM * part.nodes and size > EXPOSED_SHARE * total:
            suggested = max(1, size // 4)
            found.append(Exposed(event.bucket, graph, event.node, part.nodes, size / total, suggested))
    return found
