"""The autograd engine (which backward runs, what it does with leaf gradients) and the profiler.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "current_graph_task_id",
    "engine_accumulates_all",
    "in_backward",
    "is_compiled_function_name",
    "leaf_gradient_uses",
    "profiler_enabled",
    "queue_end_of_backward",
    "tensor_hooks",
    "tensor_version",
    "will_engine_execute_node",
]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return current_graph_task_id() != -1


current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""``current_graph_task_id()``: the id of the backward pass running on this thread, or -1 outside backward.

What for: telling one backward from the next (their first gradient settles which
compiled forwards they will deliver for) and whether an op runs inside the autograd
engine at all. Uses ``torch._C._current_graph_task_id`` itself, not a wrapper: every gradient
hand-off asks it (a Python frame around it cost as much as the call). If torch removes it, a
counter bumped by a callback queued on the engine at each backward's first gradient.
"""


def will_engine_execute_node(node: Any) -> bool:
    """Whether the backward running now executes (or is executing) autograd ``node``.

    What for: a compiled forward whose backward this pass will not run (a validation
    loss computed with grad enabled) must not keep its buckets waiting. Uses
    ``torch._C._will_engine_execute_node`` (what ``torch.autograd.graph.register_multi_grad_hook``
    uses), which only knows the nodes *below* the backward's root: when the root itself is
    the compiled function (a model that computes its loss inside the graph, as Hugging Face
    models do), it says False while that very node runs, so the node running now
    (``torch._C._current_autograd_node``) counts as executing too. If torch removes them:
    a pre-hook on the node that marks it as run, checked at the end of backward.
    """
    return torch._C._will_engine_execute_node(node) or torch._C._current_autograd_node() is node


def engine_accumulates_all(nodes: Sequence[Any]) -> bool:
    """Whether the running backward executes every ``AccumulateGrad`` node in ``nodes`` (a
    plain ``.backward()`` does): the fast form of :func:`leaf_gradient_uses`."""
    try:
        return all(map(torch._C._will_engine_execute_node, nodes))
    except RuntimeError:
        return False


def leaf_gradient_uses(nodes: Sequence[Any]) -> tuple[str, ...]:
    """Per ``AccumulateGrad`` node, what the running backward does with its gradient:
    ``"accumulate"`` (``.backward()``), ``"capture"`` (``autograd.grad(..., inputs=[it])``)
    or ``"skip"`` (not reached: ``autograd.grad`` w.r.t. others, ``backward(inputs=...)``).

    What for: ``autograd.grad`` must not touch fxzero's buffers. ``torch._C._will_engine_execute_node``
    answers True/False and raises for a captured leaf ("... currently running autograd.grad()",
    torch 2.13). If that changes: a tensor pre-hook (captured gradients pass through those)."""
    return tuple(map(_leaf_gradient_use, nodes))


def _leaf_gradient_use(node: Any) -> str:
    try:
        return "accumulate" if torch._C._will_engine_execute_node(node) else "skip"
    except RuntimeError as error:
        if "autograd.grad" not in str(error):
            raise
        return "capture"


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward finishes (DDP launches its last
    buckets this way). ``torch.autograd.Variable._execution_engine.queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` is recording. ``torch._C._autograd._profiler_enabled``;
    if gone: ``torch.autograd.profiler._is_profiler_enabled``."""
    return torch._C._autograd._profiler_enabled()


# ---- private attributes of tensors and autograd nodes -------------------------------------
tensor_hooks: Callable[[torch.Tensor], Optional[dict[int, Any]]] = operator.attrgetter("_backward_hooks")
"""``tensor_hooks(t)``: the hooks ``t.register_hook`` added (``None`` or a dict, true when it
holds any). An ``attrgetter``, so mapping it over the params stays in C.

What for: a managed param with tensor hooks keeps autograd's gradient path so its hooks see
the gradient, and a hook added after a graph was compiled is refused. Reads
``Tensor._backward_hooks``; if torch renames it: wrap ``Tensor.register_hook`` to count them."""

tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""``tensor_version(t)``: the counter autograd bumps at every in-place write to ``t``'s memory.

What for: a param written while its all-gather is in flight is told apart from one only read
(:mod:`fxzero.optim.params.param_sync`). Reads ``Tensor._version`` (what autograd's saved-tensor
check reads); if torch drops it: a checksum of the param's shard before and after."""

_COMPILED_FUNCTION = "CompiledFunction"


def is_compiled_function_name(name: str) -> bool:
    """Whether an autograd node named ``name`` (``type(node).__name__`` or ``node.name()``) is
    the backward of a graph AOTAutograd compiled: its ``torch.autograd.Function`` is the class
    ``CompiledFunction`` of ``torch._functorch._aot_autograd.runtime_wrappers``, and its node
    ``CompiledFunctionBackward``. If torch renames the class: the new name here."""
    return name.startswith(_COMPILED_FUNCTION)
