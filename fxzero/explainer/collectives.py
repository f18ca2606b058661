"""The collectives one training step issues, named as the process group issues them.

Why this matters: fxzero picks its collectives per backend. On NCCL (and every backend
but gloo) a bucket's gradients are reduce-scattered and its params all-gathered; on gloo
the reduction is a chunked all-to-all and the gather one broadcast per rank (gloo's
reduce-scatter and all-gather cost a setup or a scratch copy per call). A reader
profiling a gloo run sees ``c10d::alltoall_base_`` and ``c10d::broadcast_``, so explain
says those names, the ones ``torch.profiler`` shows without the ``c10d::`` prefix and
trailing ``_``/``_base``. Under the ``"fake"`` group of ``fxzero explain --world-size``
nothing is sent, and fxzero makes NCCL's choices: the output says so.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed

from .._torch_compat import group_ranks_by_name

if TYPE_CHECKING:
    from .explained import Explained
    from .recording import Recorded

__all__ = ["ModelCollective", "backend_note", "gather_name", "model_collectives", "reduction_name"]

_REDUCTIONS = {"reduce_scatter": "reduce_scatter", "all_reduce": "allreduce", "all_to_all": "alltoall"}
"""``DataParallelGroup.grad_collective`` -> the c10d op a step issues for it."""

MODEL_COLLECTIVE = re.compile(r"= torch\.ops\._c10d_functional\.(\w+)\.default\(.*'([^']+)'\)")
"""A functional collective the model's code put in the graph (DTensor's tensor-parallel
redistributions): op name and the group name, its last argument. Its ``wait_tensor`` is no
collective of its own."""


def reduction_name(dp: Any) -> str:
    """The c10d collective that reduces a bucket's gradients on this group (``"reduction"``
    at world size 1, where none is issued)."""
    return _REDUCTIONS[dp.grad_collective] if dp.size > 1 else "reduction"


def gather_name(dp: Any) -> str:
    """The c10d collective that gathers a bucket's params on this group (gloo: one
    broadcast per rank, each from its own shard; ``"gather"`` at world size 1)."""
    if dp.size == 1:
        return "gather"
    return "broadcast" if dp.gather_by_broadcast else "allgather"


def backend(dp: Any) -> str:
    """The group's backend name (``"none"`` without a process group)."""
    return dp.backend or "none"


def assumed_backend(dp: Any) -> Optional[str]:
    """The backend whose collectives the names stand for: the group's own, except under
    the fake group (``--world-size``), where fxzero makes NCCL's choices."""
    if dp.size == 1:
        return None
    return "nccl" if dp.backend == "fake" else backend(dp)


def backend_note(dp: Any) -> str:
    """One line: which process group, and which backend the collective names assume."""
    if dp.size == 1:
        return "process group: none or world size 1 (no collective is issued)"
    if dp.backend == "fake":
        return (
            f"process group: fake, {dp.size} ranks (--world-size; nothing is sent). Names and default bucket size "
            "are NCCL's; on gloo, fxzero reduces with alltoall and gathers with a broadcast per rank"
        )
    how = f"reduces each bucket with {reduction_name(dp)}" + (" (in chunks)" if dp.grad_collective == "all_to_all" else "")
    how += f", gathers it with {'one broadcast per rank' if dp.gather_by_broadcast else gather_name(dp)}"
    return f"process group: {dp.backend}, {dp.size} ranks; fxzero {how}"


def group_ranks(dp: Any) -> list[int]:
    """Global ranks of the data-parallel group (``None`` in the optimizer: the world)."""
    if dp.group is not None:
        return list(torch.distributed.get_process_group_ranks(dp.group))
    return list(range(dp.size))


def replica_ranks(dp: Any) -> Optional[list[int]]:
    """Hierarchical sharding: the ranks this rank's shard is all-reduced over (None: one instance)."""
    if dp.replica_count == 1:
        return None
    return list(torch.distributed.get_process_group_ranks(dp.replicas))


@dataclasses.dataclass(frozen=True)
class ModelCollective:
    """A collective the model's own code put in a compiled graph (tensor parallel's)."""

    graph: str
    """The graph's id (:mod:`fxzero.compiled.graph_id`)."""
    part: str
    op: str
    """The functional op's name in the graph (``all_gather_into_tensor``, ...)."""
    group: str
    ranks: Optional[list[int]]
    count: int

    def describe(self) -> str:
        where = f"group {self.group} (ranks {self.ranks})" if self.ranks is not None else f"group {self.group}"
        return f"{self.count} x {self.op} over {where}"


def _in_part(graph: str, part: "Recorded") -> list[ModelCollective]:
    counts: dict[tuple[str, str], int] = {}
    for line in part.code.splitlines():
        found = MODEL_COLLECTIVE.search(line.strip())
        if found is not None:
            op, group = found.groups()
            counts[(op, group)] = counts.get((op, group), 0) + 1
    return [ModelCollective(graph, part.kind, op, g, group_ranks_by_name(g), c) for (op, g), c in sorted(counts.items())]


def model_collectives(explained: "Explained") -> list[ModelCollective]:
    """The model's own collectives in every recorded graph, counted by op and group."""
    return [c for graph in explained.graphs for part in graph.parts.values() for c in _in_part(graph.id, part)]


def describe_group(name: str) -> str:
    ranks = group_ranks_by_name(name)
    return f"group {name} (ranks {ranks})" if ranks is not None else f"group {name}"
