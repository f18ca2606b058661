"""The update one bucket at a time, so each bucket's all-gather starts as its shard is done.

Why: with ``Config.overlap_param_gather`` off (the default, safe for any read right after
``step()``), the step must gather every updated shard before it returns. Updating every
shard first and gathering after leaves the whole gather exposed. Megatron-LM's
``--overlap-param-gather-with-optimizer-step`` instead updates bucket by bucket and starts
each bucket's gather as soon as its shard is updated, so the gathers run under the rest of
the update and only the last bucket's is left to wait for. fxzero does the same
(``Config.overlap_param_gather_with_optimizer_step``, on by default), in the order the next
forward reads buckets, so the first bucket it needs is the first to land.

**Exact.** The classes of :func:`updates_param_by_param` compute each param's new value
from that param's own gradient, state and group hyperparameters only (elementwise classes,
and Adafactor and Muon, which read a whole param), with no quantity shared across params.
A step over a subset of the params therefore gives each param the bits it gets from the
step over all of them. Any other class (a user's own may couple params, e.g. through a
norm over all of them) keeps the safe path: every shard is updated, then the gathers run.

**How.** The wrapped optimizer (or the flat-update twin) steps once per bucket with each
param group's ``params`` list swapped for the part of it that lies in that bucket
(:class:`BucketParts`, prepared at construction; the swap assigns lists, copies nothing).
Groups stay the same dicts, so hyperparameters and an LR scheduler's edits apply as before,
and the full lists are restored even when a step raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from ..layout.validation import ELEMENTWISE_OPTIMIZERS, SHAPE_AWARE_OPTIMIZERS

__all__ = ["BucketParts", "ByBucket", "step_each_bucket", "updates_param_by_param"]


@dataclasses.dataclass(frozen=True)
class ByBucket:
    """The plan of a bucket-at-a-time step: one bucket at a time, in ``order``, calling
    ``after(bucket)`` after each (:class:`~fxzero.optim.update.publish.Publish`)."""

    order: tuple[int, ...]
    after: Callable[[int], None]


def updates_param_by_param(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` (exactly: a subclass may override ``step``) updates each
    param from its own gradient and state only, so it may step one bucket at a time."""
    return optimizer_class in ELEMENTWISE_OPTIMIZERS or optimizer_class in SHAPE_AWARE_OPTIMIZERS


class BucketParts:
    """Per bucket, each of an optimizer's param groups cut to the tensors in that bucket."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], bucket_of: Callable[[torch.Tensor], int], buckets: int) -> None:
        """``groups``: the optimizer's group ``params`` lists; ``bucket_of``: each tensor's bucket."""
        self.parts: tuple[tuple[list[torch.Tensor], ...], ...] = tuple(tuple([] for _ in groups) for _ in range(buckets))
        for g, params in enumerate(groups):
            for tensor in params:
                self.parts[bucket_of(tensor)][g].append(tensor)

    def __len__(self) -> int:
        return len(self.parts)


def step_each_bucket(
    groups: Sequence[dict[str, Any]], parts: BucketParts, order: Sequence[int], step: Callable[[], Any], after: Callable[[int], None]
) -> None:
    """``step()`` once per bucket of ``order`` over that bucket's part of ``groups`` (an
    optimizer's ``param_groups``), then ``after(bucket)``; the groups' own lists afterwards."""
    full = [group["params"] for group in groups]
    try:
        for index in order:
            for group, part in zip(groups, parts.parts[index]):
                group["params"] = part
            step()
            after(index)
    finally:
        for group, params in zip(groups, full):
            group["params"] = params
