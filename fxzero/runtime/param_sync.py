"""Param all-gathers after the step, waited right before each bucket's first use.

After :meth:`DistributedOptimizer.step` updates this rank's shards, every bucket's
``param_data`` must be all-gathered before the model reads it again. With
``Config.overlap_param_gather`` the step launches only the first two gathers in
forward order; the next forward waits for each bucket immediately before its first
read and makes sure the following one is in flight (the prefetch chain, as
Megatron-LM's forward pre-hooks do, kept one bucket ahead from the start so that a
small first bucket, such as the embeddings, does not leave the second one late):

* compiled graphs call ``fxzero::wait_params`` (inserted by
  :mod:`fxzero.passes.param_gather_wait`) before the first node that reads the bucket;
* eager regions wait in forward pre-hooks of the modules that own managed params;
* anything else (``state_dict()``, direct reads) calls :meth:`ParamSync.finish`.

**Order.** Buckets are laid out in reverse registration order, so the forward reads
them in *descending* index order. Launches always follow that fixed order: waiting
for a bucket first launches every earlier one not launched yet, then one more (the
prefetch). The sequence of collectives is therefore the same on every rank whatever
order the model happens to read buckets in.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .buffers import Bucket
from .comm import DataParallelGroup

__all__ = ["ParamSync", "install_param_waits"]

log = logging.getLogger(__name__)


class ParamSync:
    """All-gather state of a fixed list of buckets for one step."""

    def __init__(self, buckets: Sequence[Bucket], dp: DataParallelGroup, *, overlap: bool) -> None:
        self.buckets = tuple(buckets)
        self.dp = dp
        self.overlap = overlap
        n = len(self.buckets)
        self.order = tuple(reversed(range(n)))
        """Forward (first-use) order: descending bucket index."""
        self._position = [0] * n
        for position, index in enumerate(self.order):
            self._position[index] = position
        self._works: list[Optional[dist.Work]] = [None] * n
        self._stale = [False] * n  # gathered values not yet waited for this step
        self._next_launch = n  # position in self.order of the next gather to launch

    def start(self) -> None:
        """The step updated every shard: gather them (prefetch the first two, or all and wait)."""
        if self.dp.size == 1:
            return
        for index in range(len(self.buckets)):
            self._stale[index] = True
        self._next_launch = 0
        # Under torch.profiler the gathers finish inside the step: a profiler that stops
        # while gloo work started under it is in flight crashed the next wait (torch 2.13).
        if self.overlap and not torch._C._autograd._profiler_enabled():
            self._launch_through(1)
        else:
            self.finish()

    def _launch_through(self, position: int) -> None:
        """Launch, in forward order, every gather up to ``position`` not launched yet."""
        while self._next_launch <= min(position, len(self.order) - 1):
            self._launch_next()

    def _launch_next(self) -> None:
        index = self.order[self._next_launch]
        self._next_launch += 1
        bucket = self.buckets[index]
        self._works[index] = self.dp.all_gather_async(bucket.param_data, bucket.param_shards[self.dp.rank])
        log.debug("launched all-gather of bucket %d", index)

    def wait(self, index: int) -> None:
        """Bucket ``index`` is about to be read: make it current, prefetch the next."""
        if not self._stale[index]:
            return
        # this bucket, and the next one (the prefetch, overlapping the compute that reads this one)
        self._launch_through(self._position[index] + 1)
        work = self._works[index]
        if work is not None:
            self.dp.wait(work, "param all-gather", index, self.buckets[index].params)
            self._works[index] = None
        self._stale[index] = False

    def wait_many(self, indices: Sequence[int]) -> None:
        for index in indices:
            self.wait(index)

    def finish(self) -> None:
        """Make every bucket current (launching what is left, in order)."""
        for index in self.order:
            self.wait(index)

    @property
    def pending(self) -> tuple[bool, ...]:
        """Which buckets still hold values older than the last step."""
        return tuple(self._stale)


def _wait_before_forward(sync: ParamSync, indices: tuple[int, ...], module: torch.nn.Module, args: Any) -> None:
    # Inside a compiled region Dynamo traces this as a no-op: the graph's own
    # fxzero::wait_params ops order the reads there.
    if not torch.compiler.is_compiling():
        sync.wait_many(indices)


def install_param_waits(module: torch.nn.Module, buckets: Sequence[Bucket], sync: ParamSync) -> list[Any]:
    """Forward pre-hooks on every submodule that owns managed params (waiting for their
    buckets) and a ``state_dict`` pre-hook on ``module``; returns the hook handles."""
    bucket_of = {id(p): b.index for b in buckets for p in b.params}
    handles = []
    for sub in module.modules():
        owned = {bucket_of[id(p)] for p in sub._parameters.values() if p is not None and id(p) in bucket_of}
        if owned:
            hook = functools.partial(_wait_before_forward, sync, tuple(sorted(owned, reverse=True)))
            handles.append(sub.register_forward_pre_hook(hook))
    handles.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: sync.finish()))
    return handles
