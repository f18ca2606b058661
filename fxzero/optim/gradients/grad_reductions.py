"""The step's gradient reductions: launched when the ledger says so, finished once per step.

What every transport shares lives here, once: launching buckets in the ledger's order, landing
an MXFP8 gather that reuses a bucket's grad memory before that memory is reduced, the sum over
instances (hierarchical sharding) and the final scale. The collective itself is a
:class:`~fxzero.optim.gradients.reduction.Reduction` (reduce-scatter, all-reduce, the chunked
all-to-all), picked by :func:`~fxzero.runtime.build_runtime`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from ..._torch_compat import foreach_mul_
from ..communication.comm import DataParallelGroup
from ..layout.buffers import Bucket
from ..params.param_sync import ParamSync
from .ledger import Ledger
from .reduction import Reduction
from .stale_grads import StaleGrads

__all__ = ["GradReductions"]

log = logging.getLogger(__name__)


class GradReductions:
    """The reductions of a fixed list of buckets: launched when the ledger says so, waited
    at the step, leaving this rank's shards holding the average over ranks."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        dp: DataParallelGroup,
        ledger: Ledger,
        reduction: Reduction,
        *,
        described: Sequence[str] = (),
        landing: Optional[ParamSync] = None,
        divide_factor: Optional[int] = None,
        stale: Optional[StaleGrads] = None,
    ) -> None:
        """``landing``: the gathers to land a bucket of before its grad memory is reduced (MXFP8
        gathers that reuse the grad buffer), ``None`` where gathers never touch it."""
        self.buckets, self.dp, self.ledger, self.reduction = tuple(buckets), dp, ledger, reduction
        self._described = tuple(described) or ("",) * len(self.buckets)
        self.landing = landing
        self.stale = stale
        """Zeroes a bucket's regions left from the last step before its reduction reads them (:mod:`.stale_grads`)."""
        self._own_shards = [b.grad_shards[dp.rank] for b in self.buckets]
        # a preallocated 0-dim factor: a Python float would be wrapped into a tensor every step
        device = self.buckets[0].grad_data.device if self.buckets else None
        scale = reduction.post_scale / dp.replica_count  # hierarchical: the instances' shards are summed, then averaged
        if divide_factor is not None:  # Config.gradient_divide_factor: the mean over that many ranks instead
            scale *= dp.total / divide_factor
        self._post_scale = torch.tensor(scale, device=device) if scale != 1.0 else None

    def launch(self, indices: range) -> None:
        """Launch the reductions of buckets ``indices`` (the ledger's answer), in order."""
        for index in indices:
            if self.landing is not None:
                self.landing.wait(index)
            if self.stale is not None:
                self.stale.zero_left(index)
            self.reduction.launch(index)
            log.debug("launched reduce-scatter of bucket %d", index)

    def progress(self) -> None:
        """A gradient hand-off: a transport that moves in steps may move on."""
        self.reduction.progress()

    def finish(self) -> None:
        """Launch what is left, wait for every reduction of this step, and average."""
        self.launch(self.ledger.rest())
        self.finish_launched()
        if self.dp.replica_count > 1:  # hierarchical: the shard reduced in this instance, summed over the instances
            for index, work in enumerate(self.dp.sum_replicas_async(self._own_shards)):
                self.dp.wait(work, "all-reduce over the instances", index, self._described[index])
        if self._post_scale is not None:
            foreach_mul_(self._own_shards, self._post_scale)

    def finish_launched(self) -> None:
        """Finish the reductions already launched; launch no other."""
        self.reduction.finish_launched()

    def pending_works(self) -> list[Any]:
        """The reductions' collectives in flight (what exit waits for, :func:`~fxzero.optim.communication.comm.settle`)."""
        return self.reduction.pending_works()

    @property
    def in_flight(self) -> bool:
        return bool(self.reduction.pending_works())

    def collectives_per_step(self) -> dict[str, int]:
        """The reductions one step issues, by ``c10d`` op name (as ``torch.profiler`` names them)."""
        counts = dict(self.reduction.collectives_per_step())
        if self.dp.replica_count > 1:  # hierarchical: one all-reduce per bucket over the instances
            counts["allreduce"] = counts.get("allreduce", 0) + len(self.buckets)
        return counts
