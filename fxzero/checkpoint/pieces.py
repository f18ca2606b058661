"""Where a rank's fragment of a param lies in the param's *global* tensor, as N-D boxes.

A fragment is a flat range ``[lo, hi)`` of the param as this rank's buffers hold it: the
param itself, or for a DTensor param (tensor parallelism) its local tensor, which is a
block of the global param (``Shard(0)``: a range of rows; ``Shard(1)``, as Rowwise/
ColwiseParallel shard a weight's columns: a strided block). A checkpoint must store the
*global* param, so that a run with another tensor-parallel degree (or none) reads it.

:func:`flat_boxes` cuts the flat range of a row-major array into boxes that are each a
contiguous piece of it (at most ``2 * ndim - 1``); shifted by the local tensor's global
offset they are chunks of the global tensor, the form DCP plans and reshards (its
``ChunkStorageMetadata`` has offsets and sizes per dim, as for DTensor). :class:`Pieces`
is one fragment as such chunks: what is written, and what a load reads into.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .._torch_compat import DcpCheckpointable

__all__ = ["Box", "Pieces", "flat_boxes"]


@dataclasses.dataclass(frozen=True)
class Box:
    """Elements ``[start, start + numel)`` of a fragment, which are the block at ``offsets``
    of size ``sizes`` (row-major) of the logical tensor."""

    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Boxes covering elements ``[lo, hi)`` of a row-major array of ``shape`` (``start``
    relative to ``lo``), in order: a partial first row, whole rows, a partial last row, and
    the same again inside a partial row."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [Box(0, (lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []
    row, end_row = lo // inner, hi // inner
    if row == end_row:  # inside one row
        return _in_row(shape, row, lo - row * inner, hi - row * inner, 0)
    if lo % inner:
        boxes += _in_row(shape, row, lo % inner, inner, 0)
        row += 1
    if end_row > row:
        boxes.append(Box(row * inner - lo, (row,) + (0,) * (len(shape) - 1), (end_row - row,) + shape[1:]))
    if hi % inner:
        boxes += _in_row(shape, end_row, 0, hi % inner, end_row * inner - lo)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, lo: int, hi: int, start: int) -> list[Box]:
    """Boxes of elements ``[lo, hi)`` of row ``row`` (its own flat indices), ``start`` added."""
    return [Box(start + b.start, (row,) + b.offsets, (1,) + b.sizes) for b in flat_boxes(shape[1:], lo, hi)]


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces(DcpCheckpointable):
    """``flat`` (a rank's fragment) as chunks of a logical tensor of shape ``shape``: one
    per box, each at ``offset`` plus the box's offsets. It speaks DCP's checkpointable
    protocol (:class:`~fxzero._torch_compat.DcpCheckpointable`), so DCP plans uneven and
    empty pieces, at any world size, without ShardedTensor or DTensor (which need a
    process group, and a fragment of a local tensor is neither)."""

    flat: torch.Tensor
    boxes: tuple[Box, ...]
    shape: tuple[int, ...]
    """Of the logical tensor. (Not ``size``: DCP's load planner calls ``obj.size()`` when it has one.)"""

    @classmethod
    def of(cls, flat: torch.Tensor, local_shape: Sequence[int], lo: int, offset: Sequence[int], size: Sequence[int]) -> "Pieces":
        """Elements ``[lo, lo + flat.numel())`` of a local tensor of ``local_shape`` that sits
        at ``offset`` in the logical tensor of shape ``size``."""
        boxes = flat_boxes(local_shape, lo, lo + flat.numel())
        shifted = (dataclasses.replace(b, offsets=tuple(o + s for o, s in zip(b.offsets, offset))) for b in boxes)
        return cls(flat, tuple(shifted), tuple(size))

    def piece(self, offsets: Sequence[int]) -> torch.Tensor:
        """The view of ``flat`` that is the box at ``offsets`` (what DCP reads from or into)."""
        for box in self.boxes:
            if box.offsets == tuple(offsets):
                return self.flat[box.start : box.start + box.numel].view(box.sizes)
        raise KeyError(f"no piece at offsets {tuple(offsets)} (pieces at {[b.offsets for b in self.boxes]})")

    def write_items(self, fqn: str) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.flat)
        return [
            WriteItem(
                MetadataIndex(fqn, torch.Size(box.offsets)),
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(_chunk(box), properties, torch.Size(self.shape)),
            )
            for box in self.boxes
        ]

    def chunk_list(self) -> list[Any]:
        return [_chunk(box) for box in self.boxes]


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
