"""Small node predicates and node helpers shared by fxzero's passes.

::

    joint/backward: placeholder ... -> grad producer -> fxzero::grads_ready([grads], [params]) -> ... -> output
    forward:        placeholder(param) -> fxzero::wait_params([params]) -> first reader -> ...
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..compiled import ops  # noqa: F401  defines the fxzero:: ops the passes insert and match (not defined by import fxzero)

__all__ = ["LAUNCH_META", "WAIT_META", "copy_node_provenance", "graph_output", "is_grads_ready", "is_module_entered", "is_wait_params", "remove_module_marks"]

LAUNCH_META = "fxzero_launch"
"""``node.meta`` key of an inserted ``grads_ready``: ``(manager_index, bucket)`` it was planned for."""
WAIT_META = "fxzero_wait"
"""``node.meta`` key of an inserted ``wait_params``: ``(manager_index, bucket)`` it was planned for."""

_PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr", "fwd_nn_module_stack")


def is_grads_ready(node: fx.Node) -> bool:
    """A bucket launch inserted by the backward pass."""
    return node.op == "call_function" and node.target is torch.ops.fxzero.grads_ready.default


def is_module_entered(node: fx.Node) -> bool:
    """The mark a traced forward pre-hook leaves at the entry of a module owning managed params."""
    return node.op == "call_function" and node.target is torch.ops.fxzero.module_entered.default


def is_wait_params(node: fx.Node) -> bool:
    """A param-gather wait inserted by the forward pass."""
    return node.op == "call_function" and node.target is torch.ops.fxzero.wait_params.default


def remove_module_marks(gm: fx.GraphModule) -> None:
    """Drop the ``module_entered`` marks (:mod:`fxzero.compiled.ops`); they compute nothing. The
    joint pass drops them before partitioning (which would put them in the backward); the
    forward pass after planning its waits (there a mark counts as a reader of its module's
    params). Either way every managed param input of a forward gets its wait before the
    forward returns, so eager code after a graph break inside a module reads landed params."""
    marks = [n for n in gm.graph.nodes if is_module_entered(n)]
    for mark in marks:
        gm.graph.erase_node(mark)
    if marks:
        gm.graph.lint()
        gm.recompile()


def graph_output(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def copy_node_provenance(sources: list[fx.Node], target: fx.Node) -> None:
    """Give an inserted node the provenance (stack trace, module path) of the nodes it
    consumes, first found first, so error messages and dumps point at the user's code."""
    for key in _PROVENANCE_KEYS:
        found = next((s.meta[key] for s in sources if key in s.meta), None)
        if found is not None:
            target.meta[key] = found
