"""Whole-param ownership: a bucket layout in which every param lies inside one rank's shard.

Optimizers whose update reads a param's shape (Muon orthogonalizes a matrix, Adafactor
factors its second moment into row and column statistics, Shampoo/SOAP precondition by
dimension) cannot run on the 1-D fragments of the elementwise layout
(:func:`~fxzero.optim.layout.layout.plan_buckets`): they would compute another optimizer without
an error. Here each bucket is still split into ``dp`` equal shards, so the reduce-scatter
that averages gradients into a rank's shard and the all-gather of updated params stay as
they are, but the params of a bucket are **dealt** to ranks, whole, and each rank's shard
holds exactly the params it owns. After the reduce-scatter the owner has every element of
its params' averaged gradients; the wrapped optimizer gets views shaped like the params.

Dealing: params are walked in the same reverse registration order as the elementwise layout
(the order backward produces gradients, so buckets still fill and launch early); each goes
to the rank whose region of the open bucket holds the fewest elements (ties: the rank
owning the fewest elements over all buckets so far, then the lowest rank), and the bucket
closes once *every* rank's region holds ``bucket_size / dp`` elements and no region is more
than 1/:data:`REGION_SPREAD` smaller than the largest. A rank's shard is its largest region
rounded up: the difference is padding, in both flat buffers and in the bytes each collective
moves, so a param much larger than ``bucket_size / dp`` makes its bucket grow until the other
ranks' regions have caught up with it, rather than leave them empty.
:func:`balance` reports it and the optimizer-state share of each rank.

This is torch's ``ZeroRedundancyOptimizer`` (whole params per rank, balanced by size) and
Megatron-LM's layer-wise distributed optimizer, on fxzero's buckets: a
``ZeroRedundancyOptimizer`` all-reduces gradients (2x the bytes of a reduce-scatter) and
broadcasts each rank's params; here the gradients are reduce-scattered, each rank receives
only what it owns, and params come back by the same all-gather as in the elementwise layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from .layout import PARAM_START_ALIGN, BucketPlan, BufferPlan, bucket_divisor, check_plan_args, param_start_alignment

__all__ = ["REGION_SPREAD", "Balance", "balance", "plan_owned_buckets"]

REGION_SPREAD = 8
"""A bucket closes only when its smallest rank region is within 1/8 of its largest (at most
12.5% of a closed bucket is padding between regions); params left over at the end that do
not balance alone join the buckets before them until they do. Memory is preferred to
overlap: with few params per rank (large dp) buckets get large, down to one."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass
class _Deal:
    """A bucket's params dealt to ranks: each rank's param indices (walk order) and region size."""

    regions: list[list[int]]
    sizes: list[int]

    @property
    def balanced(self) -> bool:
        low, high = min(self.sizes), max(self.sizes)
        return (high - low) * REGION_SPREAD <= high


def _deal(members: Sequence[int], numels: Sequence[int], aligns: Sequence[int], owned: Sequence[int]) -> _Deal:
    """Largest param first to the rank with the smallest region (ties: the fewest elements owned
    over earlier buckets, then the lowest rank); each region then lies in walk order."""
    dp = len(owned)
    regions: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for index in sorted(members, key=lambda i: (-numels[i], -i)):
        rank = min(range(dp), key=lambda r: (load[r], owned[r], r))
        regions[rank].append(index)
        load[rank] += _round_up(numels[index], aligns[index])
    sizes = []
    for region in regions:
        region.sort(reverse=True)
        offset = 0
        for index in region:
            offset = _round_up(offset, aligns[index]) + numels[index]
        sizes.append(offset)
    return _Deal(regions, sizes)


def plan_owned_buckets(
    params: Sequence[torch.Tensor],
    *,
    dp_size: int,
    bucket_size: Optional[int],
    pad_for_high_busbw: bool = False,
    shard_multiple: int = 1,
    grad_dtype: torch.dtype | None = None,
) -> BufferPlan:
    """A layout of ``params`` (registration order) in which each param lies wholly inside one
    rank's shard of its bucket; ``BufferPlan.owners[i]`` is the rank of ``params[i]``.

    The arguments mean what they mean for :func:`~fxzero.optim.layout.layout.plan_buckets`, and every
    guarantee of that layout holds (equal shards of each bucket, aligned param starts, a
    ``shared_embedding`` param in a bucket of its own, meta tensors accepted)."""
    check_plan_args("plan_owned_buckets", dp_size, bucket_size, shard_multiple)
    divisor = bucket_divisor(dp_size, pad_for_high_busbw, shard_multiple)
    unit = math.lcm(divisor // dp_size, PARAM_START_ALIGN, shard_multiple)  # a shard's size is a multiple of it
    numels = [p.numel() for p in params]
    aligns = [
        param_start_alignment(p.numel(), min(p.element_size(), (grad_dtype or p.dtype).itemsize), shard_multiple)
        for p in params
    ]
    owned, deals, members, filled = [0] * dp_size, [], [], 0

    def close() -> None:
        nonlocal members, filled
        deal = _deal(members, numels, aligns, owned)
        for rank, region in enumerate(deal.regions):
            owned[rank] += sum(numels[i] for i in region)
        deals.append(deal)
        members, filled = [], 0

    for index in reversed(range(len(params))):
        shared = bool(getattr(params[index], "shared_embedding", False))
        if shared and members:
            close()
        members.append(index)
        filled += numels[index]
        full = bucket_size is not None and filled >= bucket_size and _deal(members, numels, aligns, owned).balanced
        if shared or full:
            close()
    while members and deals and not _deal(members, numels, aligns, owned).balanced:
        # the params left after the last balanced bucket rarely balance alone: deal them with it
        last = deals.pop()
        for rank, region in enumerate(last.regions):
            owned[rank] -= sum(numels[i] for i in region)
        members = sorted((i for region in last.regions for i in region), reverse=True) + members
    if members:
        close()
    return _place(params, deals, aligns, unit, dp_size)


def _place(params: Sequence[torch.Tensor], deals: Sequence[_Deal], aligns: Sequence[int], unit: int, dp: int) -> BufferPlan:
    """Lay the dealt buckets out one after another: each rank's region at the start of its shard."""
    ranges: list[Optional[tuple[int, int, int]]] = [None] * len(params)
    owners = [0] * len(params)
    buckets, position = [], 0
    for bucket_id, deal in enumerate(deals):
        shard = max(unit, _round_up(max(deal.sizes), unit))
        for rank, region in enumerate(deal.regions):
            offset = position + rank * shard
            for index in region:
                start = _round_up(offset, aligns[index])
                offset = start + params[index].numel()
                ranges[index], owners[index] = (start, offset, bucket_id), rank
        members = tuple(sorted((i for region in deal.regions for i in region), reverse=True))  # walk order
        numel = sum(params[i].numel() for i in members)
        buckets.append(BucketPlan(position, position + dp * shard, numel, members))
        position += dp * shard
    return BufferPlan(
        numel=position,
        numel_unpadded=sum(b.numel_unpadded for b in buckets),
        buckets=tuple(buckets),
        param_ranges=tuple(r for r in ranges if r is not None),
        dp_size=dp,
        owners=tuple(owners),
    )


@dataclasses.dataclass(frozen=True)
class Balance:
    """How evenly whole-param ownership spreads the params over ranks."""

    elements: tuple[int, ...]
    """Param elements each rank owns (its optimizer state is proportional)."""
    params: tuple[int, ...]
    """Params each rank owns."""
    padding: int
    """Buffer elements that hold no param (per buffer copy: param and grad buffers each)."""

    @property
    def imbalance(self) -> float:
        """The most-loaded rank's elements over the mean (1.0: perfectly even)."""
        mean = sum(self.elements) / len(self.elements)
        return max(self.elements) / mean if mean else 1.0

    def describe(self) -> str:
        per_rank = ", ".join(f"rank {r}: {n:,} elements in {k} params" for r, (n, k) in enumerate(zip(self.elements, self.params)))
        return f"whole-param ownership: {per_rank}; max/mean {self.imbalance:.3f}; {self.padding:,} padding elements"


def balance(plans: Sequence[BufferPlan], params: Sequence[Sequence[torch.Tensor]]) -> Balance:
    """The balance of whole-param plans, ``params[k]`` being the params ``plans[k]`` lays out."""
    dp = plans[0].dp_size
    elements, counts = [0] * dp, [0] * dp
    for plan, group in zip(plans, params):
        if plan.owners is None:
            raise ValueError("balance: the plan is not a whole-param plan (its owners are None)")
        for param, owner in zip(group, plan.owners):
            elements[owner] += param.numel()
            counts[owner] += 1
    padding = sum(plan.numel for plan in plans) - sum(elements)
    return Balance(tuple(elements), tuple(counts), padding)
