"""Custom ops that compiled graphs call into the runtime with.

``fxzero::wait_params(handle)`` makes one bucket's params current (waits for its
all-gather, launches the next one) and returns an empty token tensor that the forward
pass makes every reader of those params depend on (:mod:`fxzero.passes.param_gather_wait`).

``fxzero::grads_ready(grads, handle)`` adds one bucket's gradients from one backward
graph into their ``main_grad`` views and reports them to the bucket's
:class:`~fxzero.optim.grad_sync.GradSync`, which may launch the bucket's
reduce-scatter. A custom op cannot take Python objects, so the backward pass registers
a :class:`GraphBucket` (the runtime objects one op call needs) and bakes its integer
handle into the graph. The op returns nothing, so it is marked side-effecting to
survive dead-code elimination under every inner compiler.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch.fx.node import has_side_effect

from .optim.grad_sync import GradSync
from .optim.param_sync import ParamSync

__all__ = ["GraphBucket", "GraphGather", "register_graph_bucket"]


@dataclasses.dataclass(frozen=True, eq=False)
class GraphBucket:
    """What one ``fxzero::grads_ready`` call site needs, made once at compile time."""

    sync: GradSync
    bucket: int
    main_grads: list[torch.Tensor]
    """``main_grad`` views, in the order the op receives the gradients."""
    slots: torch.Tensor
    """int64 param slots of those gradients (for presence flags)."""

    @property
    def count(self) -> int:
        return len(self.main_grads)


@dataclasses.dataclass(frozen=True, eq=False)
class GraphGather:
    """What one ``fxzero::wait_params`` call site needs."""

    sync: ParamSync
    bucket: int


_graph_buckets: list = []
_lock = threading.Lock()


def register_graph_bucket(entry: "GraphBucket | GraphGather") -> int:
    """Store ``entry`` for the lifetime of the process; returns its op handle."""
    with _lock:
        _graph_buckets.append(entry)
        return len(_graph_buckets) - 1


@torch.library.custom_op("fxzero::grads_ready", mutates_args=())
def grads_ready(grads: list[torch.Tensor], handle: int) -> None:
    """Add ``grads`` into their ``main_grad`` views; report the bucket's contributions."""
    entry = _graph_buckets[handle]
    if entry.sync.before_grad_write is not None:
        entry.sync.before_grad_write(entry.bucket)
    torch._foreach_add_(entry.main_grads, grads)
    entry.sync.compiled_grads_ready(entry.bucket, entry.count, entry.slots)


@grads_ready.register_fake
def _grads_ready_fake(grads: list[torch.Tensor], handle: int) -> None:
    return None


has_side_effect(torch.ops.fxzero.grads_ready.default)


# ``wait_params`` is defined with a raw schema rather than ``torch.library.custom_op``:
# its params argument is declared mutated (``Tensor(a!)[]``), which is what orders every
# later read of those params after it in Inductor's scheduler, but ``custom_op`` would
# also bump the params' autograd version counters on every call, and a param saved for
# backward by an earlier graph (a tied weight read by two graphs) would then fail its
# version check. The wait never changes a value anyone has read: a bucket is only
# written before its first read of the step.
_lib = torch.library.Library("fxzero", "FRAGMENT")
_lib.define("wait_params(Tensor(a!)[] params, int handle) -> ()")


def wait_params(params: list[torch.Tensor], handle: int) -> None:
    """Wait for one bucket's param all-gather (and land it): ``params`` (this graph's
    params of the bucket) hold the gathered values afterwards."""
    entry = _graph_buckets[handle]
    entry.sync.wait(entry.bucket)


def _wait_params_fake(params: list[torch.Tensor], handle: int) -> None:
    return None


_lib.impl("wait_params", wait_params, "CompositeExplicitAutograd")
torch.library.register_fake("fxzero::wait_params", _wait_params_fake, lib=_lib)
