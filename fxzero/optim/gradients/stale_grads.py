"""Gradients the last step consumed, left in the grad buffers and overwritten instead of zeroed.

``step()`` consumes the gradients: the next backward starts from zero. Zeroing every flat
grad buffer at the end of each step is one more pass over all of them (on one CPU core,
1.1 ms of a 6.4 ms fp32 ``fused=True`` step of 5.2M params, ``benchmarks/update.py``), and
it makes the next backward's first write an add, which reads the zeros back. So at the end
of a step the region of every param that may hold a gradient is marked **stale**: its bytes
are the last step's and count as zero. The next gradient written into a stale region
*overwrites* it (``copy_``) and clears the mark; later gradients of the step add, as before.
A region still stale when its bucket's reduction launches (its param got no gradient on
this rank, or is frozen) is zeroed right before the launch. Every read of the gradients
comes after that launch: the reduction itself, and after it the norms, clipping,
``GradScaler``, the ``p.grad`` views, ``full_grads()`` and the update, which all wait for
:meth:`~fxzero.optim.gradients.reduced_grads.ReducedGrads.finish_grad_sync` (it launches
every bucket not launched yet) or come after the end of a backward (which launches them too).

Which regions may hold a gradient after a step: those of the params that got one on some
rank (the step's presence counts, summed over ranks: the reduction writes a param's sum
into every rank's shard), or by hand. A ``zero_grad()`` without a step has no such counts:
then every param's region is marked. A mark never clears but by a write or a zeroing, so
marking more than needed costs a zeroing, never a wrong gradient.

Not used when the MXFP8 gather lands in the grad buffer
(``Config.reuse_grad_buf_for_mxfp8_param_ag``): its bytes are a gather's, not a gradient's,
and landing zeroes them.

The common step (every param gets a gradient) costs one memcpy of the flags and one
comparison per gradient hand-off; the per-step path allocates nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..._torch_compat import foreach_add_, foreach_copy_
from ..layout.buffers import Bucket

__all__ = ["StaleGrads"]


class StaleGrads:
    """Per param: whether its region of the grad buffer holds a consumed gradient (stale)."""

    def __init__(self, main_grads: Sequence[torch.Tensor], bucket_of: Sequence[int], buckets: Sequence[Bucket]) -> None:
        n = len(main_grads)
        self._main_grads = tuple(main_grads)
        """Each param's region of its bucket's ``grad_data`` (``param.main_grad``)."""
        self._bucket_of = tuple(bucket_of)
        self._buckets = tuple(buckets)
        self._slots_of: list[list[int]] = [[] for _ in buckets]
        for slot, bucket in enumerate(bucket_of):
            self._slots_of[bucket].append(slot)
        self._sizes = [len(slots) for slots in self._slots_of]
        self._stale = bytearray(n)
        self._count = [0] * len(buckets)
        """Stale params per bucket: 0 in the common case, where nothing is looked up."""
        self._ones = b"\x01" * n
        self._zeros = bytes(n)

    def stale(self, slot: int) -> bool:
        return bool(self._stale[slot])

    # ---- the end of a step ------------------------------------------------------------
    def consumed(self, present: Optional[Sequence[float]]) -> None:
        """The step consumed the gradients. ``present[slot]``: how many ranks gave param
        ``slot`` a gradient (``None`` when not counted: every region may hold one)."""
        if present is None or 0.0 not in present:  # the common case: one memcpy
            self._stale[:] = self._ones
            self._count[:] = self._sizes
            return
        for slot, got in enumerate(present):
            if got and not self._stale[slot]:
                self._stale[slot] = 1
                self._count[self._bucket_of[slot]] += 1

    # ---- writes ---------------------------------------------------------------------
    def write(self, slot: int, grad: torch.Tensor) -> None:
        """Param ``slot``'s eager gradient into its region: overwrites a stale one, else adds."""
        main_grad = self._main_grads[slot]
        if not self._stale[slot]:
            main_grad.add_(grad)
            return
        self._stale[slot] = 0
        self._count[self._bucket_of[slot]] -= 1
        if grad.layout == torch.strided:
            main_grad.copy_(grad)
        else:  # a sparse gradient cannot be copied into a dense tensor
            main_grad.zero_().add_(grad)

    def write_group(self, bucket: int, main_grads: list[torch.Tensor], grads: Sequence[torch.Tensor], slots: torch.Tensor,
                    span: Optional[slice]) -> None:  # fmt: skip
        """A compiled backward's ``grads`` of params ``slots`` (all in ``bucket``; ``span`` when
        consecutive) into their regions: one multi-tensor call when they are all stale or none is."""
        count = self._count[bucket]
        if count == 0:
            foreach_add_(main_grads, grads)
            return
        if span is not None:
            stale = self._stale.count(1, span.start, span.stop)
            if stale == len(main_grads):
                foreach_copy_(main_grads, grads)
                self._stale[span] = self._zeros[: span.stop - span.start]
                self._count[bucket] = count - stale
                return
            if stale == 0:
                foreach_add_(main_grads, grads)
                return
        for slot, main_grad, grad in zip(slots.tolist(), main_grads, grads):
            if self._stale[slot]:
                self._stale[slot] = 0
                self._count[bucket] -= 1
                main_grad.copy_(grad)
            else:
                main_grad.add_(grad)

    # ---- before a read ----------------------------------------------------------------
    def zero_left(self, bucket: int) -> None:
        """Zero the regions of ``bucket`` still stale: right before its reduction launches."""
        count = self._count[bucket]
        if count == 0:
            return
        slots = self._slots_of[bucket]
        if count == len(slots):  # no param of the bucket got a gradient: one call
            self._buckets[bucket].grad_data.zero_()
            for slot in slots:
                self._stale[slot] = 0
        else:
            for slot in slots:
                if self._stale[slot]:
                    self._stale[slot] = 0
                    self._main_grads[slot].zero_()
        self._count[bucket] = 0
