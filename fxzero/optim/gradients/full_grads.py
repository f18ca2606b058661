"""Whole averaged gradients for logging, gathered on request.

Between backward and ``step()`` a managed param's ``p.grad`` is a
:class:`~fxzero.optim.gradients.grad_views.ShardedGrad`: norms and scaling act on it, but no rank
holds the whole averaged gradient that ``p.grad.abs()``, ``torch.histc(p.grad)`` or a
TensorBoard histogram reads under DDP. :func:`gather_full_grads` gathers it: one
all-gather per bucket of this rank's averaged shard (the fp32 gradient the step uses)
into a fresh tensor. It is a collective, so every rank calls it at the same point, and
every bucket is gathered in bucket order whatever each rank's ``p.grad`` holds, so the
ranks issue the same collectives. It costs one copy of the gradients, freed with the
result, and leaves the step unchanged: logging, not the training path.

What each param gets is what its ``p.grad`` stands for: its view gives the gathered
gradient times the scale recorded on it so far (clipping, ``GradScaler.unscale_``), a
tensor assigned by hand is returned as is (a copy), and a param whose ``p.grad`` is
``None`` or that got no gradient on any rank is left out. A DTensor param (tensor
parallelism, :mod:`~fxzero.optim.layout.mesh`) gets its local tensor's gradient, averaged over
the data-parallel ranks.
"""

from __future__ import annotations

import torch

from ..layout.buffers import shard_buffer
from ..communication.comm import DataParallelGroup
from .grad_views import GradViews
from ..layout.param_table import ParamTable
from .reduced_grads import ReducedGrads

__all__ = ["gather_full_grads"]


def gather_full_grads(table: ParamTable, views: GradViews, grads: ReducedGrads, dp: DataParallelGroup) -> dict[str, torch.Tensor]:
    """``{name: whole averaged gradient}`` of every managed param that has one (see the module)."""
    if not views.installed:  # no backward since the step (or under no_sync): p.grad is None or assigned by hand
        return {row.label: row.param.grad.detach().clone() for row in table.rows if row.param.grad is not None}
    absent = set(grads.absent())  # finishes the reductions; the step's one all-reduce, shared with it
    whole = {shard.bucket.index: _gather(shard.bucket.grad_data, shard.main_grad, dp) for shard in grads.shards}
    out: dict[str, torch.Tensor] = {}
    for row in table.rows:
        grad = row.param.grad
        if grad is None:
            continue
        if grad is not views.views[row.slot]:
            out[row.label] = grad.detach().clone()
        elif row.slot not in absent:
            out[row.label] = _slice(whole[row.bucket], row.param, grads.scale_of(row.slot))
    return out


def _gather(grad_data: torch.Tensor, own: torch.Tensor, dp: DataParallelGroup) -> tuple[torch.Tensor, int]:
    """The bucket's averaged gradient (every rank's shard) and where the bucket starts in its buffer."""
    whole = torch.empty(grad_data.numel(), dtype=own.dtype, device=own.device)
    parts = shard_buffer(whole, dp.size)
    parts[dp.rank].copy_(own)
    if dp.size > 1:
        dp.wait(dp.all_gather_async(whole, parts), "all-gather of the gradients for full_grads()")
    return whole, grad_data.storage_offset()


def _slice(gathered: tuple[torch.Tensor, int], param: torch.Tensor, scale: float) -> torch.Tensor:
    whole, start = gathered
    main_grad = param.main_grad  # the param's view of its buffer's gradient: its place in the bucket
    offset = main_grad.storage_offset() - start
    grad = whole[offset : offset + main_grad.numel()].view(main_grad.shape)
    return grad * scale if scale != 1.0 else grad.clone()
