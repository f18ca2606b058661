"""Forward pass: wait for each bucket's param all-gather right before its first read.

With ``Config.overlap_param_gather`` the param all-gathers are still in flight when
``step()`` returns. In a compiled forward graph this pass

1. plans, per bucket, the first node (graph order) that reads any of its params, as
   plain data (:func:`plan_waits`);
2. inserts ``fxzero::wait_params(params)`` right before it, ``params`` being this
   graph's inputs of that bucket; the op waits for the bucket's gather and lands it.
   Only params whose optimizer overlaps its gathers with the forward are given to the pass
   (:mod:`fxzero.graph_compiler`): without overlap the step finishes every gather.

The order is a data dependency, not a lucky schedule: the op's schema declares that it
**writes** ``params`` (``Tensor(a!)[]``), so a compiler must keep every read of them that
follows the wait after it. Inductor's scheduler does so through its mutation tracking:
a kernel that reads a param after the wait depends on the wait, whatever it is fused
into. (An ordering-only edge is not enough: Inductor's ``control_deps`` only orders the
kernels materialized while lowering the wrapped node, and a pointwise read such as an
RMSNorm weight multiply is inlined into a later fused kernel that carries no edge.)
Inductor rewrites the FX graph after fxzero's passes; :func:`hoist_waits_above_readers`
runs as its last post-grad pass and moves a wait back above any read placed before it.

::

    wait_params_default = fxzero.wait_params([primals_1, primals_2])   # <- inserted
    t = aten.t(primals_1)
    addmm = aten.addmm(primals_2, primals_3, t)   # reads the gathered weight and bias

A param only saved for backward (no reader in the forward) still gets its wait, just
before the output, so the backward never reads stale values.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Collection, Mapping, Sequence

import torch
import torch.fx as fx

from .bucket_reduce_scatter import ManagedParam
from .matchers import WAIT_META, copy_node_provenance, graph_output, is_wait_params, remove_module_marks

__all__ = ["GatherWait", "WaitPlan", "hoist_waits_above_readers", "param_gather_wait_pass", "params_returned", "plan_waits"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GatherWait:
    manager_index: int
    bucket: int
    positions: tuple[int, ...]
    """Forward input positions of the bucket's params in this graph."""
    before: int
    """Graph index of the node the wait goes in front of (the first reader)."""
    readers: tuple[int, ...]
    """Graph indices of every node that reads one of those params."""


@dataclasses.dataclass(frozen=True)
class WaitPlan:
    waits: tuple[GatherWait, ...]
    """By ``before``, then manager index and bucket."""


def plan_waits(managed: Sequence[ManagedParam], readers: Mapping[int, Sequence[int]], output: int) -> WaitPlan:
    """Group the params' readers by bucket; each wait precedes the bucket's first reader
    (or the output node, when the forward only saves the params for backward)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for param in sorted(managed, key=lambda g: g.position):
        groups.setdefault((param.manager_index, param.bucket), []).append(param.position)
    waits = []
    for (manager_index, bucket), positions in groups.items():
        reads = sorted({r for p in positions for r in readers.get(p, ())})
        waits.append(GatherWait(manager_index, bucket, tuple(positions), reads[0] if reads else output, tuple(reads)))
    waits.sort(key=lambda w: (w.before, w.manager_index, w.bucket))
    return WaitPlan(tuple(waits))


def param_readers(gm: fx.GraphModule) -> tuple[dict[int, list[int]], int]:
    """Placeholder position -> graph indices of the call nodes reading it; output index."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    readers = {p: sorted(index[u] for u in node.users if u.op == "call_function") for p, node in enumerate(placeholders)}
    return readers, index[graph_output(gm.graph)]


def insert_waits(gm: fx.GraphModule, plan: WaitPlan) -> fx.GraphModule:
    """Insert ``fxzero::wait_params(params)`` before each bucket's first reader.

    The op's schema declares ``params`` mutated: for every compiler that is a write to
    those inputs, so every read of them that follows in the graph is ordered after it
    (Inductor's scheduler renames a mutated buffer and makes each later reader depend on
    the mutation, whatever kernel the read is fused into)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for wait in plan.waits:
        params = [placeholders[p] for p in wait.positions]
        with graph.inserting_before(nodes[wait.before]):
            call = graph.call_function(torch.ops.fxzero.wait_params.default, (params,))
        call.meta["val"] = None
        call.meta[WAIT_META] = (wait.manager_index, wait.bucket)
        copy_node_provenance([nodes[wait.before]], call)
    graph.lint()
    gm.recompile()
    return gm


def early_readers(wait: fx.Node, index: Mapping[fx.Node, int]) -> list[fx.Node]:
    """Nodes that read one of ``wait``'s params but come before it in ``graph``."""
    params = wait.args[0]
    return [u for p in params for u in p.users if u is not wait and index[u] < index[wait]]


def hoist_waits_above_readers(graph: fx.Graph) -> int:
    """Move each wait right above the first node that reads its params, if another pass
    (Inductor's pattern rewrites run after fxzero's) put a reader above it; returns how
    many waits moved. A wait's inputs are placeholders, so it can move up freely."""
    moved = 0
    for wait in [n for n in graph.nodes if is_wait_params(n)]:
        index = {node: i for i, node in enumerate(graph.nodes)}
        readers = early_readers(wait, index)
        if readers:
            min(readers, key=index.__getitem__).prepend(wait)
            moved += 1
    if moved:
        log.info("moved %d param-gather wait(s) above reads that a later pass put before them", moved)
        graph.lint()
    return moved


def params_returned(gm: fx.GraphModule, positions: Collection[int]) -> tuple[int, ...]:
    """Output positions of the forward that return the managed param at one of the input
    ``positions`` (saved for the backward). A compiler must return those exactly as it got
    them: a copy of one (Inductor's channels-last copy of a conv weight) would be made when
    the input is lowered, before any wait, and would hand the backward last step's values;
    and the backward's hand-off (``fxzero::grads_ready``) takes only the params themselves."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    managed = {placeholders[p] for p in positions}
    outputs = graph_output(gm.graph).args[0]
    return tuple(i for i, node in enumerate(outputs) if node in managed)


def param_gather_wait_pass(
    gm: fx.GraphModule, example_inputs: Sequence[object], *, managed: Sequence[ManagedParam]
) -> fx.GraphModule:
    """Plan (a module-entry mark counts as a reader of its module's params, so a wait
    precedes it), rewrite, drop the marks."""
    if managed:
        readers, output = param_readers(gm)
        insert_waits(gm, plan_waits(managed, readers, output))
    remove_module_marks(gm)
    return gm
