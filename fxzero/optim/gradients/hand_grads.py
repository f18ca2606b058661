"""Gradients assigned by hand: ``p.grad = g`` before ``step()``.

Loops assign gradients themselves: PCGrad and other multi-task projections, RL, gradients
from ``torch.autograd.grad``, ``p.grad = p.grad.clone()`` style tricks, and torch's own
``torch.distributed.checkpoint.state_dict`` (it sets ``p.grad = torch.zeros_like(p)`` on
every param and steps with ``lr=0`` to create the optimizer state). Under DDP such a
gradient is used as it is: DDP averages only the gradients backward produces, and
torch's ``ZeroRedundancyOptimizer`` steps each rank's shard from that rank's ``.grad``.
fxzero does the same:

* a managed param whose ``.grad`` at ``step()`` is a tensor, not ``None`` and not its
  :class:`~fxzero.optim.gradients.grad_views.ShardedGrad` view, takes that tensor **as is, not
  averaged over ranks**: each rank writes its own shards of the param from its own
  ``.grad`` (:meth:`~fxzero.optim.gradients.reduced_grads.ReducedGrads.use_as_is`). With the same
  ``g`` on every rank the step equals DDP + the wrapped ``torch.optim`` optimizer (and
  plain ``torch.optim`` at world size 1) bit for bit. Ranks that compute different
  gradients must all-reduce them first, as under DDP;
* it wins over a gradient backward produced for that param in the same step (the view
  it replaced); params whose ``.grad`` is still their view take the averaged gradient,
  params whose ``.grad`` is ``None`` are skipped, in one step (the mixed case is exact);
* its norm is this rank's own (``Config.clip_grad`` and ``StepResult.grad_norm`` count
  ``||g||`` once: every rank holds the whole of ``g``, so it is not summed over ranks);
  ``GradScaler`` unscales and inf-checks it with the real ops, as torch.optim's would;
* ``step()`` consumes it (``p.grad`` is ``None`` afterwards), as it consumes backward's.

Finding them costs the step one C-level scan of the params' ``.grad`` attributes
(:meth:`~fxzero.optim.gradients.grad_views.GradViews.collect`); only a step that has some runs the
checks and copies below.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._torch_compat import is_dtensor

__all__ = ["HandGrad", "check_hand_grad"]


class HandGrad(NamedTuple):
    """A managed param's gradient assigned by hand."""

    slot: int
    grad: torch.Tensor


def check_hand_grad(param: torch.Tensor, grad: Any, label: str, view_type: type) -> None:
    """Raise a clear error, naming the param, when ``grad`` cannot be its gradient.
    (torch's ``.grad`` setter already refuses most mismatches; ``p.grad.data = t`` and
    another param's view get past it.)"""
    if isinstance(grad, view_type):
        raise TypeError(
            f"fxzero: p.grad of param {label!r} was set to another param's sharded-gradient view ({grad!r}); "
            "assign a tensor holding the gradient you want (each rank's is used as is), or leave p.grad alone"
        )
    if is_dtensor(param):
        raise NotImplementedError(
            f"fxzero: p.grad of param {label!r} (a DTensor) was assigned by hand; gradients assigned by hand to DTensor "
            "params are not supported yet (only those backward produces). Leave p.grad alone, or set it to None."
        )
    if not isinstance(grad, torch.Tensor) or grad.layout != torch.strided:
        kind = grad.layout if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(f"fxzero: p.grad of param {label!r} is a {kind}; assign a dense (strided) tensor")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise RuntimeError(
            f"fxzero: p.grad of param {label!r} was assigned a tensor of shape {tuple(grad.shape)}, {grad.dtype} on "
            f"{grad.device}; the param is {tuple(param.shape)}, {param.dtype} on {param.device}. Assign a gradient of "
            "the param's shape, dtype and device (e.g. torch.zeros_like(p) or g.to(p.dtype).view_as(p))."
        )
