"""Bucket layout planning: where each param lives in the flat buffer, as plain data.

This reproduces Megatron-LM's distributed-optimizer layout (``_ParamAndGradBuffer``):

* params are walked in **reverse** registration order, which roughly follows the
  order backward produces their gradients, so early buckets fill (and can start their
  reduce-scatter) while later layers' gradients are still being computed;
* every param starts on a multiple of 64 elements (128-byte alignment for >= 16-bit dtypes);
* a bucket closes once ``param_end - bucket_start >= bucket_size``;
* a param marked ``shared_embedding=True`` closes the open bucket at its own padded
  start and then sits in a bucket of its own;
* a closed bucket's end is padded to ``lcm(dp, 128)`` (or ``lcm(dp, 128, 2**16)``), so
  every bucket splits into ``dp`` equal shards and each shard is well aligned.

Everything here is pure and works on meta tensors: a 175B-param layout is planned
without allocating a byte.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

__all__ = [
    "BucketPlan",
    "BufferPlan",
    "Fragment",
    "bucket_divisor",
    "plan_buckets",
    "shard_fragments",
]

PARAM_START_ALIGN = 64
"""Elements: each param starts 128-byte aligned for >= 16-bit dtypes."""


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """One bucket: the half-open range ``[start, end)`` of the flat buffer."""

    start: int
    end: int
    numel_unpadded: int
    """Elements from ``start`` to the end of its last param (padding after it excluded)."""
    param_indices: tuple[int, ...]
    """Indices into the planned ``params``, in walk (reverse registration) order."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_numel(self, dp_size: int) -> int:
        return self.numel // dp_size


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """The layout of one flat param/grad buffer."""

    numel: int
    """Total elements, padding included."""
    numel_unpadded: int
    """Sum of the buckets' ``numel_unpadded``."""
    buckets: tuple[BucketPlan, ...]
    param_ranges: tuple[tuple[int, int, int], ...]
    """For each param index: ``(start, end, bucket_id)`` in the flat buffer."""
    dp_size: int

    @property
    def padding_fraction(self) -> float:
        """Share of the buffer that is padding (end-of-bucket and param alignment)."""
        used = sum(end - start for start, end, _ in self.param_ranges)
        return 0.0 if self.numel == 0 else 1.0 - used / self.numel


@dataclasses.dataclass(frozen=True)
class Fragment:
    """The part of one param that falls inside one rank's shard of a bucket."""

    param_index: int
    bucket_id: int
    param_offset: int
    """Offset of the fragment inside the flattened param."""
    shard_offset: int
    """Offset of the fragment inside the rank's shard of the bucket."""
    numel: int


def bucket_divisor(dp_size: int, pad_for_high_busbw: bool, shard_multiple: int = 1) -> int:
    """Each bucket's padded size is a multiple of this (equal shards, aligned shards).

    ``shard_multiple`` additionally makes every rank's shard a multiple of it (MXFP8's
    32-element blocks must not straddle two ranks' shards)."""
    base = math.lcm(dp_size * shard_multiple, 128)
    return math.lcm(base, 2**16) if pad_for_high_busbw else base


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Planner:
    """Mutable walk state of :func:`plan_buckets` (kept out of the public plan types)."""

    def __init__(self, num_params: int, divisor: int) -> None:
        self.divisor = divisor
        self.ranges: list[Optional[tuple[int, int, int]]] = [None] * num_params
        self.buckets: list[BucketPlan] = []
        self.bucket_start = 0
        self.members: list[int] = []

    def close(self, position: int) -> int:
        """Close the open bucket at ``position``; returns its padded end."""
        end = _round_up(position, self.divisor)
        self.buckets.append(
            BucketPlan(self.bucket_start, end, position - self.bucket_start, tuple(self.members))
        )
        self.bucket_start, self.members = end, []
        return end

    def place(self, index: int, start: int, numel: int) -> int:
        end = start + numel
        self.ranges[index] = (start, end, len(self.buckets))
        self.members.append(index)
        return end


def plan_buckets(
    params: Sequence[torch.Tensor],
    *,
    dp_size: int,
    bucket_size: Optional[int],
    pad_for_high_busbw: bool = False,
    shard_multiple: int = 1,
) -> BufferPlan:
    """Plan Megatron-LM's distributed-optimizer layout for ``params`` (registration order).

    ``params`` may be meta tensors; only ``numel()`` and the ``shared_embedding``
    attribute are read. ``bucket_size=None`` means one bucket (per shared-embedding split).
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"plan_buckets: dp_size must be an int >= 1, got {dp_size!r}")
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0):
        raise ValueError(f"plan_buckets: bucket_size must be an int > 0 or None, got {bucket_size!r}")
    if isinstance(shard_multiple, bool) or not isinstance(shard_multiple, int) or shard_multiple < 1:
        raise ValueError(f"plan_buckets: shard_multiple must be an int >= 1, got {shard_multiple!r}")
    planner = _Planner(len(params), bucket_divisor(dp_size, pad_for_high_busbw, shard_multiple))
    position = 0
    for index in reversed(range(len(params))):
        param = params[index]
        start = _round_up(position, PARAM_START_ALIGN)
        shared = bool(getattr(param, "shared_embedding", False))
        if shared and planner.members:
            start = planner.close(start)
        end = planner.place(index, start, param.numel())
        full = bucket_size is not None and end - planner.bucket_start >= bucket_size
        position = planner.close(end) if (full or shared) else end
    if planner.members:
        position = planner.close(position)
    buckets = tuple(planner.buckets)
    return BufferPlan(
        numel=position,
        numel_unpadded=sum(b.numel_unpadded for b in buckets),
        buckets=buckets,
        param_ranges=tuple(r for r in planner.ranges if r is not None),
        dp_size=dp_size,
    )


def shard_fragments(plan: BufferPlan, rank: int) -> tuple[Fragment, ...]:
    """The param fragments inside ``rank``'s shard of every bucket, in buffer order.

    The distributed optimizer keeps fp32 main copies and optimizer state for exactly
    these fragments, so each rank holds 1/dp of the state (plus its share of padding).
    """
    if not 0 <= rank < plan.dp_size:
        raise ValueError(f"shard_fragments: rank must be in [0, {plan.dp_size}), got {rank}")
    fragments = []
    for bucket_id, bucket in enumerate(plan.buckets):
        shard = bucket.shard_numel(plan.dp_size)
        lo, hi = bucket.start + rank * shard, bucket.start + (rank + 1) * shard
        for index in sorted(bucket.param_indices, key=lambda i: plan.param_ranges[i][0]):
            start, end, _ = plan.param_ranges[index]
            a, b = max(start, lo), min(end, hi)
            if a < b:
                fragments.append(Fragment(index, bucket_id, a - start, a - lo, b - a))
    return tuple(fragments)
