"""Gradient producers in, reduce-scatter launches out: the thin layer around the ledger.

Two producers report gradients that reached ``main_grad``:

* **eager** regions, through post-accumulate-grad hooks installed here: autograd has
  summed all of a param's eager contributions when the hook fires;
* **compiled** graphs, through the ``fxzero::grads_ready`` op that the backward pass
  inserts after each group of a bucket's gradients (:mod:`fxzero.passes.bucket_reduce_scatter`,
  :mod:`fxzero.compiled.binding`). Autograd never sees those gradients.

Each report goes to the :class:`~fxzero.optim.gradients.ledger.Ledger`, the one place that decides
when a bucket launches; :class:`GradSync` turns its answers into collectives through
:class:`GradReductions`, and queues an engine callback so that the end of each backward
launches whatever is left. On gloo the reduction is a chunked all-to-all
(:mod:`~fxzero.optim.gradients.grad_exchange`): each gradient hand-off is also a point where it may
move on.

Callbacks are given at construction: ``before_grad_write(bucket)`` (the MXFP8 gather that
reuses the grad buffer lands a bucket before its grad memory is written or reduced),
``after_backward()`` (the optimizer's grad views) and ``reset_if_cleared()``: a gradient
for a bucket that already launched this step is late, unless every gradient of the last
backward was cleared since (``model.zero_grad()``, as DCGAN's loop calls it on D after G's
backward filled D's gradients); then that callback resets the step as ``opt.zero_grad()``
does, before the gradient is written. The check is one comparison per gradient. The per-step path does no slicing and
no allocation: shard views come from the buckets, counters are preallocated.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..._torch_compat import foreach_add_, foreach_mul_, in_backward, queue_end_of_backward
from ..layout.buffers import Bucket
from ..communication.comm import DataParallelGroup
from .grad_exchange import GradExchange
from .ledger import Ledger
from ..layout.mesh import MeshParams

__all__ = ["GradReductions", "GradSync"]

log = logging.getLogger(__name__)


class GradReductions:
    """The reductions of a fixed list of buckets: launched when the ledger says so, waited
    at the step, leaving this rank's shards holding the average over ranks."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        dp: DataParallelGroup,
        ledger: Ledger,
        *,
        described: Sequence[str] = (),
        before_grad_write: Optional[Callable[[int], None]] = None,
        divide_factor: Optional[int] = None,
    ) -> None:
        self.buckets, self.dp, self.ledger = tuple(buckets), dp, ledger
        self._described = tuple(described) or ("",) * len(self.buckets)
        self._before_grad_write = before_grad_write
        self._works: list[Optional[dist.Work]] = [None] * len(self.buckets)
        self._own_shards = [b.grad_shards[dp.rank] for b in self.buckets]
        self.exchange = (
            GradExchange(self.buckets, dp, described=self._described) if dp.grad_collective == "all_to_all" and dp.size > 1 else None
        )
        """The chunked all-to-all reduction (gloo's fastest); ``None`` with the other collectives."""
        # a preallocated 0-dim factor: a Python float would be wrapped into a tensor every step
        device = self.buckets[0].grad_data.device if self.buckets else None
        scale = dp.post_scale / dp.replica_count  # hierarchical: the instances' shards are summed, then averaged
        if divide_factor is not None:  # Config.gradient_divide_factor: the mean over that many ranks instead
            scale *= dp.total / divide_factor
        self._post_scale = torch.tensor(scale, device=device) if scale != 1.0 else None

    def launch(self, indices: range) -> None:
        """Launch the reductions of buckets ``indices`` (the ledger's answer), in order."""
        for index in indices:
            if self._before_grad_write is not None:
                self._before_grad_write(index)
            if self.exchange is not None:
                self.exchange.launch(index)
            elif self.dp.size > 1:
                bucket = self.buckets[index]
                self._works[index] = self.dp.reduce_grads_async(bucket.grad_shards[self.dp.rank], bucket.grad_data)
            log.debug("launched reduce-scatter of bucket %d", index)

    def progress(self) -> None:
        """A gradient hand-off: the chunked exchange may move on."""
        if self.exchange is not None:
            self.exchange.progress()

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
        if self.exchange is not None:
            self.exchange.complete_all()
        for index, work in enumerate(self._works):
            if work is not None:
                self.dp.wait(work, "gradient reduction", index, self._described[index])
                self._works[index] = None

    def pending_works(self) -> list[Any]:
        """The reductions' collectives in flight (what exit waits for, :func:`~fxzero.optim.communication.comm.settle`)."""
        exchanged = self.exchange.pending_works() if self.exchange is not None else []
        return [w for w in self._works if w is not None] + exchanged

    @property
    def in_flight(self) -> bool:
        return any(w is not None for w in self._works)

    def collectives_per_step(self) -> dict[str, int]:
        """The reductions one step issues, by ``c10d`` op name (as ``torch.profiler`` names them)."""
        counts = self._in_instance()
        if self.dp.replica_count > 1:  # hierarchical: one all-reduce per bucket over the instances
            counts["allreduce"] = counts.get("allreduce", 0) + len(self.buckets)
        return counts

    def _in_instance(self) -> dict[str, int]:
        if self.dp.size == 1:
            return {}
        if self.exchange is not None:
            return {"alltoall": sum(map(len, self.exchange.chunks)) * (self.dp.size - 1)}
        return {"allreduce" if self.dp.grad_collective == "all_reduce" else "reduce_scatter": len(self.buckets)}


class GradSync:
    """Where gradients are reported: eager hooks, compiled hand-offs, the end of backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        ledger: Ledger,
        reductions: GradReductions,
        *,
        before_grad_write: Optional[Callable[[int], None]] = None,
        after_backward: Optional[Callable[[], None]] = None,
        reset_if_cleared: Optional[Callable[[int], bool]] = None,
        local_grads: frozenset[int] = frozenset(),
    ) -> None:
        self.params, self.ledger, self.reductions = tuple(params), ledger, reductions
        self._local_grads = local_grads
        """Slots of DTensor params: their gradient's local tensor goes into ``main_grad`` (:mod:`~fxzero.optim.layout.mesh`)."""
        self._before_grad_write, self._after_backward = before_grad_write, after_backward
        self._reset_if_cleared = reset_if_cleared
        self._callback_queued = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # ---- eager path -------------------------------------------------------------
    def install_hooks(self) -> None:
        """Move each autograd gradient into ``main_grad`` as soon as it is accumulated.
        A frozen param (``requires_grad=False``) gets its hook too: torch refuses to register
        one on it, so it is unfrozen for the registration only. The hook lives on the param,
        so once the user unfreezes it (gradual unfreezing), its gradients are reduced over
        ranks like every other's (``tests/test_frozen_params.py``)."""
        for slot, param in enumerate(self.params):
            frozen = not param.requires_grad
            if frozen:
                param.requires_grad_(True)
            try:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(slot)))
            finally:
                if frozen:
                    param.requires_grad_(False)

    def _make_hook(self, slot: int) -> Callable[[torch.nn.Parameter], None]:
        bucket = self.ledger.bucket(slot)
        local = MeshParams.local_grad if slot in self._local_grads else None

        def hook(param: torch.nn.Parameter) -> None:
            grad = param.grad
            if grad is None:  # a compiled graph returned None: its op reported it
                return
            if self.ledger.has_launched(bucket):
                self._late(bucket, slot)
            if self._before_grad_write is not None:
                self._before_grad_write(bucket)
            param.main_grad.add_(grad if local is None else local(param, grad))
            param.grad = None
            self._launch(self.ledger.eager_grad(slot))

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---- compiled path ----------------------------------------------------------
    def add_compiled(
        self, bucket: int, main_grads: list[torch.Tensor], grads: Sequence[torch.Tensor], slots: torch.Tensor, span: Optional[slice]
    ) -> None:
        """Add a compiled backward's ``grads`` of params ``slots`` (all in ``bucket``;
        ``span`` when they are consecutive) into their ``main_grads`` and report them."""
        if self.ledger.has_launched(bucket):
            self._late(bucket, int(slots[0]))
        if self._before_grad_write is not None:
            self._before_grad_write(bucket)
        foreach_add_(main_grads, grads)
        self._launch(self.ledger.compiled_grads(bucket, len(main_grads), slots, span))

    def _late(self, bucket: int, slot: int) -> None:
        """A gradient for a launched bucket: the step starts over if the last backward's
        gradients were all cleared since (``model.zero_grad()``); else :class:`LateGradient`."""
        if self._reset_if_cleared is None or not self._reset_if_cleared(slot):
            self.ledger.check_open(bucket, slot)

    # ---- launches ---------------------------------------------------------------
    def _launch(self, ready: Optional[range]) -> None:
        if ready is None:  # not a counted contribution, or under no_sync
            return
        self.reductions.progress()
        # Outside a backward (an op run by hand, a test) there is no engine to call us
        # back: step() launches what is left instead.
        if not self._callback_queued and in_backward():
            queue_end_of_backward(self._end_of_backward)
            self._callback_queued = True
        if ready:
            self.reductions.launch(ready)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.reductions.launch(self.ledger.end_of_backward())
        if self._after_backward is not None:
            self._after_backward()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients into ``main_grad`` without launching any reduce-scatter."""
        return self.ledger.no_sync()
