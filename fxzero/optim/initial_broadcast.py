"""Start every rank from rank 0's weights, as DDP does at construction.

Data parallelism assumes identical replicas. A job whose ranks were seeded differently
(or loaded different files) would otherwise train a silent mix: each rank's shard of
the optimizer updates its own copy of a different model. With ``Config.init_sync``
(the default), the optimizer broadcasts rank 0's params when it builds its buffers:
one collective per flat param buffer (each param is a view of one), not one per param.
With ``module=`` the module's buffers (running statistics) and any params it holds
that the optimizer does not manage follow, flattened per dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .comm import DataParallelGroup

__all__ = ["broadcast_initial_state"]


def broadcast_initial_state(
    dp: DataParallelGroup,
    flat_params: Sequence[torch.Tensor],
    module: Optional[torch.nn.Module],
    managed: Sequence[torch.Tensor],
) -> None:
    """Overwrite ``flat_params`` (and ``module``'s other state) with rank 0's."""
    if dp.size == 1:
        return
    for flat in flat_params:
        dist.broadcast(flat, group=dp.group, group_src=0)
    if module is None:
        return
    ids = {id(p) for p in managed}
    others = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in ids]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in others:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for tensors in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            dist.broadcast(flat, group=dp.group, group_src=0)
            for tensor, values in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(values.view_as(tensor))
