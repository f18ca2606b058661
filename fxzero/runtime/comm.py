"""The process group a runtime talks over, resolved once.

Everything that communicates receives a :class:`DataParallelGroup` explicitly; there is
no module-level registry. World size 1 (including "torch.distributed not initialized")
is a first-class case in which no collective is ever issued.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["DataParallelGroup"]


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """A process group with its size, this process's rank and the reduce op to average."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    average_op: Optional[dist.ReduceOp]
    """Reduce op the reduce-scatter uses to average over ranks; ``None`` at world size 1."""

    @classmethod
    def resolve(cls, group: Optional[dist.ProcessGroup]) -> "DataParallelGroup":
        """``group=None`` means the default (world) group, or world size 1 when
        ``torch.distributed`` is not initialized."""
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, 0, None)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("process_group does not contain this process (rank -1)")
        return cls(group, size, rank, dist.ReduceOp.AVG if size > 1 else None)

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Average ``input`` over ranks into ``output`` (this rank's shard view of it)."""
        return dist.reduce_scatter_single(output, input, op=self.average_op, group=self.group, async_op=True)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Gather every rank's ``input`` shard into ``output`` (in place when ``input`` is a view of it)."""
        return dist.all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
