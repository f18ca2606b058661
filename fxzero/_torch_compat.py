"""Every private torch API (``torch._*``) fxzero uses, in one place.

Why: private APIs move between torch releases without notice. Keeping them here makes a
torch upgrade one file to read: each entry says what fxzero needs it for and what would
replace it if torch moved or removed it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.fx as fx

__all__ = ["inductor_post_grad_pass"]


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
