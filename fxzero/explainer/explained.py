"""What one :func:`fxzero.explain` found, as data: the optimizer, the recorded graphs, the
names of the params, and the conditions it ran under.

Why one object: the summary, the full text, the JSON file and the timeline picture all
read the same facts; each renderer takes an :class:`Explained` and nothing else, so the
four outputs cannot disagree.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ..dump import InsertedNode
    from .node_costs import Speed
    from .recording import Graph

__all__ = ["Explained"]


@dataclasses.dataclass(frozen=True)
class Explained:
    """Everything :func:`explain` reports (the renderers read only this)."""

    optimizer: Any
    graphs: list["Graph"]
    names: dict[int, str]
    """``id(param)`` -> module path, as ``model.named_parameters()`` spells it."""
    model: str = "model"
    """The model's class name (the picture's title, the JSON's conditions)."""
    inner_compiler: str = "inductor"
    speed: Optional["Speed"] = None
    """The machine's FLOP/s and bandwidth, when a picture or JSON gives estimated times."""

    def bucket_of(self, graph: "Graph", node: "InsertedNode") -> Optional[int]:
        """The bucket behind a node inserted in ``graph``, if it belongs to this optimizer."""
        return node.bucket if graph.dumper.managers[node.manager_index] is self.optimizer else None

    def params_of(self, graph: "Graph") -> list[tuple[str, str, int]]:
        """``(forward placeholder, module path, bucket)`` of this optimizer's params in ``graph``."""
        forward = graph.parts.get("forward")
        if forward is None:
            return []
        managers = graph.dumper.managers
        found = []
        for m in sorted(graph.dumper.managed, key=lambda m: m.position):
            if managers[m.manager_index] is self.optimizer and m.position < len(forward.placeholders):
                param = graph.dumper.param(m.position)
                found.append((forward.placeholders[m.position], self.names.get(id(param), "?"), m.bucket))
        return found

    def buckets_of(self, graph: "Graph") -> list[int]:
        """Buckets of this optimizer with a param read by ``graph``."""
        return sorted({bucket for _, _, bucket in self.params_of(graph)})

    def graphs_of_bucket(self, bucket: int) -> list[str]:
        """Ids of the graphs that read a param of ``bucket``."""
        return [g.id for g in self.graphs if bucket in self.buckets_of(g)]

    def name(self, param: Any) -> str:
        return self.names.get(id(param), "?")

    @property
    def bucket_size(self) -> Optional[int]:
        """The bucket size in elements the layout used (``None``: one bucket per dtype group)."""
        dp = self.optimizer.dp
        return self.optimizer.config.resolved_bucket_size(dp.size, dp.backend)

    @property
    def overlap(self) -> bool:
        """``Config.overlap_param_gather``: whether the forward graphs wait for gathers."""
        return bool(self.optimizer.runtime.param_sync.overlap)
