"""What the running backward does with managed params' gradients: accumulate, capture or skip.

A compiled backward hands managed params' gradients to the optimizer itself
(``fxzero::grads_ready``) and returns ``None`` for them to autograd. That is what
``loss.backward()`` needs, which would accumulate them into ``.grad``. Other backwards
accumulate nothing, or only some:

* ``torch.autograd.grad(loss, inputs)`` accumulates into no ``.grad``; it *captures* the
  gradients of ``inputs``. Under DDP it bypasses the reducer. fxzero's buffers, ledger
  and reductions must not see it, or the next backward finds its buckets launched;
* ``loss.backward(inputs=[...])`` accumulates only into those.

The autograd engine answers per param, through its ``AccumulateGrad`` node
(:func:`~fxzero._torch_compat.leaf_gradient_uses`). :class:`GradientUses` asks once per
backward and hand-off, and in the common case (every node executes) only the fast
question (:func:`~fxzero._torch_compat.engine_accumulates_all`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..._torch_compat import (
    current_graph_task_id,
    engine_accumulates_all,
    leaf_gradient_uses,
)

__all__ = ["GradientUses", "grad_accumulator"]


def grad_accumulator(param: torch.Tensor) -> Any:
    """``param``'s ``AccumulateGrad`` node (the one backward graphs reach it through, as
    long as someone holds it: DDP keeps them the same way)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


class GradientUses:
    """Per backward, per hand-off: ``None`` when every gradient accumulates, else each one's
    use (``"accumulate"``, ``"capture"``, ``"skip"``)."""

    def __init__(self) -> None:
        self._task = -1
        self._known: dict[Hashable, tuple[str, ...] | None] = {}

    def of(self, key: Hashable, nodes: Sequence[Any]) -> tuple[str, ...] | None:
        task = current_graph_task_id()
        if task == -1:  # an op run by hand, outside any backward: as before
            return None
        if task != self._task:
            self._task, self._known = task, {}
        if key not in self._known:
            self._known[key] = None if engine_accumulates_all(nodes) else leaf_gradient_uses(nodes)
        return self._known[key]
