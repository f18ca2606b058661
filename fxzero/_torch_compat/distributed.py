"""Process groups, DDP and ``torch.distributed.checkpoint``'s planning protocol.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "DcpCheckpointable",
    "active_ddp_module",
    "group_ranks_by_name",
    "process_group_store",
    "process_group_timeout",
]


def process_group_timeout(group: Optional[dist.ProcessGroup], device: torch.device) -> float:
    """Seconds a collective of ``group`` waits before it fails (``init_process_group(timeout=...)``).

    What for: the checkpoint handshake waits as long as a collective would (DDP and DCP wait
    that long for a late rank). Reads ``ProcessGroup._get_backend(device).options._timeout``;
    if torch moves it, ``torch.distributed.default_pg_timeout`` (30 minutes) is used."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return float(pg._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.default_pg_timeout.total_seconds())


def group_ranks_by_name(name: str) -> Optional[list[int]]:
    """Global ranks of the process group a functional collective in a graph names (its
    ``group_name`` argument), or None when this process does not know the name.

    What for: ``fxzero.explain`` says which ranks a model's own collective (tensor parallel's
    all-gathers, reduce-scatters) runs over. Private: ``torch.distributed.distributed_c10d.
    _resolve_process_group`` is how functional collectives themselves find their group."""
    try:
        group = dist.distributed_c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
    return list(dist.get_process_group_ranks(group))


def process_group_store(group: Optional[dist.ProcessGroup]) -> dist.Store:
    """The key-value store the ranks of ``group`` (``None``: the default group) share.

    What for: the checkpoint handshake (:mod:`fxzero.checkpoint.ranks`) meets the other
    ranks without a collective, with its own short timeout, under gloo and NCCL alike.
    Uses ``torch.distributed.distributed_c10d._get_process_group_store`` (the store that
    ``init_process_group`` / ``new_group`` recorded for the group, already prefixed per
    group). If torch moves it: keep the store the job passed to ``init_process_group``, or
    meet through ``dist.monitored_barrier`` on a gloo group (which has its own timeout).
    """
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(group if group is not None else dist.group.WORLD)


def active_ddp_module() -> Optional[nn.Module]:
    """The ``DistributedDataParallel`` whose forward is running, if any.

    What for: a model whose params fxzero manages must not also be wrapped in DDP (HF
    Trainer and Accelerate wrap it under torchrun): DDP would all-reduce every gradient
    fxzero already reduce-scatters. fxzero's forward pre-hook asks this and refuses.
    Uses ``DistributedDataParallel._get_active_ddp_module()`` (what Dynamo's DDPOptimizer
    asks; set around the wrapped module's forward by the C++ reducer's DDP). If torch drops
    it: look for a ``DistributedDataParallel`` among ``gc.get_referrers(module)`` at construction.
    """
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


class DcpCheckpointable:
    """Base of objects ``torch.distributed.checkpoint`` plans like a sharded tensor.

    What for: fxzero's checkpoints store each rank's fragment of a logical 1-D tensor
    (:class:`fxzero.checkpoint.state.Chunk`). DCP asks such objects through its private
    ``_Checkpointable`` protocol (the dunder methods below); subclasses implement the
    plainly named ``write_items`` / ``chunk_list``. If DCP renames the protocol, only the
    dunders here change; without it: ``ShardedTensor`` / ``DTensor`` pieces.
    """

    def write_items(self, fqn: str) -> list[Any]:
        raise NotImplementedError

    def chunk_list(self) -> list[Any]:
        raise NotImplementedError

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        return self.write_items(fqn)

    def __create_chunk_list__(self) -> list[Any]:
        return self.chunk_list()
