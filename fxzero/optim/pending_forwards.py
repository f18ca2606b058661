"""Compiled forwards whose gradients are expected, tied to their autograd graphs.

Each run of a compiled forward tells :class:`~fxzero.optim.grad_sync.GradSync` how
many gradients per bucket its backward will deliver, so that a bucket whose gradients
come from several graphs launches once, when the last one arrives. A forward whose
backward never runs (a validation loss computed with grad enabled) would leave its
counts behind, and every bucket it read would then wait for the end of the next
backward: the overlap silently lost. So each count stays tied to the autograd node of
the forward's outputs, and at the first gradient of every backward
(:meth:`PendingForwards.settle`) exactly the recorded forwards that this backward will
execute are counted; the others are taken out (and put back if a later backward runs
them). Forwards whose graph was freed are forgotten.

Counts survive ``zero_grad()`` and ``step()``: a forward's backward may come after
either (``out = model(x); opt.zero_grad(); out.sum().backward()``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

from .._torch_compat import current_graph_task_id, will_engine_execute_node

__all__ = ["PendingForwards"]


@dataclasses.dataclass(eq=False)
class _Forward:
    node: "weakref.ref[Any]"
    counts: Sequence[tuple[int, int]]
    """``(bucket, gradients)`` its backward delivers."""
    counted: bool = True


class PendingForwards:
    """The compiled forwards since their backward, for one GradSync's counters."""

    def __init__(self) -> None:
        self._forwards: list[_Forward] = []
        self._task = -1

    def add(self, node: Any, counts: Sequence[tuple[int, int]], pending: list[int]) -> None:
        """A forward ran; its backward starts at ``node`` (the outputs' ``grad_fn``)."""
        for bucket, count in counts:
            pending[bucket] += count
        self._forwards.append(_Forward(weakref.ref(node), counts))

    def settle(self, pending: list[int]) -> None:
        """Called with every gradient; at the first of a backward, count exactly the
        forwards that this backward executes and forget them (they deliver now)."""
        task = current_graph_task_id()
        if task == self._task or task == -1:
            return
        self._task = task
        waiting = []
        for forward in self._forwards:
            node = forward.node()
            runs = node is not None and will_engine_execute_node(node)
            self._count(forward, runs, pending)
            if node is not None and not runs:
                waiting.append(forward)
        self._forwards = waiting

    def recount(self, pending: list[int]) -> None:
        """``pending`` was reset to the eager baseline: add back the counted forwards
        that may still deliver; forget those whose graph is gone."""
        alive = [f for f in self._forwards if f.node() is not None]
        for forward in alive:
            if forward.counted:
                for bucket, count in forward.counts:
                    pending[bucket] += count
        self._forwards = alive

    @staticmethod
    def _count(forward: _Forward, counted: bool, pending: list[int]) -> None:
        if counted == forward.counted:
            return
        sign = 1 if counted else -1
        for bucket, count in forward.counts:
            pending[bucket] += sign * count
        forward.counted = counted
