"""The process group a runtime talks over, resolved once.

Everything that communicates receives a :class:`DataParallelGroup` explicitly; there is
no module-level registry. World size 1 (including "torch.distributed not initialized")
is a first-class case in which no collective is ever issued.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "DataParallelGroup", "describe_params"]


class CollectiveError(RuntimeError):
    """A collective fxzero was waiting for failed or timed out: a peer rank died or
    stopped answering. The message names the collective, the bucket and this rank; the
    process group cannot be used afterwards, so the job should exit (and restart from its
    last checkpoint)."""


def describe_params(params: Sequence[torch.Tensor], limit: int = 4) -> str:
    """``a.weight, b.bias, … (12 params, 1,050,112 elements)``: names where the optimizer
    was given a module (``_fxzero_name``), shapes otherwise."""
    labels = [getattr(p, "_fxzero_name", None) or f"shape {tuple(p.shape)}" for p in params]
    shown = ", ".join(labels[:limit]) + (", …" if len(labels) > limit else "")
    return f"{shown} ({len(labels)} params, {sum(p.numel() for p in params):,} elements)"


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """A process group with its size, this process's rank and the reduce op to average."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    grad_collective: Literal["reduce_scatter", "all_reduce", "all_to_all"] = "reduce_scatter"
    """How a bucket's gradients are averaged into this rank's shard (see :meth:`reduce_grads_async`)."""

    @classmethod
    def resolve(
        cls,
        group: Optional[dist.ProcessGroup],
        grad_collective: Literal["auto", "reduce_scatter", "all_reduce", "all_to_all"] = "auto",
    ) -> "DataParallelGroup":
        """``group=None`` means the default (world) group, or world size 1 when
        ``torch.distributed`` is not initialized. ``"auto"`` picks ``"all_to_all"`` on
        gloo (whose reduce-scatter sets up a halving-doubling algorithm on every call; the
        README's "Gradients" paragraph has the measurements) and ``"reduce_scatter"``
        everywhere else."""
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, 0)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("process_group does not contain this process (rank -1)")
        if grad_collective == "auto":
            grad_collective = "all_to_all" if dist.get_backend(group) == "gloo" else "reduce_scatter"
        return cls(group, size, rank, grad_collective)

    @property
    def post_scale(self) -> float:
        """Factor this rank's shard still needs after its reduction (1/dp after an
        all-reduce SUM or the sum of an all-to-all's chunks; 1 after a reduce-scatter AVG)."""
        return 1.0 if self.grad_collective == "reduce_scatter" else 1.0 / self.size

    def reduce_grads_async(
        self, shard: torch.Tensor, bucket: torch.Tensor, received: Optional[torch.Tensor] = None
    ) -> Optional[dist.Work]:
        """Start reducing ``bucket`` over ranks into ``shard`` (this rank's view of it):
        a reduce-scatter averaging into the shard view; or, where that is slower, an
        in-place all-reduce SUM of the whole bucket, or an all-to-all that sends rank r
        its shard of ``bucket`` and receives every rank's copy of ``shard`` into the
        rows of ``received`` (the caller sums them with :meth:`sum_received`). The last
        two leave the shard to be scaled by :attr:`post_scale`."""
        if self.grad_collective == "all_reduce":
            return dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if self.grad_collective == "all_to_all":
            if received is None:
                raise ValueError("reduce_grads_async: grad_collective 'all_to_all' needs a `received` buffer")
            return dist.all_to_all_single(received, bucket, group=self.group, async_op=True)
        return dist.reduce_scatter_single(shard, bucket, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    @staticmethod
    def sum_received(shard: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
        """After an all-to-all: ``shard`` = the sum of the received ``rows``, in rank order
        (every run sums the same way), without allocating. The loop is over ranks."""
        torch.add(rows[0], rows[1], out=shard)
        for row in rows[2:]:
            shard.add_(row)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Gather every rank's ``input`` shard into ``output`` (in place when ``input`` is a view of it)."""
        return dist.all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str = "all-reduce of the grad norm and gradient flags") -> None:
        if self.size > 1:
            self.wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), what)

    def all_reduce_max(self, tensor: torch.Tensor, what: str = "all-reduce of the gradient max-norms") -> None:
        if self.size > 1:
            self.wait(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what)

    def wait(self, work: dist.Work, what: str, bucket: Optional[int] = None, params: Sequence[torch.Tensor] = ()) -> None:
        """``work.wait()``, turning a failure (a dead peer's closed connection, or the
        process group's timeout for one that stopped answering) into a
        :class:`CollectiveError` that says what this rank was waiting for. Only the error
        path builds the message: this runs for every bucket of every step."""
        try:
            work.wait()
        except RuntimeError as err:  # DistBackendError and gloo's timeouts are RuntimeErrors
            where = f" of bucket {bucket}" if bucket is not None else ""
            where += f" (params: {describe_params(params)})" if params else ""
            raise CollectiveError(
                f"fxzero: rank {self.rank} of {self.size} failed waiting for the {what}{where}: {err}. "
                "A peer rank probably died or stopped answering; this process group cannot be used any more."
            ) from err
