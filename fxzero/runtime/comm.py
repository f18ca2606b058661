"""The process group a runtime talks over, resolved once.

Everything that communicates receives a :class:`DataParallelGroup` explicitly; there is
no module-level registry. World size 1 (including "torch.distributed not initialized")
is a first-class case in which no collective is ever issued.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.distributed as dist

__all__ = ["DataParallelGroup"]


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """A process group with its size, this process's rank and the reduce op to average."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    grad_collective: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    """How a bucket's gradients are averaged into this rank's shard (see :meth:`reduce_grads_async`)."""

    @classmethod
    def resolve(
        cls, group: Optional[dist.ProcessGroup], grad_collective: Literal["auto", "reduce_scatter", "all_reduce"] = "auto"
    ) -> "DataParallelGroup":
        """``group=None`` means the default (world) group, or world size 1 when
        ``torch.distributed`` is not initialized. ``"auto"`` picks ``"all_reduce"`` on gloo,
        whose CPU reduce-scatter is an all-reduce plus a copy (~35% slower, measured),
        and ``"reduce_scatter"`` everywhere else."""
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, 0)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("process_group does not contain this process (rank -1)")
        if grad_collective == "auto":
            grad_collective = "all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter"
        return cls(group, size, rank, grad_collective)

    @property
    def post_scale(self) -> float:
        """Factor this rank's shard still needs after :meth:`reduce_grads_async` (1/dp
        after an all-reduce SUM; 1 after a reduce-scatter AVG)."""
        return 1.0 / self.size if self.grad_collective == "all_reduce" else 1.0

    def reduce_grads_async(self, shard: torch.Tensor, bucket: torch.Tensor) -> Optional[dist.Work]:
        """Reduce ``bucket`` over ranks so that ``shard`` (this rank's view of it) holds the
        result: a reduce-scatter averaging into the shard view, or, where that is slower,
        an in-place all-reduce SUM of the whole bucket (then scaled by :attr:`post_scale`)."""
        if self.grad_collective == "all_reduce":
            return dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return dist.reduce_scatter_single(shard, bucket, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Gather every rank's ``input`` shard into ``output`` (in place when ``input`` is a view of it)."""
        return dist.all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
