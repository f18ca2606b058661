"""Test doubles for fxzero's collectives."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fxzero.optim.comm import DataParallelGroup


class DeferredGather:
    """An all-gather that moves no data until it is waited for: any read of a param
    before its bucket's wait sees the previous step's values (a stale read shows at
    once, instead of only when a real gather happens to be slow)."""

    launches = 0
    """Gathers launched since the counter was last reset (class-wide)."""

    def __init__(self, dp: DataParallelGroup, output: torch.Tensor, shards: Sequence[torch.Tensor]) -> None:
        self.dp, self.output, self.input = dp, output, shards[dp.rank]

    def wait(self) -> bool:
        dist.all_gather_single(self.output, self.input, group=self.dp.group)
        return True


def deferred_all_gather(dp: DataParallelGroup, output: torch.Tensor, shards: Sequence[torch.Tensor]) -> DeferredGather:
    """Drop-in for ``DataParallelGroup.all_gather_async`` (patch it with ``mock.patch.object``)."""
    DeferredGather.launches += 1
    return DeferredGather(dp, output, shards)
