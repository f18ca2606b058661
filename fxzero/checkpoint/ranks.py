"""How the ranks of one checkpoint call agree: they all enter it, and they all fail alike.

Saving and loading are collective (:mod:`fxzero.checkpoint.io`), which makes two
mistakes hang instead of fail:

* **a call on some ranks only** (``if rank == 0: save_checkpoint(...)``), or with other
  arguments: the ranks that called it block in its first collective until the process
  group's timeout (minutes), and the errors then blame a dead peer.
  :meth:`CheckpointRanks.handshake` meets the other ranks through the group's key-value
  store first (no collective, so the path does not depend on the backend; tested on gloo)
  and raises on every rank that arrived within ``timeout`` seconds (by default the process
  group's own timeout, as long as DDP or DCP would wait for a late rank), naming the ranks
  that did not come or what each rank called. A rank that waits longer than
  :data:`ARRIVAL_WARNING` seconds says so early, naming the late ranks (a rank-0-only
  evaluation or upload before the save is ordinary; a forgotten call is not). A rank that
  timed out takes its call back, so the ranks' next calls meet again
  (:func:`~fxzero.optim.communication.arrival.meet`);
* **a failure on one rank** (its disk is full): the others would wait for it in the next
  collective. :meth:`CheckpointRanks.together` runs a step on every rank, then gathers every
  rank's failure, so all of them raise the same :class:`CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..optim.communication.arrival import Absent, Mismatch, meet
from ..optim.communication.comm import DataParallelGroup
from .state import CheckpointError

__all__ = ["ARRIVAL_WARNING", "CheckpointRanks"]

log = logging.getLogger(__name__)

ARRIVAL_WARNING = 30.0
"""Seconds a rank waits for late ranks at a checkpoint call before it warns, naming them."""

T = TypeVar("T")
_KEYS = "fxzero/checkpoint"


@dataclasses.dataclass(frozen=True)
class CheckpointRanks:
    """The optimizer's group, for the few small collectives a checkpoint needs (none at
    world size 1, where ``torch.distributed`` may not even be initialized)."""

    dp: DataParallelGroup

    def all_gather(self, obj: Any) -> list[Any]:
        if self.dp.size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp.size
        dist.all_gather_object(out, obj, group=self.dp.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.dp.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.dp.group, group_src=0)
        return box[0]

    def dcp_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.dp.group, "no_dist": self.dp.size == 1}

    def together(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on every rank; if it raised on any rank, every rank raises one
        :class:`CheckpointError` with each failing rank's cause (a ``CheckpointError``'s
        own message, or ``what`` and the exception; DCP's ``CheckpointException`` is a
        ``BaseException`` that ``except Exception`` would miss, so it is caught here too)."""
        result, failure, error = None, None, None
        try:
            result = fn()
        except CheckpointError as err:
            failure, error = str(err), err
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank must hear of it
            failure, error = f"{what} failed: {_cause(err)}", err
        try:
            failures = self.all_gather(failure)
        except RuntimeError as err:  # a peer died: gloo/NCCL errors are RuntimeErrors
            raise CheckpointError(
                f"{what}: rank {self.dp.rank} of {self.dp.size} lost its peers (a rank probably died): {err}"
            ) from (error or err)
        if any(f is not None for f in failures):
            raise CheckpointError(_combine(failures)) from error
        return result  # type: ignore[return-value]

    def handshake(self, call: str, timeout: Optional[float], device: torch.device) -> None:
        """Return once every rank of the group has called ``handshake`` with the same
        ``call`` (``"save_checkpoint(step=5)"``); raise on every rank that arrived if one
        called something else, or if some rank has not arrived within ``timeout`` seconds
        (``None``: the process group's timeout); warn after :data:`ARRIVAL_WARNING` seconds
        (:func:`~fxzero.optim.communication.arrival.meet`)."""
        try:
            meet(self.dp, _KEYS, call, timeout, device, warn_after=ARRIVAL_WARNING, late=functools.partial(self._late, call))
        except Mismatch as err:
            raise CheckpointError(
                "save_checkpoint and load_checkpoint are collective: every rank of the optimizer's group must make "
                f"the same call at the same point, but rank 0 called {err.first}{err.others}"
            ) from None
        except Absent as err:
            raise CheckpointError(
                f"{call} on rank {self.dp.rank}: rank(s) {err.missing or 'of the group'} of {self.dp.size} "
                f"did not call save_checkpoint/load_checkpoint within {err.timeout:g} s. Both are collective: every "
                "rank must call them, at the same point of the program (a rank that does long work of its own first, "
                "such as an evaluation on rank 0 only, needs a larger arrival_timeout)"
            ) from None

    def _late(self, call: str, missing: list[int], timeout: float) -> str:
        return (
            f"fxzero: {call} on rank {self.dp.rank} has waited {ARRIVAL_WARNING:g} s for rank(s) "
            f"{missing} of {self.dp.size}; it keeps waiting up to {timeout:g} s "
            "(every rank must call it; pass arrival_timeout to fail sooner)"
        )


def _cause(err: BaseException) -> str:
    """The exception, or for DCP's ``CheckpointException`` the exception of each rank it wraps."""
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


def _combine(failures: list[Optional[str]]) -> str:
    """One message: the failure itself when every rank failed alike, else each rank's."""
    if len(set(failures)) == 1:
        return str(failures[0])
    return "; ".join(f"rank {rank}: {failure}" for rank, failure in enumerate(failures) if failure is not None)
