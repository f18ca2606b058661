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

from ..._torch_compat import is_dtensor
from .buffer_sync import broadcast_flat
from ..communication.comm import DataParallelGroup

__all__ = ["broadcast_initial_state"]


def broadcast_initial_state(
    dp: DataParallelGroup,
    flat_params: Sequence[torch.Tensor],
    module: Optional[torch.nn.Module],
    managed: Sequence[torch.Tensor],
) -> None:
    """Overwrite ``flat_params`` (and ``module``'s other state) with rank 0's."""
    if dp.total == 1:
        return
    for flat in flat_params:
        dp.broadcast_from_first(flat)
    if module is None:
        return
    ids = {id(p) for p in managed}
    broadcast_flat(dp, [t for t in (*module.parameters(), *module.buffers()) if id(t) not in ids and not _sharded(t)])


def _sharded(tensor: torch.Tensor) -> bool:
    """A DTensor sharded over some mesh dim: its local tensors differ from rank to rank, and
    the group may span that dim (another optimizer's expert params, Shard(0) over the
    expert-parallel dim, are unmanaged here and must not become rank 0's experts). Its own
    optimizer syncs it over its own group."""
    if not is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard  # loaded: tensor is a DTensor

    return any(isinstance(p, Shard) for p in tensor.placements)  # type: ignore[attr-defined]
