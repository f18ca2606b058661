"""Backward pass: launch each bucket's reduce-scatter right after its last gradient.

In an AOTAutograd backward graph, output ``i`` is the gradient of forward input ``i``.
For the outputs that are managed params, this pass

1. plans, per bucket, the node that produces the bucket's **last** gradient in this
   graph (graph order), as plain data (:func:`plan_launches`, testable without graphs);
2. inserts right after it one ``fxzero::grads_ready(grads, handle)`` call, which adds
   those gradients into ``main_grad`` and lets the runtime launch the bucket's async
   reduce-scatter while the rest of backward computes (:func:`insert_launches`);
3. replaces those outputs by ``None`` so autograd never accumulates them again;
4. checks the contract: every managed gradient feeds exactly one launch, and launches
   are ordered by (graph position, bucket index), never by hashing.

::

    mm_3 = aten.mm(t_6, primals_3)       # last grad of bucket 0 in this graph
    grads_ready([view_1, mm_3], 0)       # <- inserted: bucket 0's handle
    ...
    return (None, None, primals_4_grad)  # managed outputs become None
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from .matchers import copy_node_provenance, graph_output, is_grads_ready

__all__ = ["BucketLaunch", "LaunchPlan", "ManagedParam", "bucket_reduce_scatter_pass", "insert_launches", "plan_launches"]


@dataclasses.dataclass(frozen=True)
class ManagedParam:
    """A backward output that is the gradient of a managed param."""

    position: int
    """Backward output index (= forward input index)."""
    owner: int
    """Index of the param's GradSync among the graph's owners."""
    bucket: int
    slot: int


@dataclasses.dataclass(frozen=True)
class BucketLaunch:
    owner: int
    bucket: int
    positions: tuple[int, ...]
    """Backward output positions of the bucket's gradients in this graph."""
    after: int
    """Index (graph order) of the node producing the last of them."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    launches: tuple[BucketLaunch, ...]
    """In insertion order: by ``after``, then owner and bucket index."""

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(p for launch in self.launches for p in launch.positions)


def plan_launches(managed: Sequence[ManagedParam], producer: Mapping[int, int]) -> LaunchPlan:
    """Group managed gradients by bucket; each launch goes after its last producer.

    ``producer`` maps an output position to the graph index of the node producing it;
    positions missing from it have no gradient in this graph and are left alone.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for grad in sorted(managed, key=lambda g: g.position):
        if grad.position in producer:
            groups.setdefault((grad.owner, grad.bucket), []).append(grad.position)
    launches = [
        BucketLaunch(owner, bucket, tuple(positions), max(producer[p] for p in positions))
        for (owner, bucket), positions in groups.items()
    ]
    launches.sort(key=lambda launch: (launch.after, launch.owner, launch.bucket))
    return LaunchPlan(tuple(launches))


def grad_producers(gm: fx.GraphModule) -> dict[int, int]:
    """Output position -> graph index of the node producing that gradient."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    outputs = graph_output(gm.graph).args[0]
    return {pos: index[node] for pos, node in enumerate(outputs) if isinstance(node, fx.Node)}


def insert_launches(gm: fx.GraphModule, plan: LaunchPlan, handles: Sequence[int]) -> fx.GraphModule:
    """Insert ``grads_ready`` for each planned launch; managed outputs become ``None``."""
    graph = gm.graph
    nodes = list(graph.nodes)
    output = graph_output(graph)
    grads = list(output.args[0])
    last_placeholder = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)
    anchor_of: dict[int, fx.Node] = {}
    for launch, handle in zip(plan.launches, handles):
        at = max(launch.after, last_placeholder)
        anchor = anchor_of.get(at, nodes[at])
        sources = [grads[p] for p in launch.positions]
        with graph.inserting_after(anchor):
            call = graph.call_function(torch.ops.fxzero.grads_ready.default, (sources, handle))
        call.meta["val"] = None
        copy_node_provenance([nodes[launch.after], *sources], call)
        anchor_of[at] = call
    for position in plan.positions:
        grads[position] = None
    output.args = (tuple(grads),)
    graph.lint()
    gm.recompile()
    return gm


def check_launch_contract(gm: fx.GraphModule, plan: LaunchPlan, managed: Sequence[ManagedParam]) -> None:
    """Every managed gradient feeds exactly one launch, in the planned order."""
    calls = [n for n in gm.graph.nodes if is_grads_ready(n)]
    if len(calls) != len(plan.launches):
        raise RuntimeError(f"fxzero: backward graph has {len(calls)} bucket launches, planned {len(plan.launches)}")
    positions = plan.positions
    if len(set(positions)) != len(positions):
        raise RuntimeError(f"fxzero: a managed gradient feeds more than one bucket launch: {sorted(positions)}")
    keys = [(launch.after, launch.owner, launch.bucket) for launch in plan.launches]
    if keys != sorted(keys):
        raise RuntimeError("fxzero: bucket launches are not in (graph order, bucket) order")
    outputs = graph_output(gm.graph).args[0]
    leaked = [g.position for g in managed if outputs[g.position] is not None]
    if leaked:
        raise RuntimeError(f"fxzero: managed gradients at outputs {leaked} still go to autograd")


def bucket_reduce_scatter_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    managed: Sequence[ManagedParam],
    register: Callable[[BucketLaunch], int],
) -> fx.GraphModule:
    """Plan, register (``register`` returns an op handle per launch), rewrite, check."""
    if not managed:
        return gm
    plan = plan_launches(managed, grad_producers(gm))
    handles = [register(launch) for launch in plan.launches]
    insert_launches(gm, plan, handles)
    check_launch_contract(gm, plan, [g for g in managed if g.position in plan.positions])
    return gm

