"""The readiness ledger: which buckets may launch their gradient reduction now.

Pure state, no collective: expected gradient counts per bucket and per pending forward
go in, and each answer is the range of buckets that may launch now. The one rule that
decides launches lives here:

* A bucket is **ready** when every contribution expected of it this step arrived. The
  eager baseline expects one per param its compiled graphs do not read (an eager param's
  post-accumulate hook fires once per backward, however many times it was used); each run
  of a compiled forward adds what its backward will deliver per bucket (:meth:`forward_ran`).
* A bucket **launches** when it is ready and every lower-indexed bucket launched, so every
  rank issues its collectives in bucket order whatever order data-dependent control flow
  produced the gradients in. The end of each backward launches the rest
  (:meth:`end_of_backward`), so a param that got no gradient never blocks.
* Under :meth:`Ledger.no_sync` (:attr:`~Ledger.accumulating`) nothing launches.
* A param read both by a compiled graph and eagerly ("mixed", a tied embedding across a
  graph break) is discovered when its eager gradient first arrives; its eager
  contribution is expected from then on. The first step after a new graph compiled is a
  **learning** step that launches only at the end of backward, so such a discovery never
  comes after its bucket launched.

**Pending forwards.** A forward whose backward never runs (a validation loss computed with
grad enabled) would leave its counts behind, and each bucket it read would wait for the end
of the next backward: the overlap silently lost. So each forward's counts stay tied to its
autograd node; at the first gradient of every backward exactly the recorded forwards that
this backward executes are counted and the others taken out (put back if a later backward
runs them). A forward's backward may run more than once (``retain_graph=True``: an actor
loss's backward under ``no_sync()``, then a critic loss's through the same graph): each
backward that executes it counts its gradients again, since the earlier one consumed them.
Forwards whose graph was freed are forgotten. Counts survive :meth:`start_step`: a forward's
backward may come after ``zero_grad()`` or ``step()``.

The autograd engine is reached through an :class:`Engine` given at construction, so the
ledger is tested with a fake one, without autograd or a process group
(``tests/test_ledger.py``), like :func:`~fxzero.optim.layout.layout.plan_buckets`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import operator
import weakref
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from ..._torch_compat import current_graph_task_id, will_engine_execute_node
from ..layout.param_table import ParamTable

__all__ = ["AUTOGRAD", "Engine", "LateGradient", "Ledger"]

log = logging.getLogger(__name__)

_REQUIRES_GRAD = operator.attrgetter("requires_grad")

NOTHING = range(0)


class Engine(Protocol):
    """What the ledger asks the autograd engine."""

    def task_id(self) -> int:
        """The running backward's id; -1 outside a backward."""

    def will_execute(self, node: Any) -> bool:
        """Whether the running backward executes autograd ``node``."""


class _Autograd:
    task_id = staticmethod(current_graph_task_id)

    @staticmethod
    def will_execute(node: Any) -> bool:
        return will_engine_execute_node(node)


AUTOGRAD: Engine = _Autograd()


class LateGradient(RuntimeError):
    """A gradient arrived for a bucket that was already launched in this step."""


@dataclasses.dataclass(slots=True)
class _Forward:
    node: "weakref.ref[Any]"
    counts: Sequence[tuple[int, int]]
    """``(bucket, gradients)`` its backward delivers."""
    counted: bool = True
    """Its counts are in the pending counts and not yet delivered."""
    task: int = -1
    """The backward that last executed it (its gradients consumed its counts); -1 before any."""


class Ledger:
    """Readiness of a fixed list of buckets; slot ``s`` lives in the bucket the param table
    gives it. The only writer of its own state: callers report events through its methods
    and read its flags through read-only properties (``tests/test_ledger_writes.py`` checks)."""

    def __init__(
        self,
        table: ParamTable,
        num_buckets: int,
        *,
        engine: Engine = AUTOGRAD,
    ) -> None:
        self._table = table
        self._bucket_of = table.bucket_of_slot  # the table's own tuple, read per gradient (no copy)
        self._num_buckets = num_buckets
        self._engine = engine
        n = len(table)
        self._compiled = bytearray(n)  # 1 once a compiled graph's backward hands that gradient over directly
        self._mixed = bytearray(n)  # ... and it also gets eager gradients
        self._baseline = [0] * num_buckets  # eager contributions expected
        for bucket in self._bucket_of:
            self._baseline[bucket] += 1
        self._pending = list(self._baseline)
        self._next = 0  # buckets below have launched
        self._zeros = bytes(n)
        self._seen = bytearray(n)
        self._presence = bytearray(n)
        self._presence_tensor = torch.frombuffer(self._presence, dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        # read-only windows on the flags, made once: reading them allocates nothing
        self._presence_view = memoryview(self._presence).toreadonly()
        self._compiled_view = memoryview(self._compiled).toreadonly()
        self._written = False
        self._learning = False
        self._accumulating = False
        self._forwards: list[_Forward] = []
        self._task = -1
        self._ones = b"\x01" * n
        self._ones_view = memoryview(self._ones)  # sliced without a copy
        self._requires_seen = self._ones
        self._frozen = bytearray(n)
        """``_frozen[slot]`` is 1 while the param is left out of the eager counts, frozen."""

    # ---- read-only state ----------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    @property
    def presence(self) -> memoryview:
        """``presence[slot]`` is 1 once that param got any gradient since the step began (read-only)."""
        return self._presence_view

    @property
    def presence_tensor(self) -> torch.Tensor:
        """:attr:`presence` as a uint8 tensor on the same memory, for tensor reads (never write it)."""
        return self._presence_tensor

    @property
    def compiled(self) -> memoryview:
        """``compiled[slot]`` is 1 once a compiled graph's backward hands that gradient over directly (read-only)."""
        return self._compiled_view

    @property
    def written(self) -> bool:
        """A gradient reached the buffers since they were last zeroed (:meth:`zeroed`)."""
        return self._written

    @property
    def learning(self) -> bool:
        """A new graph compiled: this step launches only at the end of backward."""
        return self._learning

    @property
    def accumulating(self) -> bool:
        """Inside :meth:`no_sync`: gradients are counted as present, nothing launches."""
        return self._accumulating

    def bucket(self, slot: int) -> int:
        """The bucket holding param ``slot`` (the param table's answer)."""
        return self._bucket_of[slot]

    # ---- in: what the producers report ------------------------------------------
    def compiled_graph(self, slots: Iterable[int]) -> None:
        """A newly compiled graph reads ``slots``: their gradients come from its backward,
        counted per forward run. The next step is a learning step."""
        for slot in slots:
            if not self._compiled[slot]:
                self._compiled[slot] = 1
                if not self._frozen[slot]:  # a frozen one is out of the eager counts already
                    self._baseline[self._bucket_of[slot]] -= 1
                    self._pending[self._bucket_of[slot]] -= 1
        self._learning = True

    def forward_ran(self, counts: Sequence[tuple[int, int]], node: Any) -> None:
        """A compiled forward ran; its backward (from autograd ``node``) delivers ``count``
        gradients per bucket. Counted under ``no_sync`` too: the backward subtracts them
        whichever context it runs in."""
        self._adjust(counts, 1)
        self._forwards.append(_Forward(weakref.ref(node), counts))

    def eager_grad(self, slot: int) -> Optional[range]:
        """Param ``slot``'s eager gradient arrived; ``None`` when it is not a counted
        contribution (accumulating, a repeat, or a mixed param discovered now), else the
        buckets that may launch now."""
        self._arrived()
        self._presence[slot] = 1
        if self._accumulating:
            return None
        bucket = self._bucket_of[slot]
        self.check_open(bucket, slot)
        if self._compiled[slot] and not self._mixed[slot]:
            log.info("param %s is read by a compiled graph and eagerly; expecting both from now on", self._table.label(slot))
            self._mixed[slot] = 1
            self._baseline[bucket] += 1
            return None  # not counted this step: the count did not expect it
        if self._seen[slot]:
            return None
        self._seen[slot] = 1
        return self._contribute(bucket, 1)

    def compiled_grads(self, bucket: int, count: int, slots: torch.Tensor, span: Optional[slice] = None) -> Optional[range]:
        """``count`` gradients of ``bucket`` arrived from a compiled backward, of params
        ``slots`` (``span`` when they are consecutive: marked present by one memcpy, else by
        one ``index_fill_``); ``None`` when accumulating, else the buckets that may launch."""
        if span is not None:
            self._presence[span] = self._ones_view[: span.stop - span.start]
        else:
            self._presence_tensor.index_fill_(0, slots, 1)
        self._arrived()
        if bucket < self._next:
            self.check_open(bucket, int(slots[0]))
        self._pending[bucket] -= count
        return None if self._accumulating else self._contribute(bucket, 0)

    def end_of_backward(self) -> range:
        """The backward finished: the counts were learned; every bucket not launched may launch."""
        self._learning = False  # not at start_step: zero_grad may sit between forward and backward
        return self.rest()

    def rest(self) -> range:
        """Every bucket not launched yet, in order (they count as launched from now on)."""
        launch, self._next = range(self._next, self._num_buckets), self._num_buckets
        return launch

    def start_step(self) -> None:
        """A new step: nothing ready, launched or seen. Counted forwards whose backward has
        not run yet stay expected; forwards whose graph is gone are forgotten."""
        self._pending[:] = self._baseline
        self._forwards = [f for f in self._forwards if f.node() is not None]
        for forward in self._forwards:
            if forward.task != -1:  # a backward ran it: what it delivered was this step's
                forward.counted = False
            elif forward.counted:
                self._adjust(forward.counts, 1)
        self._next = 0
        self._seen[:] = self._zeros
        self._presence[:] = self._zeros

    def mark_present(self, flags: bytes) -> None:
        """The params ``flags`` marks hold a (zero) gradient this step: ``zero_grad(set_to_none=False)``,
        right after the step began (its flags, one byte per param, include whatever was present)."""
        self._presence[:] = flags

    def zeroed(self) -> None:
        """The grad buffers hold no gradient of the coming step: zeroed, or left stale
        (:mod:`~fxzero.optim.gradients.stale_grads`)."""
        self._written = False

    def grad_assigned(self) -> None:
        """A gradient assigned by hand (``p.grad = t``) was written into the buffers: they
        are consumed by the step, as after a backward."""
        self._written = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients are counted as present but none launches (accumulation); nests, and
        restores the enclosing state on exit."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ---- a block that leaves no trace -------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every field of the ledger's state, copied: what :meth:`kept` puts back (two compare
        equal when the ledger would decide the same from then on)."""
        return {name: _copied(value) for name, value in vars(self).items() if _is_state(value)}

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Undo, at the block's end, whatever the block did to the ledger: :func:`fxzero.explain`
        compiles and runs a graph of its own through the user's optimizer, which must be left
        as it was found (no new compiled slots, no learning step, no forward of explain's
        still counted). Arrays others read (``presence``, viewed by ``presence_tensor``) are
        restored in place."""
        saved = self.snapshot()
        try:
            yield
        finally:
            for name, value in saved.items():
                current = getattr(self, name)
                if isinstance(current, bytearray) and len(current) == len(value):
                    current[:] = value
                else:
                    setattr(self, name, _copied(value))

    # ---- out ----------------------------------------------------------------------
    def has_launched(self, bucket: int) -> bool:
        """Whether ``bucket`` launched this step: a gradient for it now is late (or follows
        a ``model.zero_grad()`` the caller resets the step for)."""
        return bucket < self._next

    @property
    def launched(self) -> tuple[bool, ...]:
        return tuple(index < self._next for index in range(self._num_buckets))

    def pending(self, bucket: int) -> int:
        """Contributions ``bucket`` still waits for this step."""
        return self._pending[bucket]

    # ---- internals ------------------------------------------------------------------
    def _contribute(self, bucket: int, count: int) -> range:
        self._pending[bucket] -= count
        if self._pending[bucket] > 0 or self._learning:
            return NOTHING
        start = self._next
        while self._next < self._num_buckets and self._pending[self._next] <= 0:
            self._next += 1
        return range(start, self._next)

    def check_open(self, bucket: int, slot: int) -> None:
        """Raise :class:`LateGradient` naming param ``slot`` if ``bucket`` launched this step."""
        if bucket < self._next:
            raise LateGradient(
                f"fxzero: param {self._table.called(slot)!r} of {self._table.describe_optimizer()} received a gradient "
                f"after its bucket {bucket} was already reduce-scattered in this step: an earlier backward of this step "
                "reached that bucket while this optimizer was not in no_sync(). Run every backward but the last inside "
                "the `no_sync()` of every DistributedOptimizer whose params it reaches (two optimizers: `with "
                "opt_a.no_sync(), opt_b.no_sync():`), or detach what the earlier loss should not train, or call "
                "`optimizer.step()`/`zero_grad()` (or `model.zero_grad()` over every param of this optimizer) between backwards."
            )

    def _arrived(self) -> None:
        """Every gradient: at the first of a backward, count exactly the forwards this
        backward executes (again, for one an earlier backward ran with ``retain_graph``)
        and take the others out."""
        self._written = True
        task = self._engine.task_id()
        if task == self._task or task == -1:
            return
        self._task = task
        # each param's requires_grad, in one C-level pass (see _follow_freezing)
        self._follow_freezing(bytes(map(_REQUIRES_GRAD, self._table.params)))
        live = []
        for forward in self._forwards:
            node = forward.node()
            runs = node is not None and self._engine.will_execute(node)
            if runs and forward.task not in (-1, task):  # run again: the earlier backward consumed its counts
                forward.counted = False
            if forward.task == -1 or runs:  # one a backward ran keeps its counts consumed, not taken out
                if runs != forward.counted:
                    self._adjust(forward.counts, 1 if runs else -1)
                    forward.counted = runs
            if runs:
                forward.task = task
            if node is not None:
                live.append(forward)
        self._forwards = live

    def _follow_freezing(self, requires: bytes) -> None:
        """A frozen param (``requires_grad=False``) delivers no gradient, so its eager count
        would hold its bucket, and every bucket after it, until the end of backward: a
        frozen backbone (LoRA, gradual unfreezing) would lose all overlap. Asked at the start
        of each backward, since a param may be frozen or unfrozen between any two; one bytes
        comparison when nothing changed. (Compiled graphs count what their backward delivers.)"""
        if requires == self._requires_seen:
            return
        self._requires_seen = requires
        for slot, wants in enumerate(requires):
            frozen = 0 if wants else 1
            if frozen == self._frozen[slot]:
                continue
            self._frozen[slot] = frozen
            if not self._compiled[slot] or self._mixed[slot]:  # counted as an eager contribution
                bucket, delta = self._bucket_of[slot], -1 if frozen else 1
                self._baseline[bucket] += delta
                self._pending[bucket] += delta

    def _adjust(self, counts: Sequence[tuple[int, int]], sign: int) -> None:
        for bucket, count in counts:
            self._pending[bucket] += sign * count


_SCALARS = (bool, int, float, str, bytes, tuple, type(None))


def _is_state(value: Any) -> bool:
    """A field that holds state (not a callable, the engine or a tensor view of another field)."""
    return isinstance(value, (*_SCALARS, bytearray, list))


def _copied(value: Any) -> Any:
    if isinstance(value, bytearray):
        return bytearray(value)
    if isinstance(value, list):
        return [copy.copy(item) for item in value]  # a _Forward's fields change in place
    return value
