"""The reduction protocol: how one bucket's gradients reach this rank's shard, averaged over ranks.

A :class:`Reduction` is the transport of a bucket's gradient reduction, as
:class:`~fxzero.optim.params.param_sync.Gather` is the transport of its param gather: the
ledger-driven launching, the landing of MXFP8 gathers that reuse the grad buffer, the sum over
instances and the final scale live once, in :class:`~fxzero.optim.gradients.grad_reductions.GradReductions`,
and a transport only launches, moves on, finishes and counts its collectives. Why a protocol:
a new transport (a quantized reduce-scatter, one through symmetric memory) is one class here and
one line in :func:`~fxzero.runtime.build_runtime`, which picks the transport as it picks the gather,
instead of a branch in every module that launches, waits or counts (FSDP2's
``_fsdp_collectives.py`` keeps one class per transport the same way).

The transports:

* :class:`ReduceScatter`: NCCL's reduce-scatter, averaging into this rank's shard view (no scratch);
* :class:`AllReduce`: an in-place all-reduce SUM of the whole bucket (the shard then scaled by 1/dp);
* :class:`~fxzero.optim.gradients.grad_exchange.GradExchange`: gloo's chunked all-to-all (sums in rank order);
* :class:`NoReduction`: world size 1 (nothing to reduce, nothing issued).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch.distributed as dist

from ..communication.comm import DataParallelGroup
from ..layout.buffers import Bucket
from .grad_exchange import GradExchange

__all__ = ["AllReduce", "NoReduction", "ReduceScatter", "Reduction", "reduction_for"]


class Reduction(Protocol):
    """How one bucket's gradients are reduced over the ranks of the group into this rank's shard view."""

    post_scale: float
    """The factor this rank's shard still needs after the collective (1 after an averaging one)."""
    nbytes: int
    """Bytes of the transport's own scratch."""

    def launch(self, index: int) -> None:
        """Bucket ``index``'s gradients are all in: start its reduction."""

    def progress(self) -> None:
        """A gradient hand-off in backward: a transport that moves in steps may move on."""

    def finish_launched(self) -> None:
        """Wait for every reduction launched so far (idempotent)."""

    def pending_works(self) -> list[Any]:
        """The collectives in flight (what exit waits for)."""

    def collectives_per_step(self) -> dict[str, int]:
        """The collectives one step issues, by ``c10d`` op name."""


class _PerBucket:
    """One asynchronous collective per bucket, waited for by name on failure."""

    post_scale = 1.0
    nbytes = 0
    op_name = ""

    def __init__(self, buckets: Sequence[Bucket], dp: DataParallelGroup, described: Sequence[str]) -> None:
        self.buckets, self.dp = tuple(buckets), dp
        self._described = tuple(described) or ("",) * len(self.buckets)
        self._works: list[Optional[dist.Work]] = [None] * len(self.buckets)

    def launch(self, index: int) -> None:
        self._works[index] = self._start(self.buckets[index])

    def _start(self, bucket: Bucket) -> dist.Work:
        raise NotImplementedError

    def progress(self) -> None:
        pass

    def finish_launched(self) -> None:
        for index, work in enumerate(self._works):
            if work is not None:
                self.dp.wait(work, "gradient reduction", index, self._described[index])
                self._works[index] = None

    def pending_works(self) -> list[Any]:
        return [w for w in self._works if w is not None]

    def collectives_per_step(self) -> dict[str, int]:
        return {self.op_name: len(self.buckets)}


class ReduceScatter(_PerBucket):
    """A reduce-scatter averaging the bucket into this rank's shard view (in place, no scratch)."""

    op_name = "reduce_scatter"

    def _start(self, bucket: Bucket) -> dist.Work:
        shard = bucket.grad_shards[self.dp.rank]
        return dist.reduce_scatter_single(shard, bucket.grad_data, op=dist.ReduceOp.AVG, group=self.dp.group, async_op=True)


class AllReduce(_PerBucket):
    """An in-place all-reduce SUM of the whole bucket; the shard is then scaled by 1/dp."""

    op_name = "allreduce"

    def __init__(self, buckets: Sequence[Bucket], dp: DataParallelGroup, described: Sequence[str]) -> None:
        super().__init__(buckets, dp, described)
        self.post_scale = 1.0 / dp.size

    def _start(self, bucket: Bucket) -> dist.Work:
        return dist.all_reduce(bucket.grad_data, op=dist.ReduceOp.SUM, group=self.dp.group, async_op=True)


class NoReduction:
    """World size 1: each rank's shard is the whole bucket and already the average."""

    post_scale = 1.0
    nbytes = 0

    def launch(self, index: int) -> None:
        pass

    def progress(self) -> None:
        pass

    def finish_launched(self) -> None:
        pass

    def pending_works(self) -> list[Any]:
        return []

    def collectives_per_step(self) -> dict[str, int]:
        return {}


def reduction_for(buckets: Sequence[Bucket], dp: DataParallelGroup, described: Sequence[str]) -> Reduction:
    """The transport ``dp.grad_collective`` names (``Config.grad_collective``, resolved per backend)."""
    if dp.size == 1:
        return NoReduction()
    if dp.grad_collective == "all_to_all":
        return GradExchange(buckets, dp, described=described)
    if dp.grad_collective == "all_reduce":
        return AllReduce(buckets, dp, described)
    return ReduceScatter(buckets, dp, described)
