"""The custom ops compiled graphs call into the optimizer with.

Both take the params they concern as graph values: at run time they find the params'
optimizer through the params themselves (:func:`fxzero.compiled.binding.binding_of`), so a
compiled graph holds no handle, no table entry and no optimizer, and one graph serves every
param set it is called with. Both declare their effects to the compiler:

``fxzero::wait_params(Tensor(a!)[] params) -> ()`` (forward; inserted by
:mod:`fxzero.passes.param_gather_wait`) waits for the all-gather of the buckets holding
``params`` (landing them) and launches the next one. It is declared to **write**
``params``: every later read of them is a read-after-write that compilers keep after it
(Inductor's scheduler makes any kernel reading a mutated buffer depend on the mutation).
It is defined with a raw schema, not ``torch.library.custom_op``, because the latter
would also bump the params' autograd version counters on each call, and a param saved for
backward by an earlier graph (a tied weight read by two graphs) would then fail its
version check; the wait never changes a value anyone has read.

``fxzero::grads_ready(Tensor[] grads, Tensor[] params) -> Tensor`` (backward; inserted by
:mod:`fxzero.passes.bucket_reduce_scatter` after each group of a bucket's gradients) adds
``grads`` into the params' ``main_grad`` views and reports them; the bucket's last group
launches its reduce-scatter. What it writes
(``main_grad``, collectives) is not a graph value, so it is registered as an *ordered
effect* (torch's effects system): it is never dead-code eliminated or reordered against
other effects. It returns an empty token the pass routes to a backward output during
partitioning, which is what makes AOTAutograd save the params for the backward.

``fxzero::module_entered(Tensor[] params) -> ()`` marks, in a traced graph, the entry of a
module that owns managed params: the forward pre-hook that waits for a module's buckets in
eager code (:func:`fxzero.optim.params.param_waits.install_param_waits`) emits it while Dynamo
traces the hook. It matters when the module's forward graph-breaks and the rest of it runs
eagerly: no pre-hook runs for that rest, and its reads of the module's own params would
see last step's values. As a reader of the module's params at its entry, the marker makes
the forward pass put their gather wait there, in the graph before the break; the pass then
removes the marker (it computes nothing). Run outside fxzero's graphs (another backend), it
waits for those buckets itself. Registered as having side effects, so dead-code
elimination keeps it until the pass has seen it.

Importing this module defines the ops. ``import fxzero`` does not: the optimizer's
construction and the backend import it (first use), the backend before any graph of its
compile is traced or loaded from Inductor's or AOTAutograd's caches.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._torch_compat import dtensor_local, is_dtensor, register_ordered_effect
from .binding import binding_of, manager_of

__all__ = ["grads_ready", "module_entered", "wait_params"]

_lib = torch.library.Library("fxzero", "DEF")
_lib.define("wait_params(Tensor(a!)[] params) -> ()")
_lib.define("grads_ready(Tensor[] grads, Tensor[] params) -> Tensor")
_lib.define("module_entered(Tensor[] params) -> ()")


def wait_params(params: list[torch.Tensor]) -> None:
    """Make ``params`` current (their buckets' gathers waited for and landed)."""
    binding_of(params[0]).wait(params)


def grads_ready(grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """Hand one backward graph's gradients of ``params`` to their optimizer."""
    binding = binding_of(params[0])
    binding.grads_ready(grads, params)
    return binding.token


def module_entered(params: list[torch.Tensor]) -> None:
    """Make a module's managed params current (its frozen or unmanaged params are skipped)."""
    managed = [p for p in params if manager_of(p) is not None]
    if managed:
        binding_of(managed[0]).wait(managed)


def _wait_params_fake(params: list[torch.Tensor]) -> None:
    return None


def _grads_ready_fake(grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(0, device=params[0].device)


_lib.impl("wait_params", wait_params, "CompositeExplicitAutograd")
_lib.impl("grads_ready", grads_ready, "CompositeExplicitAutograd")
_lib.impl("module_entered", module_entered, "CompositeExplicitAutograd")
torch.library.register_fake("fxzero::wait_params", _wait_params_fake, lib=_lib)
torch.library.register_fake("fxzero::module_entered", _wait_params_fake, lib=_lib)
torch.fx.node.has_side_effect(torch.ops.fxzero.module_entered.default)
torch.library.register_fake("fxzero::grads_ready", _grads_ready_fake, lib=_lib)
register_ordered_effect(torch.ops.fxzero.grads_ready.default, _lib)


def _on_local_tensors(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """A DTensor param reaching an fxzero op (the module-entry marker, traced by Dynamo from
    the forward pre-hook) stands for its local tensor: what fxzero's buffers hold and what
    AOTAutograd's flattened graphs take as the param (:mod:`fxzero.optim.layout.mesh`)."""
    unwrapped = [[_local(t) for t in a] if isinstance(a, (list, tuple)) else _local(a) for a in args]
    return func(*unwrapped, **(kwargs or {}))


def _local(value: Any) -> Any:
    return dtensor_local(value) if is_dtensor(value) else value


@functools.cache
def accept_dtensor_params() -> None:
    """Let the ops take DTensor params (as their local tensors). Called once an optimizer with
    DTensor params is built (:class:`fxzero.DistributedOptimizer`), not at import: the rules
    need ``torch.distributed.tensor``, whose import cost every process ~0.6 s on this machine,
    and only an optimizer's hooks and the passes for its params put params in the ops' reach."""
    from torch.distributed.tensor import DTensor

    for name in ("wait_params", "grads_ready", "module_entered"):
        torch.library.register_torch_dispatch(f"fxzero::{name}", DTensor, _on_local_tensors, lib=_lib)
