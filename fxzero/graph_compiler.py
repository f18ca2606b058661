"""AOTAutograd's hooks for one Dynamo graph: fxzero's passes, then the inner compiler.

Graph inputs that are params managed by a :class:`fxzero.DistributedOptimizer` are found
by identity (``optimizer.runtime.binding.describe(example_inputs)``). The joint graph gets the bucket launches
(:mod:`fxzero.passes.bucket_reduce_scatter`), the forward the all-gather waits
(:mod:`fxzero.passes.param_gather_wait`) of the optimizers that overlap their gathers with
the forward; then Inductor (or nothing, for ``"eager"``) compiles them. Where a graph has
no wait for a param's optimizer (overlap off when it compiled, or no optimizer yet), its
counting wrapper lands that optimizer's gathers before each run instead. A
:class:`GraphCompiler` keeps plain data (positions, plans) and, only when someone asked for
one, a dump record: never an optimizer. At run time the ops find
the optimizer through the params (:mod:`fxzero.compiled.binding`).

Each run of the compiled forward tells the managers how many gradients its backward will
deliver per bucket, tied to its autograd node (:func:`~fxzero.compiled.binding.counting_forward`,
:mod:`fxzero.optim.gradients.ledger`). A managed param that has tensor hooks
(``param.register_hook``) when its graph compiles keeps autograd's path in that graph's
backward, so its hooks see the real gradient (the eager post-accumulate hook then moves
it into ``main_grad``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from functorch.compile import default_partition, make_boxed_func

from . import _torch_compat as compat
from . import dump
from .compiled.binding import counting_forward, manager_of
from .compiled.graph_id import GraphId
from .passes import param_gather_wait, run_backward_passes, run_forward_passes, run_joint_passes
from .passes.bucket_reduce_scatter import ManagedParam
from .passes.matchers import is_grads_ready
from .passes.param_gather_wait import hoist_waits_above_readers, params_returned

__all__ = ["GraphCompiler", "GraphPositions", "managed_params"]

log = logging.getLogger(__name__)

Passes = Callable[..., fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class GraphPositions:
    """Where a graph's managed params are, in the two index spaces a compiler meets: Dynamo's
    input positions (``dynamo_*``: what the compiled Dynamo graph is called with) and
    AOTAutograd's flattened ones (``flat_*``: what fxzero's passes index; a DTensor param is
    its local tensor there). One record, so no collection is read in the wrong space."""

    num_flat_inputs: int
    manager_count: int
    """How many optimizers manage params of the graph (``ManagedParam.manager_index`` < this)."""
    flat_handed: tuple[ManagedParam, ...]
    """Those whose gradients the backward hands to fxzero."""
    dynamo_handed: tuple[ManagedParam, ...]
    """The same by Dynamo input position."""
    flat_to_dynamo: Mapping[int, int]
    """A handed param's flattened position -> its Dynamo position."""
    unwaited: frozenset[int]
    """Manager indices whose gathers never overlap a forward: no wait in the graph, the counting
    wrapper checks instead that none is in flight (it runs on every call)."""
    flat_waited: tuple[ManagedParam, ...]
    """Managed params that get a gather wait."""
    flat_returned: frozenset[int]
    """Every managed param: the forward returns them as they are."""
    dynamo_unmanaged: tuple[int, ...]
    """Params no optimizer managed at compile time: one built later has no wait in this graph
    (:func:`~fxzero.compiled.binding.counting_forward` checks for that on every call)."""

    @classmethod
    def of(cls, example_inputs: Sequence[Any], managed: Sequence[ManagedParam], forward_waits: Sequence[bool],
           hooked: frozenset[int]) -> "GraphPositions":  # fmt: skip
        """A DTensor param's gradient keeps autograd's path (the eager post-accumulate hook
        takes it, in its own placement): AOTAutograd rebuilds each gradient of a DTensor input
        as a DTensor from the backward's outputs, and the hand-off's None there fails in
        DTensor.__tensor_unflatten__. So does a param with tensor hooks (``hooked``), so that
        they see its gradient; both still get their gather waits."""
        flat, num_inputs = compat.flat_input_positions(example_inputs)
        handed = tuple(m for m in managed if not compat.is_dtensor(example_inputs[m.position]) and m.position not in hooked)
        unwaited = frozenset(m.manager_index for m in handed if not forward_waits[m.manager_index])
        known = {m.position for m in managed}
        return cls(
            num_flat_inputs=num_inputs,
            manager_count=len(forward_waits),
            flat_handed=tuple(dataclasses.replace(m, position=flat[m.position]) for m in handed),
            dynamo_handed=handed,
            flat_to_dynamo={flat[m.position]: m.position for m in handed},
            unwaited=unwaited,
            flat_waited=tuple(dataclasses.replace(m, position=flat[m.position]) for m in managed if m.manager_index not in unwaited),
            flat_returned=frozenset(flat[m.position] for m in managed),
            dynamo_unmanaged=tuple(i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter) and i not in known),
        )

    def dynamo_groups(self) -> list[tuple[int, ...]]:
        """Each manager's handed params, by Dynamo position (what the counting wrapper reports)."""
        return [tuple(m.position for m in self.dynamo_handed if m.manager_index == i) for i in range(self.manager_count)]


class GraphCompiler:
    """The passes and the inner compiler for one Dynamo graph (its ``example_inputs``)."""

    def __init__(
        self,
        positions: GraphPositions,
        *,
        inductor: Optional[compat.InductorCompilers],
        dumper: Optional[dump.GraphDumper],
        graph_id: GraphId,
    ) -> None:
        self.positions = positions
        self.inductor, self.dumper = inductor, dumper
        self.id = graph_id
        """The graph's one id (:mod:`fxzero.compiled.graph_id`), its dump's and explain's too."""
        self.delivered: frozenset[int] = frozenset()
        """Forward input positions (Dynamo's) whose gradients the backward hands to fxzero:
        known once the joint graph is partitioned, which AOTAutograd does before it returns."""

    @classmethod
    def for_graph(
        cls,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        inner_compiler: Literal["inductor", "eager"],
        dump_dir: Union[str, "os.PathLike[str]", None] = None,
        recorder: Optional[dump.Recorder] = None,
    ) -> "GraphCompiler":
        """Find the managed params among ``example_inputs``; build a dumper only when a
        dump directory, ``TORCH_TRACE``, the ``fxzero`` INFO log or a recorder wants one."""
        graph_id = GraphId.of_this_compile()
        managers, managed, forward_waits = managed_params(example_inputs)
        if not managed:
            _warn_if_unmanaged(example_inputs, graph_id)
        names = compat.dynamo_input_names(gm)
        for m in managed:  # messages about a param built without a name can give its module path
            managers[m.manager_index].param_table.learn_alias(example_inputs[m.position], names[m.position])
        hooked = _hooked_positions(example_inputs, managed, names)
        dumper = None
        if recorder is not None or dump.resolve_dump_dir(dump_dir) is not None or compat.tracing() or dump.log.isEnabledFor(logging.INFO):
            dumper = dump.GraphDumper(dump_dir, managers, managed, names, example_inputs, recorder, graph_id)
        inductor = compat.InductorCompilers(gm, len(example_inputs)) if inner_compiler == "inductor" else None
        positions = GraphPositions.of(example_inputs, managed, forward_waits, frozenset(hooked))
        return cls(positions, inductor=inductor, dumper=dumper, graph_id=graph_id)

    # ---- AOTAutograd's hooks ---------------------------------------------------------
    def partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        # AOTAutograd also partitions higher-order-op subgraphs with this function: only the
        # graph whose primals are our inputs gets the launches.
        primals = joint_inputs[0] if isinstance(joint_inputs, tuple) and len(joint_inputs) == 2 else ()
        positions = self.positions
        if len(primals) == positions.num_flat_inputs:
            passes = functools.partial(run_joint_passes, managed=list(positions.flat_handed), num_fwd_outputs=kwargs["num_fwd_outputs"])
            joint = self._run("joint", joint, joint_inputs, passes)
            self.delivered = frozenset(positions.flat_to_dynamo[p] for p in _delivered_positions(joint))
        inner = compat.inductor_partition if self.inductor is not None else default_partition
        return inner(joint, joint_inputs, **kwargs)

    def forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self._forward_graph("forward", gm, example_inputs)

    def inference(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self._forward_graph("inference", gm, example_inputs)

    def backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self._run("backward", gm, example_inputs, run_backward_passes)
        if self.inductor is None:
            return make_boxed_func(gm.forward)
        return self.inductor.backward(gm, example_inputs)

    def counting(self, compiled: Callable) -> Callable:
        """The compiled Dynamo graph, telling each manager after every run which gradients
        the backward from its outputs will deliver."""
        positions = self.positions
        if not positions.flat_handed and not positions.dynamo_unmanaged:
            return compiled
        groups = positions.dynamo_groups()
        unwaited = [group[0] for index, group in enumerate(groups) if index in positions.unwaited]
        # Dynamo disables the wrapper as it would ``compiled``: one disable layer per call, not two.
        return counting_forward(
            self.id, groups, self.delivered, compat.undisabled(compiled), unwaited=unwaited, unmanaged=positions.dynamo_unmanaged
        )

    # ---- internals ---------------------------------------------------------------------
    def _run(self, kind: str, gm: fx.GraphModule, example_inputs: Any, passes: Passes) -> fx.GraphModule:
        if self.dumper is None:
            return passes(gm, example_inputs)
        return self.dumper.around(kind, gm, lambda g, observe: passes(g, example_inputs, observe=observe))

    def _forward_graph(self, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self._run(kind, gm, example_inputs, functools.partial(run_forward_passes, managed=list(self.positions.flat_waited)))
        if self.inductor is None:
            return make_boxed_func(gm.forward)
        # Inductor's own FX rewrites run after fxzero's passes: the last of them puts any
        # param read they moved above its bucket's wait back below it. The params the
        # forward returns for the backward are returned as they are (no layout copy made
        # at the graph's start, before the waits, nor handed to the backward's hand-off:
        # see compat.InductorCompilers).
        keep = params_returned(gm, self.positions.flat_returned)
        with compat.inductor_post_grad_pass(hoist_waits_above_readers, _pass_uuid()):
            return self.inductor.forward(gm, example_inputs, is_inference=kind == "inference", keep_outputs=keep)


def managed_params(example_inputs: Sequence[Any]) -> tuple[list[Any], list[ManagedParam], tuple[bool, ...]]:
    """The optimizers managing params among ``example_inputs`` (first appearance first),
    those params, as each optimizer's ``runtime.binding`` describes them, and whether a forward must
    wait for each optimizer's gathers."""
    managers: list[Any] = []
    for value in example_inputs:
        manager = manager_of(value)
        if manager is not None and all(manager is not o for o in managers):
            managers.append(manager)
    bindings = [manager.runtime.binding.describe(example_inputs) for manager in managers]
    managed = [
        ManagedParam(position, index, bucket, example_inputs[position].numel())
        for index, binding in enumerate(bindings)
        for position, bucket in zip(binding.positions, binding.buckets)
    ]
    return managers, sorted(managed, key=lambda m: m.position), tuple(b.forward_waits for b in bindings)


def _hooked_positions(example_inputs: Sequence[Any], managed: Sequence[ManagedParam], names: Sequence[str]) -> set[int]:
    """Managed params with tensor hooks: their gradients keep autograd's path, so the hooks see them."""
    hooked = {m.position for m in managed if compat.tensor_hooks(example_inputs[m.position])}
    for position in sorted(hooked):
        log.info("param %s has tensor hooks: its gradient takes autograd's path so they see it", names[position])
    return hooked


def _warn_if_unmanaged(example_inputs: Sequence[Any], graph_id: GraphId) -> None:
    if any(isinstance(x, torch.nn.Parameter) and x.requires_grad for x in example_inputs):
        warnings.warn(
            f"fxzero: the trainable params of compiled graph {graph_id} are not managed by any fxzero.DistributedOptimizer "
            "at this compile, so the graph carries no in-graph gradient hand-off and no gather waits. If you build a "
            "DistributedOptimizer over them, build it before the first compiled call, or call torch.compiler.reset() "
            "after building it so the graph recompiles with them (until then it runs exact but slower). A model no "
            "DistributedOptimizer manages trains as plain torch.compile (gradients go to param.grad); compile it with "
            "another backend to silence this.",
            stacklevel=4,
        )


def _delivered_positions(joint: fx.GraphModule) -> frozenset[int]:
    """Positions of the params whose gradients the joint graph's launches take."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(primals)}
    return frozenset(index[p] for n in joint.graph.nodes if is_grads_ready(n) for p in n.args[1])


@functools.lru_cache(maxsize=None)
def _pass_uuid() -> bytes:
    """Keys Inductor's FX graph cache to the post-grad pass's source."""
    return hashlib.sha256(Path(param_gather_wait.__file__).read_bytes()).digest()
