"""Flat param/grad buffers and their buckets, with every shard view made once.

A :class:`ParamAndGradBuffer` owns two flat tensors laid out by a
:class:`~fxzero.optim.layout.layout.BufferPlan`: ``param_data`` (each managed param becomes
a view of it) and ``grad_data`` (each param's ``main_grad`` is a view of it). A
:class:`Bucket` holds views of one bucket's region and of every rank's shard of it.
All views are created at construction, because slicing a view costs dispatcher time on
every call while fetching a stored one costs almost nothing (``benchmarks/runtime_overhead.py``
measures both), and the per-step path touches 2 views per bucket (reduce-scatter and all-gather).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..communication.comm import DataParallelGroup
from .layout import BufferPlan, plan_buckets
from .mesh import local_of, planned, rebind
from .ownership import plan_owned_buckets

__all__ = ["Bucket", "ParamAndGradBuffer", "build_buffers", "owners_of", "shard_buffer"]


def shard_buffer(buffer: torch.Tensor, dp_size: int) -> tuple[torch.Tensor, ...]:
    """Split a 1-D ``buffer`` into ``dp_size`` equal, contiguous **views** (no copies)."""
    if buffer.dim() != 1:
        raise ValueError(f"shard_buffer: buffer must be 1-D, got shape {tuple(buffer.shape)}")
    if dp_size < 1 or buffer.numel() % dp_size:
        raise ValueError(f"shard_buffer: buffer numel {buffer.numel()} is not divisible by dp_size {dp_size}")
    size = buffer.numel() // dp_size
    return tuple(buffer[r * size : (r + 1) * size] for r in range(dp_size))


@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """Views of one bucket's region of a buffer; made once, reused every step."""

    index: int
    """Global bucket id within the optimizer: the launch order on every rank."""
    params: tuple[torch.nn.Parameter, ...]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    param_shards: tuple[torch.Tensor, ...]
    """``param_shards[r]`` is rank r's shard of ``param_data`` (the all-gather input)."""
    grad_shards: tuple[torch.Tensor, ...]
    """``grad_shards[r]`` is rank r's shard of ``grad_data`` (the reduce-scatter output)."""
    numel_unpadded: int


class ParamAndGradBuffer:
    """Flat storage for params of one (param dtype, grad dtype) group.

    Construction moves each param's values into ``param_data`` and rebinds
    ``param.data`` to a view of it, so the module keeps the same ``Parameter`` objects
    (hooks, optimizer references and tied weights stay valid) while the all-gather
    writes straight into the memory the model reads.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        plan: BufferPlan,
        *,
        grad_dtype: Optional[torch.dtype],
        first_bucket_index: int = 0,
    ) -> None:
        if len(params) != len(plan.param_ranges):
            raise ValueError(f"ParamAndGradBuffer: plan has {len(plan.param_ranges)} params, got {len(params)}")
        self.plan = plan
        self.params = tuple(params)
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        device = params[0].device
        # Padding must read as zeros: it is reduced, gathered and normed like real data.
        self.param_data = torch.zeros(plan.numel, dtype=self.param_dtype, device=device)
        shapes = [local_of(p).shape for p in self.params]  # a DTensor param's buffer holds its local tensor
        for param, shape, (start, end, _) in zip(self.params, shapes, plan.param_ranges):
            view = self.param_data[start:end].view(shape)
            view.copy_(local_of(param).detach())
            rebind(param, view)  # the param's old storage is freed here (unless held elsewhere)
        # Allocated once the old storages are gone: construction peaks at two copies of the
        # params, not three (with world >= 4 that was the run's peak, above training's).
        self.grad_data = torch.zeros(plan.numel, dtype=self.grad_dtype, device=device)
        for param, shape, (start, end, _) in zip(self.params, shapes, plan.param_ranges):
            param.main_grad = self.grad_data[start:end].view(shape)
        self.buckets = tuple(self._make_bucket(i, first_bucket_index + i) for i in range(len(plan.buckets)))

    def _make_bucket(self, local_id: int, index: int) -> Bucket:
        spec = self.plan.buckets[local_id]
        param_data = self.param_data[spec.start : spec.end]
        grad_data = self.grad_data[spec.start : spec.end]
        return Bucket(
            index=index,
            params=tuple(self.params[i] for i in spec.param_indices),
            param_data=param_data,
            grad_data=grad_data,
            param_shards=shard_buffer(param_data, self.plan.dp_size),
            grad_shards=shard_buffer(grad_data, self.plan.dp_size),
            numel_unpadded=spec.numel_unpadded,
        )

    @property
    def nbytes(self) -> int:
        return self.param_data.nbytes + self.grad_data.nbytes


def build_buffers(
    layout: Sequence[torch.nn.Parameter], dp: DataParallelGroup, *, bucket_size: Optional[int], pad_for_high_busbw: bool,
    shard_multiple: int, grad_dtype: Optional[torch.dtype], whole_params: bool = False,
) -> tuple[ParamAndGradBuffer, ...]:
    """One buffer per param dtype, in order of first appearance in ``layout``; bucket
    indices run on over the buffers. ``whole_params`` lays each param inside one rank's
    shard (:mod:`fxzero.optim.layout.ownership`) instead of cutting it at shard boundaries. The
    other arguments are ``Config``'s fields of those names (the bucket size resolved for ``dp``)."""
    planner = plan_owned_buckets if whole_params else plan_buckets
    groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in layout:
        groups.setdefault(param.dtype, []).append(param)
    buffers, first = [], 0
    for params in groups.values():
        plan = planner(
            [planned(p) for p in params],
            dp_size=dp.size,
            bucket_size=bucket_size,
            pad_for_high_busbw=pad_for_high_busbw,
            shard_multiple=shard_multiple,
            grad_dtype=grad_dtype,
        )
        buffers.append(ParamAndGradBuffer(params, plan, grad_dtype=grad_dtype, first_bucket_index=first))
        first += len(plan.buckets)
    return tuple(buffers)


def owners_of(buffers: Sequence[ParamAndGradBuffer]) -> dict[int, int]:
    """``id(param) -> rank`` owning it whole (empty for elementwise plans)."""
    return {
        id(param): owner
        for buffer in buffers
        if buffer.plan.owners is not None
        for param, owner in zip(buffer.params, buffer.plan.owners)
    }
