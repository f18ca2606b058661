"""How :func:`fxzero.explain` sees fxzero's work: one compile and one forward+backward.

Why this way: the graphs fxzero rewrites exist only inside a compile, so explain
compiles the model through the backend's ``recorder`` option (scoped to this one
compile: nothing registered process-wide), runs one forward+backward under
:meth:`~fxzero.DistributedOptimizer.no_sync` (no collective is launched) and snapshots
every AOT graph *after* fxzero's passes, before the inner compiler takes it. The user's
optimizer is left as it was found: its grads are zeroed again and its readiness ledger
restored (:meth:`~fxzero.optim.gradients.ledger.Ledger.kept`), so the next step is the one
it would have been; an optimizer that holds gradients is refused instead (explain's own
would mix with them). Dynamo is never reset (the user's compiled graphs survive an explain).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..dump import GraphDumper, InsertedNode, inserted_nodes
from ..model_output import LossFn, output_tensor
from ..optim.layout.mesh import local_of
from .node_costs import node_costs

__all__ = ["Graph", "Recorded", "param_names", "record"]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A snapshot of one AOT graph after fxzero's passes (taken before inner compile)."""

    kind: str
    code: str
    placeholders: tuple[str, ...]
    total: int
    """Nodes in the graph, placeholders and output included: the schedule's 100%."""
    inserted: tuple[InsertedNode, ...]
    costs: tuple[tuple[float, int], ...] = ()
    """Each node's ``(FLOPs, bytes)``, in node order (:mod:`~fxzero.explainer.node_costs`)."""


@dataclasses.dataclass
class Graph:
    """One Dynamo graph (one param binding of it): what fxzero knew and what it made."""

    dumper: GraphDumper
    """Its managers, managed params (by forward position) and Dynamo input names."""
    parts: dict[str, Recorded] = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        """What the explain output calls it: the graph's one id, also in its dump files,
        its log lines and fxzero's warnings (:mod:`fxzero.compiled.graph_id`)."""
        return self.dumper.graph_id.name


def _snapshot(kind: str, gm: fx.GraphModule) -> Recorded:
    nodes = list(gm.graph.nodes)
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    return Recorded(kind, gm.code, placeholders, len(nodes), inserted_nodes(gm), node_costs(gm))


class _Recording:
    """Snapshots each graph as fxzero's passes finish it, grouped by Dynamo graph (the
    backend's ``recorder``)."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self._by_dumper: dict[int, Graph] = {}

    def __call__(self, dumper: GraphDumper, kind: str, gm: fx.GraphModule) -> None:
        if kind == "joint":  # shown as the forward and backward it is partitioned into
            return
        graph = self._by_dumper.get(dumper.graph_id)
        if graph is None:
            graph = self._by_dumper[dumper.graph_id] = Graph(dumper)
            self.graphs.append(graph)
        graph.parts[kind] = _snapshot(kind, gm)


def record(
    model: torch.nn.Module,
    inputs: Sequence[Any],
    optimizer: Any,
    options: dict[str, Any],
    kwargs: Optional[dict[str, Any]] = None,
    loss_fn: Optional[LossFn] = None,
) -> list[Graph]:
    """Compile ``model`` with the fxzero backend, run one forward+backward without
    collectives, leave ``optimizer`` as it was, and return every graph as fxzero's passes left it.
    The backward starts from the sum of :func:`~fxzero.model_output.output_tensor` (a
    ``ModelOutput``'s loss or logits, a tuple's first tensor, or ``loss_fn(output)``)."""
    _refuse_pending_gradients(optimizer)
    recording = _Recording()
    # dynamic=False: shapes as a first compile sees them. Dynamo's shape profile is kept per
    # function name and line, so a previous explain in the process (other shapes) would
    # otherwise make this one compile with dynamic shapes: other graphs than a training run's.
    compiled = torch.compile(_own_frame(model), backend="fxzero", dynamic=False, options={**options, "recorder": recording})
    with optimizer.runtime.ledger.kept():
        try:
            with optimizer.no_sync():
                out = compiled(*inputs, **(kwargs or {}))
                output_tensor(out, loss_fn, "fxzero.explain").sum().backward()
        finally:
            optimizer.zero_grad()  # it held no gradient (refused otherwise): it holds none again
    return recording.graphs


def _refuse_pending_gradients(optimizer: Any) -> None:
    """Explain's backward adds into the optimizer's grad buffers: gradients already there
    (between a backward and ``step()``, or accumulating microbatches) would be mixed with
    explain's and then zeroed. Refused, naming them."""
    table, ledger = optimizer.param_table, optimizer.runtime.ledger
    held = [slot for slot, p in enumerate(table.params) if p.grad is not None or (ledger.written and ledger.presence[slot])]
    if held:
        raise RuntimeError(
            f"fxzero.explain: the optimizer holds gradients not yet stepped, of {table.describe(held)}; explain "
            "runs a backward of its own into the same buffers. Call it before the backward, or after "
            "optimizer.step() or optimizer.zero_grad()."
        )


def _own_frame(model: torch.nn.Module) -> Any:
    """``model(*args)`` in a frame of this explain's own: Dynamo compiles it afresh, leaving
    the user's entries. Its code object is made for this call: Dynamo keeps compiled frames
    per code object, and with one shared by every explain, explains of other models or
    shapes would pile up on it until Dynamo's recompile limit."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    return types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """``id`` -> module path of every param, and of each DTensor param's local tensor too
    (what a compiled graph's inputs and fxzero's buffers hold of it)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
        names.setdefault(id(local_of(param)), name)
    return names
