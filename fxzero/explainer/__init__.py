"""``fxzero.explain``: what fxzero will do to a model, as text, before any training.

Why: fxzero's work is invisible in a training loop. Buckets are laid out once, and the
graph passes insert ``fxzero::wait_params`` / ``fxzero::grads_ready`` calls into
compiled graphs that no user writes. Tuning ``bucket_size``, spotting a bucket whose
padding wastes bandwidth, or checking that a reduce-scatter launches early in backward
(overlap) or that a bucket spans a graph break all need that hidden state shown.

:func:`explain` compiles the model, runs one forward+backward under
:meth:`~fxzero.DistributedOptimizer.no_sync` (no collective is launched), records every
graph *after* fxzero's passes through the backend's ``recorder`` option (scoped to this
one compile: nothing registered process-wide), then zeroes the grads so training state
is unchanged. It compiles through a wrapper function of its own and never resets Dynamo:
the compiled graphs of the user's process survive an explain. It returns a bucket table, every graph's code
with fxzero's inserted nodes marked and named by bucket and params named by module
path, a per-bucket schedule, and every collective of a step: fxzero's over the data-parallel
group and the model's own in its graphs (tensor parallel's), with the ranks of each group
(:mod:`fxzero.explainer.format` renders them).
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx

from . import format as _format
from ..dump import GraphDumper, InsertedNode, inserted_nodes
from ..optim.mesh import local_of

__all__ = ["explain"]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A snapshot of one AOT graph after fxzero's passes (taken before inner compile)."""

    kind: str
    code: str
    placeholders: tuple[str, ...]
    total: int
    """Nodes in the graph, placeholders and output included: the schedule's 100%."""
    inserted: tuple[InsertedNode, ...]


@dataclasses.dataclass
class Graph:
    """One Dynamo graph (one param binding of it): what fxzero knew and what it made."""

    dumper: GraphDumper
    """Its owners, managed params (by forward position) and Dynamo input names."""
    parts: dict[str, Recorded] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Explained:
    """Everything :func:`explain` prints, as data (the formatter reads only this)."""

    optimizer: Any
    graphs: list[Graph]
    names: dict[int, str]
    """``id(param)`` -> module path, as ``model.named_parameters()`` spells it."""

    def bucket_of(self, graph: Graph, node: InsertedNode) -> Optional[int]:
        """The bucket behind a node inserted in ``graph``, if it belongs to this optimizer."""
        return node.bucket if graph.dumper.owners[node.owner] is self.optimizer else None

    def params_of(self, graph: Graph) -> list[tuple[str, str, int]]:
        """``(forward placeholder, module path, bucket)`` of this optimizer's params in ``graph``."""
        forward = graph.parts.get("forward")
        if forward is None:
            return []
        owners = graph.dumper.owners
        found = []
        for m in sorted(graph.dumper.managed, key=lambda m: m.position):
            if owners[m.owner] is self.optimizer and m.position < len(forward.placeholders):
                param = graph.dumper.param(m.position)
                found.append((forward.placeholders[m.position], self.names.get(id(param), "?"), m.bucket))
        return found

    def buckets_of(self, graph: Graph) -> list[int]:
        """Buckets of this optimizer with a param read by ``graph``."""
        return sorted({bucket for _, _, bucket in self.params_of(graph)})


def _snapshot(kind: str, gm: fx.GraphModule) -> Recorded:
    nodes = list(gm.graph.nodes)
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    return Recorded(kind, gm.code, placeholders, len(nodes), inserted_nodes(gm))


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


def _run_once(model: torch.nn.Module, inputs: Sequence[Any], optimizer: Any, options: dict[str, Any]) -> list[Graph]:
    recording = _Recording()
    # dynamic=False: shapes as a first compile sees them. Dynamo's shape profile is kept per
    # function name and line, so a previous explain in the process (other shapes) would
    # otherwise make this one compile with dynamic shapes: other graphs than a training run's.
    compiled = torch.compile(_own_frame(model), backend="fxzero", dynamic=False, options={**options, "recorder": recording})
    with optimizer.no_sync():
        out = compiled(*inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
    optimizer.zero_grad()
    return recording.graphs


def _own_frame(model: torch.nn.Module) -> Any:
    """``model(*args)`` in a frame of this explain's own: Dynamo compiles it afresh, leaving
    the user's entries. Its code object is made for this call: Dynamo keeps compiled frames
    per code object, and with one shared by every explain, explains of other models or
    shapes would pile up on it until Dynamo's recompile limit."""

    def run(*args: Any) -> Any:
        return model(*args)

    return types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__)


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    """``id`` -> module path of every param, and of each DTensor param's local tensor too
    (what a compiled graph's inputs and fxzero's buffers hold of it)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
        names.setdefault(id(local_of(param)), name)
    return names


def _check_arguments(model: Any, optimizer: Any, inner_compiler: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxzero.explain: model must be a torch.nn.Module, got {type(model).__name__}")
    if not hasattr(optimizer, "_bind") or not hasattr(optimizer, "buckets"):
        raise TypeError(
            f"fxzero.explain: optimizer must be a fxzero.DistributedOptimizer, got {type(optimizer).__name__}"
        )
    if inner_compiler not in ("eager", "inductor"):
        raise ValueError(f"fxzero.explain: inner_compiler must be 'eager' or 'inductor', got {inner_compiler!r}")


def explain(
    model: torch.nn.Module,
    *example_inputs: Any,
    optimizer: Any,
    inner_compiler: str = "eager",
    dump_dir: Union[str, "os.PathLike[str]", None] = None,
) -> str:
    """Compile ``model``, run one forward+backward under ``optimizer.no_sync()`` and
    return the bucket table, every compiled graph after fxzero's passes (inserted nodes
    marked) and the per-bucket schedule. Grads are zeroed afterwards; params untouched.

    ``inner_compiler="inductor"`` shows the graphs as a real run compiles them (Inductor's
    decompositions and partitioner: different, longer code); ``"eager"`` is much faster.
    ``dump_dir`` also writes the graphs before and after each pass there (as the
    backend's ``dump_dir`` option does)."""
    _check_arguments(model, optimizer, inner_compiler)
    options: dict[str, Any] = {"inner_compiler": inner_compiler}
    if dump_dir is not None:
        options["dump_dir"] = dump_dir
    graphs = _run_once(model, example_inputs, optimizer, options)
    return _format.render(Explained(optimizer, graphs, _param_names(model)))
