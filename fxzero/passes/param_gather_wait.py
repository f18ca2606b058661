"""Forward pass: wait for each bucket's param all-gather right before its first read.

After ``step()`` the param all-gathers are in flight (prefetched one bucket ahead). In
a compiled forward graph this pass

1. plans, per bucket, the first node (graph order) that reads any of its params, as
   plain data (:func:`plan_waits`);
2. inserts ``token = fxzero::wait_params(handle)`` right before it; the op waits for
   the bucket's gather and launches the next bucket's (the prefetch chain);
3. makes **every** reader of the bucket's params depend on ``token`` through
   Inductor's ``control_deps`` higher-order op, so no compiled kernel can be scheduled
   before the wait: the order is a graph edge, not a lucky schedule.

::

    wait_params_default = fxzero.wait_params(H)              # <- inserted
    t = control_deps((wait_params_default,), subgraph_t, primals_1)
    addmm = aten.addmm(primals_2, primals_3, t)              # reads the gathered weight

A param only saved for backward (no reader in the forward) still gets its wait, just
before the output, so the backward never reads stale values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from .bucket_reduce_scatter import ManagedParam
from .matchers import copy_node_provenance, graph_output

__all__ = ["GatherWait", "WaitPlan", "param_gather_wait_pass", "plan_waits"]


@dataclasses.dataclass(frozen=True)
class GatherWait:
    owner: int
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
    """By ``before``, then owner and bucket."""


def plan_waits(managed: Sequence[ManagedParam], readers: Mapping[int, Sequence[int]], output: int) -> WaitPlan:
    """Group the params' readers by bucket; each wait precedes the bucket's first reader
    (or the output node, when the forward only saves the params for backward)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for param in sorted(managed, key=lambda g: g.position):
        groups.setdefault((param.owner, param.bucket), []).append(param.position)
    waits = []
    for (owner, bucket), positions in groups.items():
        reads = sorted({r for p in positions for r in readers.get(p, ())})
        waits.append(GatherWait(owner, bucket, tuple(positions), reads[0] if reads else output, tuple(reads)))
    waits.sort(key=lambda w: (w.before, w.owner, w.bucket))
    return WaitPlan(tuple(waits))


def param_readers(gm: fx.GraphModule) -> tuple[dict[int, list[int]], int]:
    """Placeholder position -> graph indices of the call nodes reading it; output index."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    readers = {p: sorted(index[u] for u in node.users if u.op == "call_function") for p, node in enumerate(placeholders)}
    return readers, index[graph_output(gm.graph)]


def insert_waits(gm: fx.GraphModule, plan: WaitPlan, handles: Sequence[int]) -> fx.GraphModule:
    graph = gm.graph
    nodes = list(graph.nodes)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in nodes if n.op == "placeholder"])
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for wait, handle in zip(plan.waits, handles):
        with graph.inserting_before(nodes[wait.before]):
            token = graph.call_function(torch.ops.fxzero.wait_params.default, (handle,))
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            token.meta["val"] = torch.empty(0)
        copy_node_provenance([nodes[wait.before]], token)
        for reader in wait.readers:
            deps.setdefault(nodes[reader], OrderedSet()).add(token)
    preserve_node_ordering(graph, deps)
    graph.lint()
    gm.recompile()
    return gm


def param_gather_wait_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    managed: Sequence[ManagedParam],
    register_wait: Callable[[GatherWait], int],
) -> fx.GraphModule:
    """Plan, register (one op handle per wait), rewrite."""
    if not managed:
        return gm
    readers, output = param_readers(gm)
    plan = plan_waits(managed, readers, output)
    insert_waits(gm, plan, [register_wait(wait) for wait in plan.waits])
    return gm
