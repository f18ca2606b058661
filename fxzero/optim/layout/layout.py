"""Bucket layout planning: where each param lives in the flat buffer, as plain data.

This reproduces Megatron-LM's distributed-optimizer layout (``_ParamAndGradBuffer``):

* params are walked in **reverse** registration order, which roughly follows the
  order backward produces their gradients, so early buckets fill (and can start their
  reduce-scatter) while later layers' gradients are still being computed;
* a param of 64 elements or more starts on a multiple of 64 elements (128-byte alignment
  for >= 16-bit dtypes, Megatron's ``_pad_param_start``); a smaller one starts on a
  smaller power of two (:func:`param_start_alignment`), so tiny params do not multiply
  the buffer;
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
    "param_start_alignment",
    "plan_buckets",
    "shard_fragments",
]

PARAM_START_ALIGN = 64
"""Elements: a param of at least this many elements starts on a multiple of it (Megatron's rule)."""

INPUT_ALIGN_BYTES = 16
"""Bytes: the alignment Inductor assumes of a GPU input (``torch._inductor.utils.ALIGNMENT``)."""


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
    owners: Optional[tuple[int, ...]] = None
    """For each param index, the rank whose shard holds the whole param, in a whole-param plan
    (:func:`fxzero.optim.layout.ownership.plan_owned_buckets`); ``None`` in an elementwise plan, where
    every rank holds a fragment of (nearly) every param."""

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


def param_start_alignment(numel: int, itemsize: int, block: int = 1) -> int:
    """Elements a param's start offset in the flat buffer is a multiple of.

    Each param is a view of the flat buffer and the model computes on that view (and
    fxzero's grad accumulation on its ``main_grad`` view at the same offset), so the
    view's start address is what kernels see:

    * ``numel >= 64``: 64 elements, Megatron-LM's ``_pad_param_start`` (128 bytes for
      16-bit dtypes, 256 for fp32). Large params are what GEMMs and vectorized
      elementwise kernels spend their time on, and what cuBLAS picks algorithms by.
    * smaller params: the smallest power of two covering ``numel`` (at most 64). The
      param then never crosses a 64-element boundary, so it touches no more aligned
      128-byte segments than under Megatron's rule, without 64-element gaps (5,001
      params of 4 elements used to take 16x their size).
    * never below ``INPUT_ALIGN_BYTES`` (16) bytes of the narrower of the param and grad
      dtypes (8 bf16/fp16 elements, 4 fp32): Inductor assumes 16-byte aligned GPU inputs;
      a static input (a param) misaligned at compile time loses vectorized loads, and
      under CUDA graphs is copied on every replay.
    * a multiple of ``block`` (MXFP8's 32-element scale blocks), so a block never mixes
      two params and each param is quantized exactly as on its own.

    ``itemsize`` is the narrower dtype's size in bytes.
    """
    if numel >= PARAM_START_ALIGN:
        align = PARAM_START_ALIGN
    else:
        align = 1 << max(numel - 1, 0).bit_length()  # smallest power of two >= numel
    align = max(align, INPUT_ALIGN_BYTES // itemsize, 1)
    return math.lcm(align, block)


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


def check_plan_args(planner: str, dp_size: int, bucket_size: Optional[int], shard_multiple: int) -> None:
    """The checks both planners (elementwise and whole-param) make, naming the planner."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"{planner}: dp_size must be an int >= 1, got {dp_size!r}")
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0):
        raise ValueError(f"{planner}: bucket_size must be an int > 0 or None, got {bucket_size!r}")
    if isinstance(shard_multiple, bool) or not isinstance(shard_multiple, int) or shard_multiple < 1:
        raise ValueError(f"{planner}: shard_multiple must be an int >= 1, got {shard_multiple!r}")


def plan_buckets(
    params: Sequence[torch.Tensor],
    *,
    dp_size: int,
    bucket_size: Optional[int],
    pad_for_high_busbw: bool = False,
    shard_multiple: int = 1,
    grad_dtype: torch.dtype | None = None,
) -> BufferPlan:
    """Plan Megatron-LM's distributed-optimizer layout for ``params`` (registration order).

    ``params`` may be meta tensors; only ``numel()``, ``dtype`` and the ``shared_embedding``
    attribute are read. ``bucket_size=None`` means one bucket (per shared-embedding split).
    ``shard_multiple`` is a block size (MXFP8's 32): every rank's shard is whole blocks
    and every param starts on a block. ``grad_dtype`` is the grad buffer's dtype (``None``:
    the param's); param starts are aligned for both buffers (:func:`param_start_alignment`).
    """
    check_plan_args("plan_buckets", dp_size, bucket_size, shard_multiple)
    planner = _Planner(len(params), bucket_divisor(dp_size, pad_for_high_busbw, shard_multiple))
    position = 0
    for index in reversed(range(len(params))):
        param = params[index]
        itemsize = min(param.element_size(), (grad_dtype or param.dtype).itemsize)
        start = _round_up(position, param_start_alignment(param.numel(), itemsize, shard_multiple))
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
