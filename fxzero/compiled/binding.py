"""How compiled graphs reach the optimizer that manages their params (their manager), without holding it.

A compiled graph is plain code: it knows which of its inputs are managed params (by
position) and where its passes put the ops, nothing else. Each op call carries the params
themselves as graph values; the runtime finds their optimizer through the param
(``param._fxzero_manager``, a weakref) and asks its :class:`GraphBinding`. So:

* a compiled graph keeps no optimizer alive; a dropped optimizer's buffers are freed;
* one compiled graph serves every param set Dynamo reuses it for (identical blocks of a
  model whose loop graph-broke): each set gets its own cached entry here;
* a new optimizer over the same params takes over the same compiled graphs: its binding
  resolves their params against its own layout (even another bucket size).

What is derived for a param set (its buckets, ``main_grad`` views, slots) is computed on
its first call and cached in the binding, keyed by the **whole identity** of the set: the
``id`` of every param in it, in order (:func:`identity`). That key is sound because an
entry is stored only after every param in it resolved to one of this optimizer's params,
which the binding holds alive: no other object can take one of those ids while the entry
exists, so equal keys mean the same params in the same order. (A key made of part of the
set, such as its first and last param and its length, mixed up two graphs that share
those but differ in between: adapters or experts picked in Python.) Building the key is
one C-level pass over the call's params, no Python loop. The cache lives and dies with
the optimizer.

What a call receives must be the params themselves: a tensor that is not a managed param
(a copy some compiler made of one, which would also be a read before its gather landed)
is refused with an error saying so, never looked up by shape or position.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from .graph_id import GraphId
from .._torch_compat import is_compiled_function_name
from ..optim.gradients.grad_sync import GradSync
from ..optim.gradients.grad_use import GradientUses, grad_accumulator
from ..optim.gradients.ledger import Ledger
from ..optim.params.param_sync import ParamSync
from ..optim.layout.param_table import ParamTable

__all__ = ["GraphBinding", "InputBinding", "ManagerRef", "backward_node", "binding_of", "counting_forward", "identity", "manager_of"]


class ManagerRef(weakref.ref):
    """``param._fxzero_manager``: a weakref to the optimizer managing the param. A pickled
    param (``torch.save(model)``, or a plain tensor's ``deepcopy``, which copies its
    ``__dict__``) is a copy no optimizer manages: it loads with ``_fxzero_manager = None``.
    (``Parameter.__deepcopy__`` copies no attribute at all.)"""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_no_manager, ())


def _no_manager() -> None:
    return None


_no_owner = _no_manager  # what params pickled before fxzero 0.3 name


def manager_of(param: Any) -> Any:
    """The live :class:`~fxzero.DistributedOptimizer` managing ``param``, or None."""
    ref = getattr(param, "_fxzero_manager", None)
    return ref() if ref is not None else None


def binding_of(param: torch.Tensor) -> "GraphBinding":
    """The binding of ``param``'s optimizer; a clear error when it has none any more, or
    when ``param`` is not a managed param at all (a compiler's copy of one). Every op call
    asks it: :func:`manager_of`, inlined."""
    ref = getattr(param, "_fxzero_manager", None)
    manager = ref() if ref is not None else None
    if manager is None:
        if not hasattr(param, "_fxzero_manager"):
            raise RuntimeError(not_a_param_message(param))
        raise RuntimeError(
            f"fxzero: a compiled graph reads a param of shape {tuple(param.shape)}, which was compiled for a fxzero.DistributedOptimizer "
            "that no longer exists. Build a new DistributedOptimizer over the model's params (the compiled graphs "
            "use it), or call torch.compiler.reset() and compile again to train without fxzero."
        )
    return manager.runtime.binding


@dataclasses.dataclass(frozen=True)
class InputBinding:
    """Which inputs of a graph one optimizer manages, as plain data (what the passes plan with)."""

    positions: tuple[int, ...]
    """Input positions of the managed params, ascending."""
    buckets: tuple[int, ...]
    """Bucket index of each, at compile time (plans group by it; the runtime re-resolves)."""
    forward_waits: bool = True
    """Whether a forward can find one of this optimizer's gathers in flight
    (``Config.overlap_param_gather``): only then does a compiled forward carry
    ``fxzero::wait_params``; otherwise its counting wrapper checks, per call, that no bucket
    is stale (:func:`counting_forward`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Group:
    """The params of one op call that fall in one bucket."""

    bucket: int
    indices: Optional[tuple[int, ...]]
    """Their positions in the call's lists; None when the call's params are all in this bucket."""
    main_grads: list[torch.Tensor]
    slots: torch.Tensor
    span: Optional[slice]
    """``slice(first, last + 1)`` when the slots are consecutive (marked present by one
    memcpy into the ledger's flags; otherwise one ``index_fill_``)."""
    nodes: tuple[Any, ...]
    """The params' ``AccumulateGrad`` nodes: what the engine is asked whether this backward
    accumulates their gradients (:mod:`fxzero.optim.gradients.grad_use`)."""
    labels: tuple[str, ...]


def identity(params: Sequence[Any]) -> tuple[int, ...]:
    """The whole identity of a param sequence: every param's ``id``, in order."""
    return tuple(map(id, params))


def captured_message(label: str) -> str:
    return (
        f"fxzero: torch.autograd.grad asked for the gradient of param {label} through a graph compiled with "
        "backend='fxzero', whose backward hands managed params' gradients to the optimizer's buffers, not to "
        "autograd. Use loss.backward() and read p.grad (norms and clipping work on it), or compute such "
        "gradients with the model compiled by plain torch.compile or run eagerly. autograd.grad with respect "
        "to inputs that are not managed params (a gradient penalty, input saliency) works."
    )


def not_a_param_message(value: Any) -> str:
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    return (
        f"fxzero: a compiled graph handed fxzero a tensor of shape {shape} where a managed param belongs: a "
        "compiler replaced the param by a copy (for example a layout conversion) before its all-gather wait, so "
        "that copy may hold last step's values. This is a bug in fxzero's handling of that compiler transform; "
        "please report it with TORCH_LOGS=output_code. Meanwhile options={'inner_compiler': 'eager'} avoids it."
    )


class GraphBinding:
    """Everything compiled graphs call into, for one optimizer (``optimizer.runtime.binding``)."""

    def __init__(self, table: ParamTable, ledger: Ledger, grad_sync: GradSync, param_sync: ParamSync) -> None:
        self.table, self.ledger, self.grad_sync, self.param_sync = table, ledger, grad_sync, param_sync
        self.token = torch.empty(0, device=table.params[0].device)
        """What ``fxzero::grads_ready`` returns (nothing reads it): made once, not per call."""
        # Per-step caches, each keyed by the whole identity of a param set (see the module docstring).
        self._grad_groups: dict[tuple[int, ...], tuple[_Group, ...]] = {}
        self._wait_buckets: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._counts: dict[tuple[GraphId, tuple[int, ...]], list[tuple[int, int]]] = {}
        self.uses = GradientUses()

    @property
    def waits_looked_up(self) -> int:
        """Param sets whose buckets a wait has looked up (and cached): 0 while no wait had to."""
        return len(self._wait_buckets)

    # ---- compile time -------------------------------------------------------------
    def describe(self, inputs: Sequence[Any]) -> InputBinding:
        """This optimizer's params among ``inputs`` (a graph's example inputs)."""
        mine = tuple(i for i, x in enumerate(inputs) if self.manages(x))
        return InputBinding(mine, tuple(self._bucket(inputs[p]) for p in mine), self.param_sync.overlap)

    def manages(self, value: Any) -> bool:
        return self.table.find(value) is not None

    def _bucket(self, param: Any) -> int:
        return self.table.bucket_of_slot[self._slot(param)]

    def _slot(self, param: Any) -> int:
        slot = self.table.find(param)
        if slot is None:
            if not hasattr(param, "_fxzero_manager"):
                raise RuntimeError(not_a_param_message(param))
            raise RuntimeError(
                f"fxzero: param of shape {tuple(param.shape)} reached an optimizer that does not manage it "
                "(a compiled graph mixes params of two DistributedOptimizers in one bucket launch); "
                "call torch.compiler.reset() and compile again"
            )
        return slot

    # ---- fxzero::grads_ready --------------------------------------------------------
    def grads_ready(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """Add one backward graph's ``grads`` of ``params`` into ``main_grad``; report them."""
        key = identity(params)
        groups = self._grad_groups.get(key)
        if groups is None:
            groups = self._grad_groups[key] = self._grad_groups_of(params)
        for group in groups:
            mine = grads if group.indices is None else [grads[i] for i in group.indices]
            uses = self.uses.of(group, group.nodes)
            if uses is None:  # loss.backward(): all of them
                self.grad_sync.add_compiled(group.bucket, group.main_grads, mine, group.slots, group.span)
            else:
                self._not_all_accumulated(group, mine, uses)

    def _not_all_accumulated(self, group: _Group, grads: Sequence[torch.Tensor], uses: Sequence[str]) -> None:
        """``autograd.grad`` (nothing accumulates) or ``backward(inputs=...)`` (some do)."""
        if "capture" in uses:
            raise RuntimeError(captured_message(group.labels[uses.index("capture")]))
        keep = [k for k, use in enumerate(uses) if use == "accumulate"]
        if keep:
            main_grads, mine = [group.main_grads[k] for k in keep], [grads[k] for k in keep]
            self.grad_sync.add_compiled(group.bucket, main_grads, mine, group.slots[keep], None)

    def _grad_groups_of(self, params: Sequence[torch.Tensor]) -> tuple[_Group, ...]:
        by_bucket: dict[int, list[int]] = {}
        for i, param in enumerate(params):
            by_bucket.setdefault(self._bucket(param), []).append(i)
        whole = len(by_bucket) == 1
        groups = []
        for bucket, indices in sorted(by_bucket.items()):
            slots = [self._slot(params[i]) for i in indices]
            consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
            span = slice(slots[0], slots[0] + len(slots)) if consecutive else None
            table_params = [self.table.params[slot] for slot in slots]  # a DTensor's, for its local tensor
            main_grads = [param.main_grad for param in table_params]
            nodes = tuple(grad_accumulator(param) for param in table_params)
            labels = tuple(self.table.label(slot) for slot in slots)
            groups.append(_Group(bucket, None if whole else tuple(indices), main_grads, torch.tensor(slots), span, nodes, labels))
        return tuple(groups)

    # ---- fxzero::wait_params --------------------------------------------------------
    def wait(self, params: Sequence[torch.Tensor]) -> None:
        """Make ``params`` current: wait for (and land) their buckets' gathers. With no bucket
        stale (world size 1; the first forward, which reads the initial broadcast; every
        gather landed) it returns at once: ``params`` are first checked to be managed params
        (not a compiler's copies) at the first wait that could have read a stale value."""
        if not self.param_sync.stale:
            return
        key = identity(params)
        buckets = self._wait_buckets.get(key)
        if buckets is None:
            found = {self._bucket(p) for p in params}
            buckets = self._wait_buckets[key] = tuple(sorted(found, reverse=True))  # forward order
        self.param_sync.wait_many(buckets)

    def land_all(self) -> None:
        """A graph compiled with no wait (its optimizer then finished every gather inside
        ``step()``) runs while this optimizer has gathers in flight (a successor built with
        ``overlap_param_gather`` over the same params): land every bucket first, so it
        reads current values, without the overlap."""
        if self.param_sync.stale:
            self.param_sync.finish()

    # ---- each run of a compiled forward --------------------------------------------
    def forward_ran(self, graph: GraphId, params: Sequence[Any], positions: Sequence[int], delivered: frozenset[int], node: Any) -> None:
        """A compiled forward (``graph`` identifies it) ran with ``params`` at input
        ``positions``; its backward, from autograd ``node``, delivers the gradients of
        those whose position is in ``delivered``."""
        key = (graph, identity(params))
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = self._register(params, [p in delivered for p in positions])
        self.ledger.forward_ran(counts, node)

    def _register(self, params: Sequence[Any], delivered: Sequence[bool]) -> list[tuple[int, int]]:
        """First run with this param set: their gradients come from compiled graphs now."""
        per_bucket: dict[int, int] = {}
        for param, counted in zip(params, delivered):
            if counted:
                bucket = self._bucket(param)
                per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
        self.ledger.compiled_graph(self._slot(p) for p in params)
        return sorted(per_bucket.items())


def counting_forward(
    graph: GraphId,
    positions: Sequence[Sequence[int]],
    delivered: frozenset[int],
    compiled: Callable[..., Any],
    *,
    unwaited: Sequence[int] = (),
    unmanaged: Sequence[int] = (),
) -> Callable[..., Any]:
    """Wrap a compiled Dynamo graph so that each run that builds an autograd graph tells
    the manager of each group of ``positions`` (one per optimizer) which gradients its
    backward will deliver (``delivered``: the Dynamo positions the joint graph's hand-offs take).
    ``unwaited``: the position of one param of each optimizer the graph has no wait for;
    before each run their optimizers land any gather still in flight
    (:meth:`GraphBinding.land_all`), which a graph compiled with waits does itself.
    ``unmanaged``: the positions of params no optimizer managed at compile time; should one
    manage them now (built after this graph compiled), its gathers are landed the same way
    (one C-level scan of those params per call; the lookups only once one is managed)."""
    groups = [(tuple(group), _getter(group)) for group in positions if group]
    unwaited = tuple(unwaited)
    late = _getter(unmanaged) if unmanaged else None

    def run(*args: Any) -> Any:
        for position in unwaited:
            binding_of(args[position]).land_all()
        if late is not None and any(map(hasattr, late(args), _MANAGER_ATTRIBUTE)):
            _land_adopted(graph, late(args))
        outputs = compiled(*args)
        node = backward_node(outputs)
        if node is not None:
            for group, params_of in groups:
                params = params_of(args)
                binding_of(params[0]).forward_ran(graph, params, group, delivered, node)
        return outputs

    return run


_MANAGER_ATTRIBUTE = itertools.repeat("_fxzero_manager")


def _land_adopted(graph: GraphId, params: Sequence[Any]) -> None:
    """Params this graph read unmanaged (it compiled before their optimizer existed) are
    managed now: their gathers get no wait in it, so every bucket is landed before it runs,
    and their gradients take autograd's path to the optimizer's hooks. Exact, not overlapped.
    (Python's warning registry shows the warning once per graph.)"""
    managers = {id(o): o for o in map(manager_of, params) if o is not None}
    if managers:
        warnings.warn(
            f"fxzero: compiled graph {graph} read params of a DistributedOptimizer before the optimizer existed; it "
            "runs without in-graph waits and gradient hand-offs (exact, slower). Build the optimizer before the "
            "first compiled call, or call torch.compiler.reset() after building it.",
            stacklevel=3,
        )
    for manager in managers.values():
        manager.runtime.binding.land_all()


def _getter(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``args -> tuple(args[p] for p in positions)``, in C (``itemgetter`` of one position
    returns the item itself, so that case is wrapped)."""
    if len(positions) == 1:
        position = positions[0]
        return lambda args: (args[position],)
    return operator.itemgetter(*positions)


def backward_node(outputs: Any) -> Any:
    """The compiled function's autograd node behind ``outputs`` (views of outputs are
    regenerated outside it, so their ``grad_fn`` leads there), or ``None`` when no output
    needs a gradient."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    first = outputs[0] if outputs and isinstance(outputs[0], torch.Tensor) else None
    node = first.grad_fn if first is not None else None
    if node is not None and is_compiled_function_name(type(node).__name__):
        return node  # the common case, what the walk below finds first: asked once per graph run
    nodes = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    frontier = nodes
    for _ in range(4):
        for node in frontier:
            if is_compiled_function_name(node.name()):
                return node
        frontier = [n for node in frontier for n, _ in node.next_functions if n is not None]
    return nodes[0] if nodes else None
