"""Gradient producers in, reduce-scatter launches out: the thin layer around the ledger.

Two producers report gradients that reached ``main_grad``:

* **eager** regions, through post-accumulate-grad hooks installed here: autograd has
  summed all of a param's eager contributions when the hook fires;
* **compiled** graphs, through the ``fxzero::grads_ready`` op that the backward pass
  inserts after each group of a bucket's gradients (:mod:`fxzero.passes.bucket_reduce_scatter`,
  :mod:`fxzero.compiled.binding`). Autograd never sees those gradients.

Each report goes to the :class:`~fxzero.optim.gradients.ledger.Ledger`, the one place that decides
when a bucket launches; :class:`GradSync` turns its answers into collectives through
:class:`GradReductions`, and queues an engine callback so that the end of each backward
launches whatever is left. On gloo the reduction is a chunked all-to-all
(:mod:`~fxzero.optim.gradients.grad_exchange`): each gradient hand-off is also a point where it may
move on.

The parts it hands to are given at construction, no callbacks: the reductions' ``landing``
(the MXFP8 gather that reuses the grad buffer lands a bucket before its grad memory is
written or reduced) and the optimizer's grad views, installed at the end of each backward.
A gradient for a bucket that already launched this step is late, unless every gradient of
the last backward was cleared since (``model.zero_grad()``, as DCGAN's loop calls it on D
after G's backward filled D's gradients); then the views reset the step as
``opt.zero_grad()`` does, before the gradient is written. The check is one comparison per gradient. The per-step path does no slicing and
no allocation: shard views come from the buckets, counters are preallocated.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional, Sequence

import torch

from ..._torch_compat import foreach_add_, in_backward, queue_end_of_backward
from .grad_reductions import GradReductions
from .grad_views import GradViews
from .ledger import Ledger
from .stale_grads import StaleGrads
from ..layout.mesh import MeshParams

__all__ = ["GradSync"]

log = logging.getLogger(__name__)


class GradSync:
    """Where gradients are reported: eager hooks, compiled hand-offs, the end of backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        ledger: Ledger,
        reductions: GradReductions,
        *,
        views: Optional[GradViews] = None,
        local_grads: frozenset[int] = frozenset(),
    ) -> None:
        self.params, self.ledger, self.reductions = tuple(params), ledger, reductions
        self._local_grads = local_grads
        """Slots of DTensor params: their gradient's local tensor goes into ``main_grad`` (:mod:`~fxzero.optim.layout.mesh`)."""
        self._landing = reductions.landing
        self._views = views
        """The optimizer's ``p.grad`` views: installed after each backward, and the judge of a late gradient."""
        self._stale: Optional[StaleGrads] = reductions.stale
        """Writes the gradients (overwriting the last step's, :mod:`.stale_grads`); ``None``: they add into ``main_grad``."""
        self._callback_queued = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # ---- eager path -------------------------------------------------------------
    def install_hooks(self) -> None:
        """Move each autograd gradient into ``main_grad`` as soon as it is accumulated.
        A frozen param (``requires_grad=False``) gets its hook too: torch refuses to register
        one on it, so it is unfrozen for the registration only. The hook lives on the param,
        so once the user unfreezes it (gradual unfreezing), its gradients are reduced over
        ranks like every other's (``tests/test_frozen_params.py``)."""
        for slot, param in enumerate(self.params):
            frozen = not param.requires_grad
            if frozen:
                param.requires_grad_(True)
            try:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(slot)))
            finally:
                if frozen:
                    param.requires_grad_(False)

    def _make_hook(self, slot: int) -> Callable[[torch.nn.Parameter], None]:
        bucket = self.ledger.bucket(slot)
        local = MeshParams.local_grad if slot in self._local_grads else None

        def hook(param: torch.nn.Parameter) -> None:
            grad = param.grad
            if grad is None:  # a compiled graph returned None: its op reported it
                return
            if self.ledger.has_launched(bucket):
                self._late(bucket, slot)
            if self._landing is not None:
                self._landing.wait(bucket)
            if self._stale is None:
                param.main_grad.add_(grad if local is None else local(param, grad))
            else:  # the first gradient of a step overwrites the last step's (:mod:`.stale_grads`)
                self._stale.write(slot, grad if local is None else local(param, grad))
            param.grad = None
            self._launch(self.ledger.eager_grad(slot))

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---- compiled path ----------------------------------------------------------
    def add_compiled(
        self, bucket: int, main_grads: list[torch.Tensor], grads: Sequence[torch.Tensor], slots: torch.Tensor, span: Optional[slice]
    ) -> None:
        """Add a compiled backward's ``grads`` of params ``slots`` (all in ``bucket``;
        ``span`` when they are consecutive) into their ``main_grads`` and report them."""
        if self.ledger.has_launched(bucket):
            self._late(bucket, int(slots[0]))
        if self._landing is not None:
            self._landing.wait(bucket)
        if self._stale is None:
            foreach_add_(main_grads, grads)
        else:
            self._stale.write_group(bucket, main_grads, grads, slots, span)
        self._launch(self.ledger.compiled_grads(bucket, len(main_grads), slots, span))

    def _late(self, bucket: int, slot: int) -> None:
        """A gradient for a launched bucket: the step starts over if the last backward's
        gradients were all cleared since (``model.zero_grad()``); else :class:`LateGradient`."""
        if self._views is None or not self._views.reset_if_cleared(slot):
            self.ledger.check_open(bucket, slot)

    # ---- launches ---------------------------------------------------------------
    def _launch(self, ready: Optional[range]) -> None:
        if ready is None:  # not a counted contribution, or under no_sync
            return
        self.reductions.progress()
        # Outside a backward (an op run by hand, a test) there is no engine to call us
        # back: step() launches what is left instead.
        if not self._callback_queued and in_backward():
            queue_end_of_backward(self._end_of_backward)
            self._callback_queued = True
        if ready:
            self.reductions.launch(ready)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.reductions.launch(self.ledger.end_of_backward())
        if self._views is not None:
            self._views.install()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients into ``main_grad`` without launching any reduce-scatter."""
        return self.ledger.no_sync()
