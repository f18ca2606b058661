"""Gradient readiness tracking and bucketed reduce-scatter launches.

One :class:`GradSync` per optimizer is the single place that knows which managed
params have their gradient in ``main_grad`` for the current step. The eager path
(post-accumulate-grad hooks, installed here) and the compiled path (the backward-graph
pass's custom ops) both report through :meth:`GradSync.grad_ready`, so a bucket whose
params are spread over several graphs and eager regions still launches exactly once.

Launch rules:

* a bucket launches when all of its params are ready **and** every lower-indexed
  bucket has launched: collectives are issued in bucket order on every rank, whatever
  order data-dependent control flow produced the gradients in;
* at the end of each backward (an autograd-engine callback) every bucket not yet
  launched is launched, so a param that got no gradient never blocks a bucket;
* under :meth:`no_sync` gradients accumulate into ``main_grad`` and nothing launches.

The per-step path does no slicing and no allocation: shard views come from the
:class:`~fxzero.runtime.buffers.Bucket` objects, counters are preallocated.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .buffers import Bucket
from .comm import DataParallelGroup

__all__ = ["GradSync"]

log = logging.getLogger(__name__)


class GradSync:
    """Readiness counters and reduce-scatter handles for a fixed list of buckets."""

    def __init__(self, buckets: Sequence[Bucket], params: Sequence[torch.nn.Parameter], dp: DataParallelGroup) -> None:
        self.buckets = tuple(buckets)
        self.dp = dp
        self.params = tuple(params)
        slot_of = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_of_slot = [0] * len(self.params)
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of_slot[slot_of[id(p)]] = bucket.index
        self._params_per_bucket = [len(b.params) for b in self.buckets]
        self._pending = list(self._params_per_bucket)
        self._launched = [False] * len(self.buckets)
        self._works: list[Optional[dist.Work]] = [None] * len(self.buckets)
        self._next = 0
        self._zeros = bytes(len(self.params))
        self._seen = bytearray(len(self.params))
        self.presence = bytearray(len(self.params))
        """``presence[slot]`` is 1 once param ``slot`` got any gradient since the last step."""
        self._accumulating = False
        self._callback_queued = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # ---- eager path -------------------------------------------------------------
    def install_hooks(self) -> None:
        """Move each autograd gradient into ``main_grad`` as soon as it is accumulated."""
        for slot, param in enumerate(self.params):
            self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(slot)))

    def _make_hook(self, slot: int):
        def hook(param: torch.nn.Parameter) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None
            self.grad_ready(slot)

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---- readiness --------------------------------------------------------------
    def grad_ready(self, slot: int) -> None:
        """Record that param ``slot``'s gradient for this backward is in ``main_grad``."""
        self.presence[slot] = 1
        if self._accumulating:
            return
        bucket = self.bucket_of_slot[slot]
        if self._launched[bucket]:
            raise RuntimeError(self._late_grad_message(slot, bucket))
        if self._seen[slot]:
            return
        self._seen[slot] = 1
        self._queue_end_of_backward()
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._launch_ready_prefix()

    def _late_grad_message(self, slot: int, bucket: int) -> str:
        shape = tuple(self.params[slot].shape)
        return (
            f"fxzero: param {slot} (shape {shape}) received a gradient after bucket {bucket} "
            "was already reduce-scattered in this step. Run every backward but the last "
            "inside `optimizer.no_sync()`, or call `optimizer.step()`/`zero_grad()` between backwards."
        )

    def _queue_end_of_backward(self) -> None:
        # Outside a backward (a compiled graph's op run by hand, a test) there is no
        # engine to call us back: step() launches what is left instead.
        if self._callback_queued or torch._C._current_graph_task_id() == -1:
            return
        Variable._execution_engine.queue_callback(self._end_of_backward)
        self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.launch_all()

    def _launch_ready_prefix(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)

    def launch_all(self) -> None:
        """Launch every bucket not launched yet, in bucket order."""
        while self._next < len(self.buckets):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        self._launched[index] = True
        self._next = index + 1
        if self.dp.size > 1:
            bucket = self.buckets[index]
            self._works[index] = self.dp.reduce_scatter_async(bucket.grad_shards[self.dp.rank], bucket.grad_data)
        log.debug("launched reduce-scatter of bucket %d", index)

    # ---- step boundary ----------------------------------------------------------
    def finish(self) -> None:
        """Launch what is left and wait for every reduce-scatter of this step."""
        self.launch_all()
        self.finish_launched()

    def finish_launched(self) -> None:
        """Wait for the reduce-scatters already launched; launch nothing."""
        for index, work in enumerate(self._works):
            if work is not None:
                work.wait()
                self._works[index] = None

    def reset(self) -> None:
        """Start a new step: nothing ready, nothing launched, no gradient seen."""
        self._pending[:] = self._params_per_bucket
        for index in range(len(self._launched)):
            self._launched[index] = False
        self._next = 0
        self._seen[:] = self._zeros
        self.presence[:] = self._zeros

    @property
    def in_flight(self) -> bool:
        return any(work is not None for work in self._works)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients into ``main_grad`` without launching any reduce-scatter."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous
