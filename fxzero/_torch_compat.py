"""Every private torch API (``torch._*``) fxzero uses, in one place.

Why: private APIs move between torch releases without notice. Keeping them here makes a
torch upgrade one file to read: each entry says what fxzero needs it for and what would
replace it if torch moved or removed it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist
import torch.fx as fx

__all__ = ["inductor_post_grad_pass", "process_group_store"]


@contextlib.contextmanager
def inductor_post_grad_pass(fn: Callable[[fx.Graph], Any], uuid: bytes) -> Iterator[None]:
    """Run ``fn(graph)`` as the last of Inductor's post-grad FX passes of every graph
    compiled inside the block, after any pass the user configured there.

    What for: the param-gather wait must precede every read of its params in the FX graph
    Inductor lowers; its pattern-matcher passes rewrite the graph after fxzero's passes.
    Uses ``torch._inductor.config.post_grad_custom_post_pass`` (a documented hook of a
    private module) and ``torch._inductor.custom_graph_pass.CustomGraphPass`` (``uuid``
    keys Inductor's FX graph cache). If torch moves them: the same hook under its new
    name, or a ``compile_fx_inner`` wrapper that applies ``fn`` before lowering.
    """
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

    class _Pass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> bytes:
            return uuid

    chained = (*get_custom_graph_passes(config.post_grad_custom_post_pass), _Pass())
    with config.patch(post_grad_custom_post_pass=chained):
        yield


def process_group_store(group: Optional[dist.ProcessGroup]) -> dist.Store:
    """The key-value store the ranks of ``group`` (``None``: the default group) share.

    What for: the checkpoint handshake (:mod:`fxzero.runtime.checkpoint_ranks`) meets the
    other ranks without a collective, with its own short timeout, under gloo and NCCL alike.
    Uses ``torch.distributed.distributed_c10d._get_process_group_store`` (the store that
    ``init_process_group`` / ``new_group`` recorded for the group, already prefixed per
    group). If torch moves it: keep the store the job passed to ``init_process_group``, or
    meet through ``dist.monitored_barrier`` on a gloo group (which has its own timeout).
    """
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(group if group is not None else dist.group.WORLD)
