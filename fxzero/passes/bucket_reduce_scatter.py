"""Backward pass: gradients into ``main_grad`` as they are produced; each bucket's
reduce-scatter launched right after its last gradient.

It runs on AOTAutograd's **joint** graph, before partitioning, where the gradient of
forward input ``i`` is output ``num_fwd_outputs + i`` and the managed params are primal
placeholders. For the managed gradients it

1. plans, as plain data (:func:`plan_launches`, testable without graphs), the *hand-offs*:
   each bucket's gradients in the order their producers run, cut into groups of at least
   :data:`HANDOFF_NUMEL` elements (a gradient larger than that is a group of its own), each
   placed after its last producer. A gradient therefore lives only until its group is
   handed off, not until the bucket's last gradient: with one hand-off per bucket, a
   40M-element bucket kept every gradient of the model alive through backward;
2. inserts right after each group's last producer ``token = fxzero::grads_ready(grads,
   params)``: the op adds the gradients into ``main_grad`` (they die right after) and
   reports them; the bucket's last hand-off lets the optimizer launch its async
   reduce-scatter while the rest of backward computes (:func:`insert_launches`);
3. routes ``token`` to the group's first gradient output and makes its other gradient
   outputs ``None``. An output is what keeps the op in the backward graph when AOTAutograd
   partitions, and the partitioner then saves the op's inputs for the backward, the params
   included (free: they are graph inputs). So the op receives the params themselves at
   run time, and one compiled graph serves every param set it is called with;
4. checks the contract: every managed gradient feeds exactly one hand-off, in (graph
   position, bucket) order, never by hashing.

After partitioning, :func:`release_launch_outputs_pass` (on the backward graph) turns the tokens
back into ``None`` outputs, so autograd never sees those gradients, and puts each launch
right after its last gradient again (partitioners may reorder the backward)::

    mm_3 = aten.mm(t_6, primals_3)                            # last grad of bucket 0
    grads_ready = fxzero.grads_ready([view_1, mm_3], [primals_2, primals_3])   # <- inserted
    ...
    return (None, None, primals_4_grad)                       # managed outputs are None
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
import torch.fx as fx

from .matchers import LAUNCH_META, copy_node_provenance, graph_output, is_grads_ready, remove_module_marks

__all__ = [
    "HANDOFF_NUMEL",
    "BucketLaunch",
    "LaunchPlan",
    "ManagedParam",
    "bucket_reduce_scatter_pass",
    "insert_launches",
    "plan_launches",
    "release_launch_outputs_pass",
]


HANDOFF_NUMEL = 1 << 20
"""Elements of gradient a hand-off waits for before it is made (4 MiB of fp32). Each
hand-off is one call into Python (tens of microseconds); the gradients of a group stay alive until it.
So small gradients (norms, biases) share a call, and a matrix's gradient goes into
``main_grad`` right after the node that produced it."""


@dataclasses.dataclass(frozen=True)
class ManagedParam:
    """A forward input that is a param some optimizer manages."""

    position: int
    """Forward input index (= gradient index)."""
    manager_index: int
    """Index of its manager (the DistributedOptimizer) among the graph's managers."""
    bucket: int
    """Its bucket at compile time (plans group by it)."""
    numel: int = 0
    """Its number of elements (what a hand-off counts)."""


@dataclasses.dataclass(frozen=True)
class BucketLaunch:
    """One hand-off: a group of one bucket's gradients; the bucket's last launches it."""

    manager_index: int
    bucket: int
    positions: tuple[int, ...]
    """Forward input positions of the group's gradients in this graph."""
    after: int
    """Index (graph order) of the node producing the last of them."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    launches: tuple[BucketLaunch, ...]
    """In insertion order: by ``after``, then manager index and bucket index."""

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(p for launch in self.launches for p in launch.positions)


def plan_launches(
    managed: Sequence[ManagedParam], producer: Mapping[int, int], *, handoff_numel: int = HANDOFF_NUMEL
) -> LaunchPlan:
    """Cut each bucket's gradients, in producer order, into hand-offs of at least
    ``handoff_numel`` elements (the last may be smaller; 0: one per gradient); each goes
    after its last producer.

    ``producer`` maps a gradient position to the graph index of the node producing it;
    positions missing from it have no gradient in this graph and are left alone.
    """
    buckets: dict[tuple[int, int], list[ManagedParam]] = {}
    for grad in sorted(managed, key=lambda g: (producer.get(g.position, -1), g.position)):
        if grad.position in producer:
            buckets.setdefault((grad.manager_index, grad.bucket), []).append(grad)
    launches = []
    for (manager_index, bucket), grads in buckets.items():
        for group in _cut(grads, handoff_numel):
            positions = tuple(sorted(g.position for g in group))
            launches.append(BucketLaunch(manager_index, bucket, positions, max(producer[p] for p in positions)))
    launches.sort(key=lambda launch: (launch.after, launch.manager_index, launch.bucket))
    return LaunchPlan(tuple(launches))


def _cut(grads: Sequence[ManagedParam], numel: int) -> list[list[ManagedParam]]:
    """Consecutive groups, each closed once it holds ``numel`` elements (the rest: one more)."""
    groups: list[list[ManagedParam]] = [[]]
    held = 0
    for grad in grads:
        if held >= numel and groups[-1]:
            groups.append([])
            held = 0
        groups[-1].append(grad)
        held += grad.numel
    return groups


def grad_producers(gm: fx.GraphModule, num_fwd_outputs: int) -> dict[int, int]:
    """Gradient position -> graph index of the node producing that gradient."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    grads = graph_output(gm.graph).args[0][num_fwd_outputs:]
    return {pos: index[node] for pos, node in enumerate(grads) if isinstance(node, fx.Node)}


def insert_launches(gm: fx.GraphModule, plan: LaunchPlan, num_fwd_outputs: int) -> fx.GraphModule:
    """Insert ``grads_ready`` for each planned launch; route the tokens to the outputs."""
    graph = gm.graph
    nodes = list(graph.nodes)
    primals = [n for n in nodes if n.op == "placeholder"]
    output = graph_output(graph)
    outputs = list(output.args[0])
    last_placeholder = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)
    anchor_of: dict[int, fx.Node] = {}
    for launch in plan.launches:
        at = max(launch.after, last_placeholder)
        grads = [outputs[num_fwd_outputs + p] for p in launch.positions]
        with graph.inserting_after(anchor_of.get(at, nodes[at])):
            call = graph.call_function(torch.ops.fxzero.grads_ready.default, (grads, [primals[p] for p in launch.positions]))
        call.meta["val"] = torch.empty(0, device=grads[0].meta["val"].device) if "val" in grads[0].meta else None
        call.meta[LAUNCH_META] = (launch.manager_index, launch.bucket)
        copy_node_provenance([nodes[launch.after], *grads], call)
        anchor_of[at] = call
        for k, position in enumerate(launch.positions):
            outputs[num_fwd_outputs + position] = call if k == 0 else None
    output.args = (tuple(outputs),)
    graph.lint()
    gm.recompile()
    return gm


def check_launch_contract(gm: fx.GraphModule, plan: LaunchPlan, num_fwd_outputs: int) -> None:
    """Every managed gradient feeds exactly one launch, in the planned order."""
    calls = [n for n in gm.graph.nodes if is_grads_ready(n)]
    if len(calls) != len(plan.launches):
        raise RuntimeError(f"fxzero: backward graph has {len(calls)} bucket launches, planned {len(plan.launches)}")
    positions = plan.positions
    if len(set(positions)) != len(positions):
        raise RuntimeError(f"fxzero: a managed gradient feeds more than one bucket launch: {sorted(positions)}")
    keys = [(launch.after, launch.manager_index, launch.bucket) for launch in plan.launches]
    if keys != sorted(keys):
        raise RuntimeError("fxzero: bucket launches are not in (graph order, bucket) order")
    grads = graph_output(gm.graph).args[0][num_fwd_outputs:]
    leaked = [p for p in positions if grads[p] is not None and not is_grads_ready(grads[p])]
    if leaked:
        raise RuntimeError(f"fxzero: managed gradients at outputs {leaked} still go to autograd")


def bucket_reduce_scatter_pass(
    gm: fx.GraphModule, example_inputs: Sequence[object], *, managed: Sequence[ManagedParam], num_fwd_outputs: int
) -> fx.GraphModule:
    """Drop the module-entry marks, plan, rewrite, check (on the joint graph)."""
    remove_module_marks(gm)
    if not managed:
        return gm
    plan = plan_launches(managed, grad_producers(gm, num_fwd_outputs), handoff_numel=HANDOFF_NUMEL)
    insert_launches(gm, plan, num_fwd_outputs)
    check_launch_contract(gm, plan, num_fwd_outputs)
    return gm


def release_launch_outputs_pass(gm: fx.GraphModule, example_inputs: Sequence[object], **_: object) -> fx.GraphModule:
    """On the partitioned backward: launch tokens leave the outputs (autograd gets
    ``None`` for those params) and each launch sits right after its last gradient."""
    graph = gm.graph
    output = graph_output(graph)
    if not any(isinstance(n, fx.Node) and is_grads_ready(n) for n in output.args[0]):
        return gm
    output.args = (tuple(None if isinstance(n, fx.Node) and is_grads_ready(n) else n for n in output.args[0]),)
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    last_placeholder = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)
    after = {n: max(last_placeholder, *(index[i] for i in n.all_input_nodes)) for n in nodes if is_grads_ready(n)}
    anchor_of: dict[int, fx.Node] = {}
    for launch in sorted(after, key=lambda n: (after[n], n.meta.get(LAUNCH_META, ()))):
        anchor_of.get(after[launch], nodes[after[launch]]).append(launch)
        anchor_of[after[launch]] = launch
    graph.lint()
    gm.recompile()
    return gm
