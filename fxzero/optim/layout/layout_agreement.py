"""Every rank must lay out the same params the same way: checked once, at construction.

Collectives move flat buckets by position. If ranks disagree on the params (another
registration order, a shape, a dtype, a different ``Config``), a bucket's reduce-scatter
silently adds rank 1's ``b.weight`` into rank 0's ``a.weight``, or a size mismatch kills
a rank somewhere in gloo. :func:`check_ranks_agree` hashes this rank's layout
description (params in layout order with name, shape, dtype and param group, plus the
config that shapes the buckets), all-gathers the 32-byte digests (one small
collective), and only when they differ gathers the descriptions themselves, so that
every rank raises the same error, naming the first difference.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..communication.comm import DataParallelGroup

__all__ = ["check_ranks_agree", "describe_layout"]

Description = tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]]


def describe_layout(
    layout: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]], names: dict[int, str], settings: tuple[Any, ...]
) -> Description:
    """``((name, shape, dtype, group, shared_embedding) per param in layout order), settings)``.
    ``names`` (by ``id(param)``, :func:`~fxzero.optim.layout.param_table.param_names`) come from
    ``module=`` or from ``named_parameters()`` groups; a param without one is ``None``."""
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    params = tuple(
        (
            names.get(id(p)),
            tuple(p.shape),
            str(p.dtype),
            group_of[id(p)],
            bool(getattr(p, "shared_embedding", False)),
        )
        for p in layout
    )
    return params, tuple(str(s) for s in settings)


def check_ranks_agree(dp: DataParallelGroup, description: Description, device: torch.device) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks describe the same layout:
    the ranks of the shard group and, with hierarchical sharding, those of the other instances,
    whose shards are all-reduced with this rank's by position (a different model there made
    gloo abort the process with "Received data size doesn't match expected size").

    Each hop all-gathers what the previous one gathered (over the shard group, then over the
    instances), so every rank sees every rank's digest, decides alike, and none is left waiting
    in a collective that another rank skipped by raising."""
    hops = [(group, size) for group, size in ((dp.group, dp.size), (dp.replicas, dp.replica_count)) if size > 1]
    if not hops:
        return
    digests = torch.frombuffer(bytearray(hashlib.sha256(repr(description).encode()).digest()), dtype=torch.uint8).to(device)
    width = digests.numel()
    for group, size in hops:
        gathered = torch.empty(size * digests.numel(), dtype=torch.uint8, device=device)
        dist.all_gather_single(gathered, digests, group=group)
        digests = gathered
    if bool((digests.view(-1, width) == digests[:width]).all()):
        return
    every: list[tuple[str, Description]] = [(_rank_label(dp), description)]
    for group, size in hops:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, every, group=group)
        every = [entry for part in parts for entry in part]
    raise ValueError(_disagreement(every))


def _rank_label(dp: DataParallelGroup) -> str:
    """``rank 2``, or with several instances ``rank 2 (instance 1)``: global ranks, so that
    ranks of a subgroup or of another instance are named as the launcher numbers them."""
    label = f"rank {dist.get_rank()}"
    return f"{label} (instance {dp.replica_rank})" if dp.replica_count > 1 else label


def _disagreement(every: Sequence[tuple[str, Description]]) -> str:
    """The first rank that differs from the first rank of all (instance 0's first), and where."""
    (reference, first), (rank, other) = every[0], next(e for e in every if e[1] != every[0][1])
    hint = (
        "Every rank must build the same model and pass the same params, in the same order, with the same "
        "fxzero.Config (and bucket-shaping options) to DistributedOptimizer."
    )
    if len(first[0]) != len(other[0]):
        return f"fxzero: ranks disagree on the params: {reference} has {len(first[0])}, {rank} has {len(other[0])}. {hint}"
    for index, (mine, theirs) in enumerate(zip(first[0], other[0])):
        if mine != theirs:
            return (
                f"fxzero: ranks disagree on param {index} of the bucket layout: {reference} has {_param(mine)}, "
                f"{rank} has {_param(theirs)}. {hint}"
            )
    return f"fxzero: ranks disagree on the layout settings: {reference} has {first[1]}, {rank} has {other[1]}. {hint}"


def _param(entry: tuple[Any, ...]) -> str:
    name, shape, dtype, group, shared = entry
    label = repr(name) if name else "an unnamed param"
    return f"{label} (shape {list(shape)}, {dtype}, param group {group}{', shared_embedding' if shared else ''})"
