"""This step's reduced gradients: finished once, measured once, scaled once.

Between backward and the update, gradients are read (the global norm ``step()``
reports and clips by; ``torch.nn.utils.clip_grad_norm_`` and ``GradScaler`` through
``p.grad``, see :mod:`fxzero.optim.gradients.grad_views`) and scaled (clipping, unscaling).
Everything needs this rank's shards holding the average over ranks, so
:meth:`ReducedGrads.finish_grad_sync` waits for the step's reduce-scatters once, and the first
read all-reduces, once per step, one small fp64 vector: a "got a gradient" count per
param and each param's squared norm over this rank's fragments (padding excluded).
Clipping by hand and then calling ``step()`` therefore communicates once. Under hierarchical
sharding the counts are summed over the instances too (a second, smaller all-reduce): a param
that got gradients in one instance only is present, and stepped, in every instance.

Scaling is recorded per param (a Python float each) and applied once, by
:meth:`ReducedGrads.apply` in ``step()``: torch's clipping multiplies every gradient by
the same factor, which becomes one ``_foreach_mul_`` over the shards; different
factors per param multiply the fragments.

The same all-reduce carries one more number: how many ranks found params written while
the last step's gathers were in flight (:meth:`~fxzero.optim.params.param_sync.ParamSync.take_written`),
so that every rank raises that error together, before the update.

Gradients assigned by hand (:mod:`fxzero.optim.gradients.hand_grads`) are written into this rank's
fragments as they are (:meth:`ReducedGrads.use_as_is`) after the reductions finished;
their statistics are this rank's own (present, and ``||g||^2`` of the whole tensor),
never summed over ranks, and need no collective of their own.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..._torch_compat import foreach_mul_, foreach_norm
from ..communication.comm import DataParallelGroup
from .grad_reductions import GradReductions
from .fragment_norms import FragmentNorms
from .hand_grads import HandGrad
from .ledger import Ledger
from ..layout.mesh import MeshNorms
from ..params.param_sync import ParamSync, written_in_flight
from ..layout.shards import BucketShard, FragmentTensor

__all__ = ["ReducedGrads"]


class ReducedGrads:
    """This rank's averaged gradient fragments, per-param global statistics and scales."""

    def __init__(
        self,
        ledger: Ledger,
        reductions: GradReductions,
        shards: Sequence[BucketShard],
        fragments: Sequence[FragmentTensor],
        dp: DataParallelGroup,
        mesh_norms: Optional[MeshNorms] = None,
        param_sync: Optional[ParamSync] = None,
    ) -> None:
        self.ledger, self.reductions = ledger, reductions
        self._param_sync = param_sync
        """Asked once per step for this rank's finding of params written while gathers were in flight."""
        self.mesh_norms = mesh_norms
        """With DTensor params: sums the norms over the other mesh dims too, each param once."""
        self.shards, self.fragments, self.dp = tuple(shards), tuple(fragments), dp
        self.num_params = n = len(ledger.presence)
        device = shards[0].main.device
        self._grads = [f.grad for f in fragments]
        self._shard_grads = [s.main_grad for s in shards]
        self._slot_list = [f.slot for f in fragments]
        self._slots = torch.tensor(self._slot_list, dtype=torch.int64, device=device)
        self.fragment_norms = FragmentNorms(self._grads)
        """Each fragment's gradient norm, per run of adjacent fragments (:mod:`.fragment_norms`)."""
        measured = [self._slot_list[i] for i in self.fragment_norms.order]
        self._measured_slots = torch.tensor(measured, dtype=torch.int64, device=device)
        """The slot of each fragment norm, in the order :class:`FragmentNorms` writes them."""
        self._of_slot: list[list[FragmentTensor]] = [[] for _ in range(n)]
        for frag in fragments:
            self._of_slot[frag.slot].append(frag)
        self._stats = torch.zeros(2 * n + 1, dtype=torch.float64, device=device)
        # made once: the step path neither slices nor allocates them; presence and the written flag
        # side by side, summed over the instances too (hierarchical sharding), the squares not
        self._got_stats, self._written_stat, self._square_stats = self._stats[:n], self._stats[n : n + 1], self._stats[n + 1 :]
        self._counts = self._stats[: n + 1]
        self._alone = _placer(measured, n) if dp.size == 1 and dp.replica_count == 1 and mesh_norms is None else None
        """At world size 1 with no other mesh dim: puts the fragments' squares (in
        :class:`FragmentNorms`' order) in slot order; ``None`` where they are summed over ranks."""
        self._scale = [1.0] * n
        self._scaled = False
        self.zeroed = bytearray(n)
        """``zeroed[slot]`` is 1 once the param's gradient was zeroed through its view this step."""
        self._any_zeroed = False
        self.reset()

    def reset(self) -> None:
        """The gradients were consumed or zeroed: nothing finished, measured or scaled."""
        self._finished = False
        self._got: list[float] = []
        self._squares: list[float] = []
        self._hand: dict[int, float] = {}  # slot -> ||g||^2 of a gradient assigned by hand
        if self._scaled:
            self._scale = [1.0] * self.num_params
            self._scaled = False
        if self._any_zeroed:
            self.zeroed[:] = bytes(self.num_params)
            self._any_zeroed = False

    def finish_grad_sync(self) -> None:
        """Wait for this step's reductions; fp32 copies of 16-bit grad shards. The step's
        second phase, named as Megatron-LM's ``finish_grad_sync()``; idempotent, so any
        gradient read before ``step()`` (a clip, ``GradScaler``) may call it first."""
        if self._finished:
            return
        self.reductions.finish()
        for shard in self.shards:
            if not shard.main_grad_is_grad:
                shard.main_grad.copy_(shard.bucket.grad_shards[self.dp.rank])
        self._finished = True

    def _measure(self, norms: bool = True) -> None:
        """Per-param presence and squared norms, summed over ranks: one all-reduce. Presence
        alone (``norms=False``) reads no gradient."""
        if self._squares or (self._got and not norms):
            return
        self.finish_grad_sync()
        if self._alone is not None:
            self._measure_alone(self._alone, norms)
        else:
            self._measure_together(norms)
        self._count_hand()

    def _measure_alone(self, place: Callable[[Sequence[float]], Sequence[float]], norms: bool) -> None:
        """Nothing to sum over (world size 1, no other mesh dim) and one fragment per param:
        Python floats straight from the norms. A product of two fp32 values is exact in
        fp64, so each square has the bits the tensor path's fp64 ``square()`` gives, in one
        read of the norms instead of six small kernels."""
        found = self._param_sync.take_written() if self._param_sync is not None else None
        if found is not None:
            raise written_in_flight(found, 1)
        self._got = list(map(float, self.ledger.presence))  # got: a count of ranks, 0.0 for none
        if norms:
            values = self.fragment_norms.compute().tolist()
            self._squares = list(place(list(map(operator.mul, values, values))))

    def _measure_together(self, norms: bool) -> None:
        n, stats, squares = self.num_params, self._stats, self._square_stats
        self._got_stats.copy_(self.ledger.presence_tensor)
        if self._grads and norms:
            # per-fragment norms in fp32 (as clip_grad_norm_ does; fp64 elements cost 16x), squared
            # and summed per param in fp64
            squares.zero_().index_add_(0, self._measured_slots, self.fragment_norms.compute().double().square())
        else:
            squares.zero_()
        found = self._param_sync.take_written() if self._param_sync is not None else None
        self._written_stat.fill_(0.0 if found is None else 1.0)
        self.dp.all_reduce_sum(stats)
        if self.dp.replica_count > 1:
            # a param may get gradients in one instance only: every instance must count it present
            # (and step it); the squares are of shards the instances already summed, not summed again
            self.dp.sum_over_instances(self._counts, "all-reduce of the gradient flags over the instances")
        if self.mesh_norms is not None:
            self.mesh_norms.sum_once(squares)
        values = stats.tolist()
        if values[n]:
            raise written_in_flight(found, int(values[n]))
        self._got = values[:n]  # got: a count of ranks, 0.0 for none
        if norms:
            self._squares = values[n + 1 :]

    @property
    def present_counts(self) -> Optional[Sequence[float]]:
        """How many ranks gave each param a gradient this step (by hand too), once measured;
        ``None`` before: what the step leaves in the grad buffers (:mod:`.stale_grads`)."""
        return self._got or None

    def _count_hand(self) -> None:
        for slot, square in self._hand.items():
            self._got[slot] = max(self._got[slot], 1.0)
            if self._squares:
                self._squares[slot] = square

    # ---- reads -------------------------------------------------------------------
    def norms(self, slots: Sequence[int], ord: float = 2.0) -> list[float]:
        """Global ``ord``-norms of params ``slots``' averaged gradients, scales included."""
        if ord == 2.0:
            self._measure()
            return [math.sqrt(self._squares[s]) * abs(self._scale[s]) for s in slots]
        values = self._other_norms(float(ord))
        return [values[s] * abs(self._scale[s]) for s in slots]

    def _other_norms(self, ord: float) -> list[float]:
        if not (ord == math.inf or ord > 0):
            raise ValueError(f"fxzero: gradient norms of order {ord} are not supported; use 2, inf or a p > 0")
        self.finish_grad_sync()
        values = torch.zeros(self.num_params, dtype=torch.float64, device=self._stats.device)
        if self._grads:
            norms = torch.stack(foreach_norm(self._grads, ord)).double()
            if ord == math.inf:
                values.scatter_reduce_(0, self._slots, norms, "amax")
            else:
                values.index_add_(0, self._slots, norms.pow(ord))
        if ord == math.inf:
            self.dp.all_reduce_max(values)
            if self.mesh_norms is not None:
                self.mesh_norms.max_over(values)
            return values.tolist()
        self.dp.all_reduce_sum(values)
        if self.mesh_norms is not None:
            self.mesh_norms.sum_once(values)
        return values.pow(1.0 / ord).tolist()

    def scale_of(self, slot: int) -> float:
        """The factor recorded on param ``slot``'s gradient so far (applied in :meth:`apply`)."""
        return self._scale[slot]

    def total_norm(self, dropped: Iterable[int] = ()) -> float:
        """Global L2 norm over every param except ``dropped`` (what ``step()`` clips by)."""
        self._measure()
        skip = set(dropped)
        if not self._scaled and not skip:
            return math.sqrt(sum(self._squares))
        return math.sqrt(
            sum(q * self._scale[s] ** 2 for s, q in enumerate(self._squares) if s not in skip)
        )

    def measure(self, dropped: Sequence[int] = ()) -> tuple[float, list[int]]:
        """The step's third phase: the global norm over every param except ``dropped`` and the
        params that got no gradient on any rank (plus ``dropped``); one all-reduce, once."""
        return self.total_norm(dropped), self.absent(dropped)

    def absent(self, dropped: Iterable[int] = ()) -> list[int]:
        """Params that got no gradient on any rank, plus ``dropped``: the flags alone, one
        all-reduce, no gradient read (``Config.measure_grad_norm=False`` measures only them)."""
        self._measure(norms=False)
        if not dropped and 0.0 not in self._got:  # the common case, one C-level scan
            return []
        skip = set(dropped)
        return [s for s, got in enumerate(self._got) if not got or s in skip]

    # ---- writes ------------------------------------------------------------------
    def clip(self, max_norm: float, ord: float = 2.0) -> float:
        """Scale every gradient by ``clip_grad_norm_``'s factor for the global ``ord``-norm
        over all params; returns that norm (before clipping)."""
        norms = torch.tensor(self.norms(range(self.num_params), ord), dtype=torch.float64)
        total = float(torch.linalg.vector_norm(norms, ord))
        self.scale(range(self.num_params), min(1.0, max_norm / (total + 1e-6)))
        return total

    def scale(self, slots: Iterable[int], factor: float) -> None:
        """Multiply params ``slots``' gradients by ``factor`` (applied in :meth:`apply`)."""
        if factor == 1.0:
            return
        for slot in slots:
            self._scale[slot] *= factor
        self._scaled = True

    def zero(self, slots: Sequence[int]) -> None:
        """Set params ``slots``' gradients to zero (they still count as present)."""
        self.finish_grad_sync()
        for slot in slots:  # model.zero_grad(set_to_none=False): one call per param anyway
            for frag in self._of_slot[slot]:
                frag.grad.zero_()
        for slot in slots:
            self._scale[slot] = 1.0
            self.zeroed[slot] = 1
            if self._squares:
                self._squares[slot] = 0.0
        self._any_zeroed = True

    def use_as_is(self, hand: Sequence[HandGrad]) -> None:
        """Write gradients assigned by hand into this rank's fragments, not averaged: each
        rank takes its own shards of the param from its own tensor. They replace whatever
        backward reduced for those params, and any scale recorded on their views."""
        if not hand:
            return
        self.finish_grad_sync()  # the 16-bit copies and the reductions land before, not over them
        for slot, grad in hand:
            flat = grad.detach().reshape(-1)
            for frag in self._of_slot[slot]:
                frag.grad.view(-1).copy_(flat[frag.where.param_offset : frag.where.param_offset + frag.where.numel])
            self._scale[slot] = 1.0
            self._hand[slot] = float(torch.linalg.vector_norm(flat, dtype=torch.float32)) ** 2
        self.ledger.grad_assigned()  # the grad buffers hold a gradient the step consumes
        if self._squares:  # measured already (a clip or GradScaler before the assignment)
            self._count_hand()

    def apply(self, factor: float = 1.0) -> None:
        """Multiply every gradient by its recorded scale times ``factor``."""
        if not self._scaled:
            if factor != 1.0:
                foreach_mul_(self._shard_grads, factor)
            return
        scales = [s * factor for s in self._scale]
        if all(s == scales[0] for s in scales):
            foreach_mul_(self._shard_grads, scales[0])
        else:
            foreach_mul_(self._grads, [scales[s] for s in self._slot_list])

    @contextlib.contextmanager
    def hidden(self, slots: Sequence[int]) -> Iterator[None]:
        """Give params ``slots``' fragments ``grad=None``, as torch.optim expects of params
        without a gradient, so zeros in the flat buffer never decay or move them."""
        hidden = [frag for slot in slots for frag in self._of_slot[slot]]
        for frag in hidden:
            frag.param.grad = None
        try:
            yield
        finally:
            for frag in hidden:
                frag.param.grad = frag.grad


def _placer(measured: Sequence[int], n: int) -> Optional[Callable[[Sequence[float]], Sequence[float]]]:
    """``values`` in ``measured`` order (each slot once) -> the same values in slot order, in C;
    ``None`` when ``measured`` is not every slot exactly once."""
    if sorted(measured) != list(range(n)) or n == 0:
        return None
    if n == 1:
        return lambda values: values
    where = [0] * n
    for position, slot in enumerate(measured):
        where[slot] = position
    return operator.itemgetter(*where)
