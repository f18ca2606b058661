"""Test doubles for fxzero's collectives."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fxzero.optim.communication.comm import DataParallelGroup


class DeferredGather:
    """An all-gather whose data lands only when it is waited for: any read of a param
    before its bucket's wait sees the previous step's values (a stale read shows at
    once, instead of only when a real gather happens to be slow). The collective itself
    is issued at launch, into a scratch buffer, so every rank issues its gathers in launch
    order whichever buckets its forward reads (ranks whose Python-routed experts read
    different buckets stay matched); the wait copies the scratch into the params."""

    launches = 0
    """Gathers launched since the counter was last reset (class-wide)."""

    def __init__(self, dp: DataParallelGroup, output: torch.Tensor, shards: Sequence[torch.Tensor]) -> None:
        self.output, self.scratch = output, torch.empty_like(output)
        self.work = dist.all_gather_single(self.scratch, shards[dp.rank], group=dp.group, async_op=True)

    def wait(self) -> bool:
        self.work.wait()
        self.output.copy_(self.scratch)
        return True


def deferred_all_gather(dp: DataParallelGroup, output: torch.Tensor, shards: Sequence[torch.Tensor]) -> DeferredGather:
    """Drop-in for ``DataParallelGroup.all_gather_async`` (patch it with ``mock.patch.object``)."""
    DeferredGather.launches += 1
    return DeferredGather(dp, output, shards)
