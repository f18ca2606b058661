"""Params changed behind the optimizer's back, noticed before each update.

Three things can silently break the link between the model's params and the
optimizer after construction; :class:`ParamWatch` checks for them at the top of
every ``step()``:

* **moved or cast params** (``model.double()``, ``.half()``, ``.to(device)``,
  ``param.data = t``): the param stops being a view of the flat buffer, so the step
  would update memory the model no longer reads. Caught by comparing each param's
  ``data_ptr()`` with the view's, and reported as an error naming the param, unless
  the param holds a tensor of its view's dtype, device and shape (a move to the device it
  was on, such as ``model.to("cpu:0")``, or ``param.data = t``): then it is pointed back at
  the view, its values copied in first where they differ (not with ``overlap_param_gather``).
* **tensor hooks registered after a compiled graph that reads the param was built**:
  that graph's backward hands the gradient to fxzero without running them. An error.
* **values written** (``model.load_state_dict(pretrained)``, ``p.data.copy_``,
  ``nn.init``) when the optimizer keeps separate fp32 masters (bf16/fp16 params, or the
  MXFP8 gather): the update would start from the stale masters and write them back.
  Each rank compares its own shard of every such bucket with what the optimizer last
  put there (:meth:`~fxzero.optim.params.param_sync.Gather.own_values`) and adopts the values
  that differ into its masters. Version counters would miss ``p.data`` writes (``.data``
  has a counter of its own), so the check compares values: one copy and one comparison
  of 1/dp of those buckets per step, the comparison on 8-byte words where the shard's
  alignment allows (fewer, wider elements to compare than bf16 ones); under
  ``Config.compiled_update``, one compiled loop that rounds and compares, writing nothing
  (:meth:`~fxzero.optim.params.param_sync.Gather.still_holds`; every rounding where the shard's
  length and offset are even, stochastic rounding always). fp32 params without MXFP8 *are*
  their masters and need no check.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ..._torch_compat import dtensor_local, is_dtensor, tensor_hooks
from ..layout.mesh import local_of, rebind
from .param_sync import Gather, ParamSync, as_words
from ..layout.param_table import ParamTable
from ..layout.shards import BucketShard

__all__ = ["ParamWatch"]

log = logging.getLogger(__name__)


class ParamWatch:
    """Per-step checks that the params are still the ones the optimizer updates."""

    def __init__(
        self, table: ParamTable, shards: Sequence[BucketShard], gather: Gather, rank: int, compiled: Sequence[int], *,
        overlapped: Optional[ParamSync] = None,
    ) -> None:  # fmt: skip
        self._overlapped = overlapped
        """The gathers that outlive ``step()`` (``overlap_param_gather``), or ``None``: then a
        param's copy holding other values is always taken in (see :func:`_rebind_copy`)."""
        self._synced_at = 0
        """The gathers' generation at which every param was last seen a view of its buffer with
        no gather in flight (:meth:`note_synced`): a copy taken since holds current values."""
        self.table, self.params, self.gather, self.rank = table, table.params, gather, rank
        # a DTensor param has no storage of its own: its local tensor is the buffer's view
        self._dtensors = tuple(i for i, p in enumerate(self.params) if is_dtensor(p))
        self._dtensor_params = tuple(self.params[i] for i in self._dtensors)
        self._local_pointers = [local_of(self.params[i]).data_ptr() for i in self._dtensors]
        self._pointers = [p.data_ptr() for p in self.params]
        self._views = [local_of(p) if is_dtensor(p) else p.data for p in self.params]
        """Each param's view of the flat buffer, to point a param back at after a no-op move."""
        self._compiled = compiled
        self._separate = [s for s in shards if not s.main_is_param]
        sizes: dict[torch.dtype, int] = {}
        for shard in self._separate:
            own = shard.bucket.param_shards[rank]
            sizes[own.dtype] = max(sizes.get(own.dtype, 0), own.numel())
        scratch = {dtype: torch.empty(n, dtype=dtype, device=self.params[0].device) for dtype, n in sizes.items()}
        self.scratch = tuple(scratch.values())
        """Where the expected values of a shard are rebuilt: one per param dtype, the largest shard's size."""
        self._expected = [scratch[s.bucket.param_data.dtype][: s.main.numel()] for s in self._separate]
        self._words = [(as_words(e), as_words(s.bucket.param_shards[rank])) for e, s in zip(self._expected, self._separate)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.scratch)

    def note_synced(self) -> None:
        """``opt.finish_param_sync()`` returned: if every param is still a view of its buffer, a
        ``param.data = t`` from now until the next step's gathers holds values the user chose
        with every gather landed, and is taken in."""
        if self._overlapped is not None and self._overlapped.stale == 0 and list(map(torch.Tensor.data_ptr, self.params)) == self._pointers:
            self._synced_at = self._overlapped.generation

    @property
    def _adopt(self) -> bool:
        return self._overlapped is None or self._synced_at == self._overlapped.generation

    def check(self) -> None:
        """Raise if a param was moved, cast or rebound, or got tensor hooks too late."""
        # one C-level pass each in the common case; the loop below only names the culprit
        if (
            list(map(torch.Tensor.data_ptr, self.params)) == self._pointers
            and not any(map(tensor_hooks, self.params))
            and (not self._dtensor_params or list(map(torch.Tensor.data_ptr, map(dtensor_local, self._dtensor_params))) == self._local_pointers)
        ):
            return
        adopt = self._adopt
        for slot, (param, pointer) in enumerate(zip(self.params, self._pointers)):
            if param.data_ptr() != pointer:
                self._rebind(slot, param, adopt)
        for slot, pointer in zip(self._dtensors, self._local_pointers):
            param = self.params[slot]
            if dtensor_local(param).data_ptr() != pointer:
                self._rebind(slot, param, adopt)
        for slot, param in enumerate(self.params):
            if tensor_hooks(param) and self._compiled[slot]:
                raise RuntimeError(_late_hook_message(self.table.label(slot)))

    def _rebind(self, slot: int, param: torch.Tensor, adopt: bool) -> None:
        refused = _rebind_copy(param, self._views[slot], adopt)
        if refused == "moved":
            raise RuntimeError(_moved_message(self.table.label(slot), param))
        if refused == "in flight":
            raise RuntimeError(_copy_in_flight_message(self.table.label(slot)))

    def adopt_outside_writes(self) -> None:
        """Masters take every value of this rank's shards written outside the optimizer."""
        for shard, expected, (expected_words, current_words) in zip(self._separate, self._expected, self._words):
            current = shard.bucket.param_shards[self.rank]
            holds = self.gather.still_holds(shard.bucket.index, shard.main, current)
            if holds:  # told in one pass that writes nothing
                continue
            self.gather.own_values(shard.bucket.index, shard.main, expected)
            if holds is not None or not torch.equal(expected_words, current_words):
                changed = expected.ne(current)
                shard.main[changed] = current[changed].to(shard.main.dtype)
                log.info(
                    "bucket %d: %d values written outside the optimizer taken into its fp32 masters",
                    shard.bucket.index,
                    int(changed.sum()),
                )


def _rebind_copy(param: torch.Tensor, view: torch.Tensor, adopt: bool) -> Optional[str]:
    """Point ``param`` back at its buffer ``view`` if it now holds a tensor of the same dtype,
    device and shape: a move to the device it was on (``model.to("cpu:0")`` copies CPU
    tensors, whose device is ``cpu``: HF Trainer and Accelerate move the model to their device
    after the optimizer exists), or ``param.data = t``. Values that differ (Trainer's resume
    loads the checkpoint's weights into those copies) are copied into the view first, as
    torch.optim would go on training whatever ``param.data`` now holds, when ``adopt``: with
    ``overlap_param_gather`` a copy taken before the gathers landed holds stale values that
    would undo a step, so only one made after ``opt.finish_param_sync()`` is taken in
    (``"in flight"`` otherwise). A cast or a real move is refused (``"moved"``)."""
    local = local_of(param)
    same = local.dtype == view.dtype and local.device == view.device and local.shape == view.shape
    if not same:
        return "moved"
    if not torch.equal(local.data, view):
        if not adopt:
            return "in flight"
        view.copy_(local.data)
        log.info("values written into a copy of a param taken into the optimizer's flat buffer")
    rebind(param, view)
    log.info("a param moved to the device it was on is a view of the optimizer's flat buffer again")
    return None


def _moved_message(label: str, param: torch.Tensor) -> str:
    return (
        f"fxzero: param {label!r} (now {param.dtype} on {param.device}) is no longer a view of the "
        "optimizer's flat buffer: the model was cast or moved (model.double()/.half()/.to(...)) or `param.data` "
        "was replaced after DistributedOptimizer was built, so step() could not update it. Move and cast the "
        "model first, then build the optimizer."
    )


def _copy_in_flight_message(label: str) -> str:
    return (
        f"fxzero: param {label!r}'s `.data` was replaced by a tensor holding other values while the all-gathers of "
        "Config(overlap_param_gather=True) could still land after it was taken: its values may be older than the "
        "last step's, and taking them in would undo it. Call opt.finish_param_sync() first, then replace "
        "`param.data` (or write in place: `param.data.copy_(t)`)."
    )


def _late_hook_message(label: str) -> str:
    return (
        f"fxzero: param {label!r} got a tensor hook (register_hook) after a compiled graph reading it "
        "was built; that graph's backward hands its gradient to fxzero without running the hook. Register "
        "hooks before the first compiled call (or call torch.compiler.reset() after registering them)."
    )
