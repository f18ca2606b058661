"""Rank 0's module buffers on every rank once per step, as DDP's ``broadcast_buffers=True``.

**What DDP does.** ``DistributedDataParallel._pre_forward`` broadcasts rank 0's buffers
(BatchNorm's running statistics) before a forward when the forward before it ran with
grad enabled outside ``no_sync()`` (``require_forward_param_sync``, which
``_post_forward`` sets, and clears after a ``no_sync()`` or no-grad forward). In a
training loop that is once per optimizer step, before the step's first forward, and it
carries rank 0's buffers as every forward of the previous step left them:

* with grad accumulation, the microbatches under ``no_sync()`` clear the flag, so no
  broadcast runs between them;
* an eval forward between steps (``model.eval()``, ``torch.no_grad()``) gets the
  broadcast and clears the flag, so the next training forward gets none; it starts from
  the same values, since an eval forward updates no running statistic.

**Where fxzero does it.** In :meth:`DistributedOptimizer.step`, before anything else
(after a closure's forward): it comes after every forward of the step and before the
first forward of the next, so each of those forwards starts from the buffers it starts
from under DDP, bit for bit. A forward cannot host it: the model is usually compiled,
and Dynamo traces forward pre-hooks into the graph. The difference is only where no
forward reads: between a training forward and ``step()`` a rank other than 0 holds its
own buffers (under DDP until the next forward). Not matched: a training-mode forward
under ``torch.no_grad()`` between steps (BatchNorm recalibration) or between backward and
``step()``, which DDP would sync first.

**Cost.** One ``broadcast`` per (dtype, device) of the buffers (BatchNorm's fp32
statistics and int64 batch counts: two), flattened; none at world size 1, with
``Config.broadcast_buffers=False`` or a module without buffers. The buffers are
collected from the module at every step, as DDP does, so buffers the model reassigns
are still the ones broadcast.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..communication.comm import DataParallelGroup
from ..layout.mesh import local_of

__all__ = ["BufferSync", "broadcast_flat"]


def broadcast_flat(dp: DataParallelGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite ``tensors`` with rank 0's: one broadcast per (dtype, device), flattened
    (a DTensor's local tensor: the data-parallel ranks hold the same slice of it)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in map(local_of, tensors):
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dp.broadcast_from_first(flat)
            if dp.rank != 0 or dp.replica_rank != 0:
                for tensor, values in zip(group, flat.split([t.numel() for t in group])):
                    tensor.copy_(values.view_as(tensor))


class BufferSync:
    """Broadcasts ``module``'s buffers from rank 0 at every :meth:`broadcast` (see the module docstring);
    ``module=None`` (no module, or ``Config.broadcast_buffers=False``) broadcasts nothing."""

    def __init__(self, module: Optional[torch.nn.Module], dp: DataParallelGroup) -> None:
        self.module = module if dp.total > 1 else None
        self.dp = dp

    def _buffers(self) -> list[torch.Tensor]:
        return [] if self.module is None else list(self.module.buffers())

    def broadcast(self) -> None:
        buffers = self._buffers()
        if buffers:
            broadcast_flat(self.dp, buffers)

    def collectives_per_step(self) -> dict[str, int]:
        kinds = {(b.dtype, b.device) for b in self._buffers()}
        return {"broadcast": len(kinds) * ((self.dp.size > 1) + (self.dp.replica_count > 1))} if kinds else {}
