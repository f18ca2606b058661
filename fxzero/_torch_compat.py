"""Every private torch API (``torch._*``) fxzero uses, in one place.

Why: private APIs move between torch releases without notice. Keeping them here makes a
torch upgrade one file to read: each entry says what fxzero needs it for and what would
replace it if torch moved or removed it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.fx as fx

__all__ = [
    "current_graph_task_id",
    "gradient_ops",
    "inductor_post_grad_pass",
    "plain_torch_function",
    "storageless_like",
    "will_engine_execute_node",
]


def storageless_like(cls: type, like: torch.Tensor) -> torch.Tensor:
    """An instance of tensor subclass ``cls`` with ``like``'s shape, dtype and device and
    no storage.

    What for: ``p.grad`` views of gradients that live sharded over ranks
    (:mod:`fxzero.runtime.grad_views`). Uses ``torch.Tensor._make_wrapper_subclass`` (what
    DTensor and FSDP2 build on); if torch renames it, the same under its new name.
    """
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)


def plain_torch_function() -> ContextManager[None]:
    """Inside the block, torch functions called on a tensor subclass run as on a plain
    tensor (no ``__torch_function__``).

    What for: metadata reads of the ``p.grad`` views (shape, strides: what torch.compile
    reads when it traces params). Uses ``torch._C.DisableTorchFunctionSubclass``; if torch
    moves it, ``torch.overrides``' equivalent context manager.
    """
    return torch._C.DisableTorchFunctionSubclass()


def gradient_ops() -> dict[str, Callable[..., Any]]:
    """The private ops that ``torch.nn.utils.clip_grad_norm_`` (``foreach`` path) and
    ``torch.amp.GradScaler`` call on gradients, by role.

    What for: the ``p.grad`` views recognize them in ``__torch_function__`` and run them
    over every rank's shards. If torch renames one, the new op goes here (the views
    then raise a clear "not supported" error for the old name until it does).
    """
    return {
        "foreach_norm": torch._foreach_norm,
        "foreach_mul_": torch._foreach_mul_,
        "foreach_div_": torch._foreach_div_,
        "amp_unscale": torch._amp_foreach_non_finite_check_and_unscale_,
    }


def current_graph_task_id() -> int:
    """The id of the backward pass running on this thread, or -1 outside backward.

    What for: telling one backward from the next (their first gradient settles which
    compiled forwards they will deliver for) and whether an op runs inside the autograd
    engine at all. Uses ``torch._C._current_graph_task_id``; if torch removes it, a
    counter bumped by a callback queued on the engine at each backward's first gradient.
    """
    return torch._C._current_graph_task_id()


def will_engine_execute_node(node: Any) -> bool:
    """Whether the backward running now will execute autograd ``node``.

    What for: a compiled forward whose backward this pass will not run (a validation
    loss computed with grad enabled) must not keep its buckets waiting. Uses
    ``torch._C._will_engine_execute_node`` (what ``torch.autograd.graph.register_multi_grad_hook``
    uses); if torch removes it, a pre-hook on the node that marks it as run, checked at
    the end of backward.
    """
    return torch._C._will_engine_execute_node(node)


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
