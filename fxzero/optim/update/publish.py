"""The hand-off from the update to the gather: publish a bucket's updated masters, launch its gather.

Why its own module, in the update's room: it is the one place where the step's update meets
the gather protocol (:class:`~fxzero.optim.params.param_sync.Gather`). After a bucket's shard
is updated its fp32 masters become what the gather sends (the param shard, or an MXFP8 row)
and the bucket's gather launches; the bucket-at-a-time step calls it after each bucket
(:class:`~fxzero.optim.update.bucketed_update.ByBucket`), the whole step and a state load
after all of them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..params.param_sync import ParamSync

__all__ = ["Publish"]


class Publish:
    """What follows a bucket's update: its fp32 masters become the gather's input (the param
    shard, or an MXFP8 row), and its gather is launched (:meth:`ParamSync.launch`). Holds the
    parts, not the optimizer, so the step plan does not keep the optimizer alive."""

    def __init__(self, sync: ParamSync, mains: Sequence[torch.Tensor]) -> None:
        self.sync, self.gather, self.mains = sync, sync.gather, tuple(mains)

    def __call__(self, index: int) -> None:
        self.gather.publish(index, self.mains[index])
        self.sync.launch(index)

    def all(self) -> None:
        """Every bucket's fp32 masters -> the gather's input; every gather launched."""
        for index in self.sync.order:
            self.gather.publish(index, self.mains[index])
        self.sync.start()

    def finish(self) -> None:
        """Land every gather in flight (before the masters are replaced, and after)."""
        self.sync.finish()
