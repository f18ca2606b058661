"""Gradient readiness tracking and bucketed reduce-scatter launches.

One :class:`GradSync` per optimizer is the single place that knows which gradients of
the current step are in ``main_grad``. Two producers report to it:

* **eager** regions, through post-accumulate-grad hooks installed here: autograd has
  summed all of a param's eager contributions when the hook fires, so it counts once;
* **compiled** graphs, through the ``fxzero::grads_ready`` op that the backward pass
  inserts after each group of a bucket's gradients in that graph (its *hand-offs*,
  :mod:`fxzero.passes.bucket_reduce_scatter`; :mod:`fxzero.ops`).
  Autograd never sees those gradients (the graph returns ``None`` for them), so the
  count is kept here: each run of a compiled forward adds the number of gradients its
  backward will deliver per bucket (:meth:`forward_ran`), and each op subtracts them;
  a forward whose backward does not run is taken out again at the first gradient of
  the next backward (:mod:`~fxzero.optim.pending_forwards`).

A bucket is ready when its count of outstanding contributions reaches zero. It
launches when it is ready **and** every lower-indexed bucket has launched, so
collectives are issued in bucket order on every rank whatever order data-dependent
control flow produced the gradients in. At the end of each backward (an engine
callback) every bucket not yet launched is launched, so a param that got no gradient
never blocks. Under :meth:`no_sync` gradients accumulate and nothing launches.
``written`` says whether any gradient reached the buffers since they were last
zeroed, so zeroing twice (by ``step()``, which consumes the gradients, and by the
loop's ``zero_grad()``) costs once.

A param read both by a compiled graph and eagerly ("mixed", e.g. a tied embedding
across a graph break) is discovered when its eager hook fires; its eager contribution
is expected from then on. The first step after any new graph is compiled is a
*learning* step that launches only at the end of backward, so such discoveries never
come after their bucket was launched.

On gloo the reduction is a chunked all-to-all (:mod:`~fxzero.optim.grad_exchange`):
each gradient hand-off is also a point where it may move on.

The per-step path does no slicing and no allocation: shard views come from the
:class:`~fxzero.optim.buffers.Bucket` objects, counters are preallocated.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .._torch_compat import foreach_mul_, in_backward, queue_end_of_backward
from .buffers import Bucket
from .comm import DataParallelGroup
from .grad_exchange import GradExchange
from .pending_forwards import PendingForwards

__all__ = ["GradSync"]

log = logging.getLogger(__name__)


class GradSync:
    """Readiness counters and reduce-scatter handles for a fixed list of buckets."""

    def __init__(self, buckets: Sequence[Bucket], params: Sequence[torch.nn.Parameter], dp: DataParallelGroup) -> None:
        self.buckets = tuple(buckets)
        self.dp = dp
        self.params = tuple(params)
        self.slot_of = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_of_slot = [0] * len(self.params)
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of_slot[self.slot_of[id(p)]] = bucket.index
        n = len(self.params)
        self._compiled = bytearray(n)  # slot is read by some compiled graph
        self._mixed = bytearray(n)  # ... and also gets eager gradients
        self._baseline = [len(b.params) for b in self.buckets]  # eager contributions expected
        self._pending = list(self._baseline)
        self._launched = [False] * len(self.buckets)
        self._works: list[Optional[dist.Work]] = [None] * len(self.buckets)
        self._next = 0
        self._zeros = bytes(n)
        self._seen = bytearray(n)
        self.presence = bytearray(n)
        """``presence[slot]`` is 1 once param ``slot`` got any gradient since the last step."""
        self.presence_tensor = torch.frombuffer(self.presence, dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        self._own_shards = [b.grad_shards[dp.rank] for b in self.buckets]
        self.exchange = GradExchange(self.buckets, dp) if dp.grad_collective == "all_to_all" and dp.size > 1 else None
        """The chunked all-to-all reduction (gloo's fastest); ``None`` with the other collectives."""
        # a preallocated 0-dim factor: a Python float would be wrapped into a tensor every step
        device = self.buckets[0].grad_data.device if self.buckets else None
        self._post_scale = torch.tensor(dp.post_scale, device=device) if dp.post_scale != 1.0 else None
        self.learning = False
        self.before_grad_write: Optional[Callable[[int], None]] = None
        """Called with a bucket index before its grad memory is written or reduced (the
        MXFP8 gather that reuses the grad buffer lands the bucket there)."""
        self.after_backward: Optional[Callable[[], None]] = None
        """Called at the end of every backward that ran outside :meth:`no_sync`."""
        self.written = False
        """A gradient reached ``main_grad`` since the buffers were last zeroed."""
        self._forwards = PendingForwards()
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
            if param.grad is None:  # a compiled graph returned None: its op reported it
                return
            if self.before_grad_write is not None:
                self.before_grad_write(self.bucket_of_slot[slot])
            param.main_grad.add_(param.grad)
            param.grad = None
            self.grad_ready(slot)

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def grad_ready(self, slot: int) -> None:
        """Param ``slot``'s eager gradient for this backward is in ``main_grad``."""
        self.presence[slot] = 1
        self.written = True
        self._forwards.settle(self._pending)
        if self._accumulating:
            return
        bucket = self.bucket_of_slot[slot]
        if self._launched[bucket]:
            raise RuntimeError(self._late_grad_message(slot, bucket))
        if self._compiled[slot] and not self._mixed[slot]:
            self._discover_mixed(slot)
            return  # not counted this step: the count did not expect it
        if self._seen[slot]:
            return
        self._seen[slot] = 1
        self._contribute(bucket, 1)

    def _discover_mixed(self, slot: int) -> None:
        log.info("param %d is read by a compiled graph and eagerly; expecting both from now on", slot)
        self._mixed[slot] = 1
        self._baseline[self.bucket_of_slot[slot]] += 1

    # ---- compiled path ----------------------------------------------------------
    def register_compiled(self, slots: Iterable[int]) -> None:
        """A newly compiled graph reads ``slots``: their gradients arrive through
        ``fxzero::grads_ready``, not hooks. The next step is a learning step."""
        for slot in slots:
            if not self._compiled[slot]:
                self._compiled[slot] = 1
                self._baseline[self.bucket_of_slot[slot]] -= 1
                self._pending[self.bucket_of_slot[slot]] -= 1
        self.learning = True

    def forward_ran(self, bucket_counts: Sequence[tuple[int, int]], node: object) -> None:
        """A compiled forward ran; its backward (starting at autograd ``node``) will deliver
        ``count`` grads per bucket. Counted under ``no_sync`` too: the matching backward
        subtracts them whichever context it runs in."""
        self._forwards.add(node, bucket_counts, self._pending)

    def compiled_grads_ready(self, bucket: int, count: int, slots: torch.Tensor) -> None:
        """``count`` gradients of ``bucket`` (params ``slots``) were added to ``main_grad``."""
        self.presence_tensor.index_fill_(0, slots, 1)
        self.written = True
        self._forwards.settle(self._pending)
        if self._launched[bucket]:
            raise RuntimeError(self._late_grad_message(int(slots[0]), bucket))
        self._contribute(bucket, count)

    # ---- readiness and launches -------------------------------------------------
    def _contribute(self, bucket: int, count: int) -> None:
        self._pending[bucket] -= count
        if self._accumulating:
            return
        if self.exchange is not None:  # a gradient hand-off: a point where the exchange may move on
            self.exchange.progress()
        self._queue_end_of_backward()
        if self._pending[bucket] <= 0 and not self.learning:
            self._launch_ready_prefix()

    def _late_grad_message(self, slot: int, bucket: int) -> str:
        shape = tuple(self.params[slot].shape)
        return (
            f"fxzero: param {slot} (shape {shape}) received a gradient after bucket {bucket} "
            "was already reduce-scattered in this step. Run every backward but the last "
            "inside `optimizer.no_sync()`, or call `optimizer.step()`/`zero_grad()` between backwards."
        )

    def _queue_end_of_backward(self) -> None:
        # Outside a backward (an op run by hand, a test) there is no engine to call us
        # back: step() launches what is left instead.
        if self._callback_queued or not in_backward():
            return
        queue_end_of_backward(self._end_of_backward)
        self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.learning = False  # the counts were learned (not at reset: zero_grad may sit between forward and backward)
        self.launch_all()
        if self.after_backward is not None:
            self.after_backward()

    def _launch_ready_prefix(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] <= 0:
            self._launch(self._next)

    def launch_all(self) -> None:
        """Launch every bucket not launched yet, in bucket order."""
        while self._next < len(self.buckets):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        if self.before_grad_write is not None:
            self.before_grad_write(index)
        self._launched[index] = True
        self._next = index + 1
        if self.exchange is not None:
            self.exchange.launch(index)
        elif self.dp.size > 1:
            bucket = self.buckets[index]
            self._works[index] = self.dp.reduce_grads_async(bucket.grad_shards[self.dp.rank], bucket.grad_data)
        log.debug("launched reduce-scatter of bucket %d", index)

    # ---- step boundary ----------------------------------------------------------
    def finish(self) -> None:
        """Launch what is left, wait for every reduction of this step, and leave this
        rank's shards holding the average over ranks."""
        self.launch_all()
        self.finish_launched()
        if self._post_scale is not None:
            foreach_mul_(self._own_shards, self._post_scale)

    def finish_launched(self) -> None:
        """Finish the reductions of the buckets already launched; launch no other."""
        if self.exchange is not None:
            self.exchange.complete_all()
        for index in range(len(self._works)):
            self._complete(index)

    def _complete(self, index: int) -> None:
        """Wait for bucket ``index``'s reduction if it is in flight."""
        work = self._works[index]
        if work is None:
            return
        self.dp.wait(work, "gradient reduction", index, self.buckets[index].params)
        self._works[index] = None

    def reset(self) -> None:
        """Start a new step: nothing ready, nothing launched, no gradient seen. Forwards
        whose backward has not run yet stay expected."""
        self._pending[:] = self._baseline
        self._forwards.recount(self._pending)
        for index in range(len(self._launched)):
            self._launched[index] = False
        self._next = 0
        self._seen[:] = self._zeros
        self.presence[:] = self._zeros

    def collectives_per_step(self) -> dict[str, int]:
        """The reductions one step issues, by ``c10d`` op name (as ``torch.profiler`` names them)."""
        if self.dp.size == 1:
            return {}
        if self.exchange is not None:
            return {"alltoall": sum(map(len, self.exchange.chunks)) * (self.dp.size - 1)}
        return {"allreduce" if self.dp.grad_collective == "all_reduce" else "reduce_scatter": len(self.buckets)}

    @property
    def launched(self) -> tuple[bool, ...]:
        return tuple(self._launched)

    @property
    def compiled(self) -> bytearray:
        """``compiled[slot]`` is 1 once a compiled graph's backward hands param ``slot``'s
        gradient to fxzero directly (its tensor hooks do not run there)."""
        return self._compiled

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients into ``main_grad`` without launching any reduce-scatter."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous
