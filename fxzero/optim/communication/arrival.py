"""Meeting the other ranks without a collective: every rank of a group enters a call, or
the ranks that did fail in bounded time, naming the ones that did not.

Some calls are collective but are easily made on some ranks only: ``if rank == 0:
torch.save(opt.state_dict())`` (the DDP habit), ``if rank == 0: save_checkpoint(...)``.
Inside a collective the ranks that called would block until the process group's timeout
(minutes) and the errors would then blame a dead peer. :func:`meet` meets the other ranks
through the group's key-value store first (no collective, so it does not depend on the
backend) and raises :class:`Absent` on every rank that arrived if some rank has not arrived
within ``timeout`` seconds, or :class:`Mismatch` if the ranks made different calls. Each
caller turns those into its own error message. A rank that waits longer than ``warn_after``
seconds warns early, naming the late ranks. A rank that timed out takes its call back, so the
ranks' next calls meet again (each rank counts its own calls under ``prefix``); a late rank
that arrives after that times out too.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..._torch_compat import process_group_store, process_group_timeout
from .comm import DataParallelGroup

__all__ = ["Absent", "Mismatch", "meet"]

log = logging.getLogger(__name__)


class Absent(Exception):
    """Some ranks did not arrive in time."""

    def __init__(self, missing: list[int], timeout: float) -> None:
        super().__init__(missing, timeout)
        self.missing, self.timeout = missing, timeout


class Mismatch(Exception):
    """Every rank arrived, not all with the same call: ``first`` is rank 0's, ``others`` each differing rank's."""

    def __init__(self, first: str, others: str) -> None:
        super().__init__(first, others)
        self.first, self.others = first, others


def meet(
    dp: DataParallelGroup,
    prefix: str,
    call: str,
    timeout: Optional[float],
    device: torch.device,
    *,
    warn_after: float,
    late: Callable[[list[int], float], str],
) -> None:
    """Return once every rank of ``dp`` has called ``meet`` with ``prefix`` and the same
    ``call``; raise :class:`Mismatch` on every rank if one called something else, or
    :class:`Absent` if some rank has not arrived within ``timeout`` seconds (``None``: the
    process group's timeout); after ``warn_after`` seconds warn with ``late(missing, timeout)``.

    The n-th call of each rank meets the n-th call of the others (each rank counts its own
    calls in the store). Each rank compares its ``call`` with rank 0's and reports a
    difference before counting itself in, so when the last rank arrives everyone knows.
    O(1) store operations per rank; the previous call's keys are deleted."""
    if dp.size == 1:
        return
    timeout = process_group_timeout(dp.group, device) if timeout is None else timeout
    store, rank = process_group_store(dp.group), dp.rank
    generation = store.add(f"{prefix}/calls/{rank}", 1)
    key = f"{prefix}/{generation}"
    clock = _Clock(time.monotonic(), timeout, warn_after, lambda: late(_missing(store, key, dp.size), timeout))
    store.set(f"{key}/{rank}", call)
    arrived = False
    try:
        clock.wait(store, f"{key}/0", key, dp.size)
        first = store.get(f"{key}/0").decode()
        if first != call:
            store.append(f"{key}/differ", f"; rank {rank} called {call}")
        arrived = True
        if store.add(f"{key}/arrived", 1) == dp.size:
            store.set(f"{key}/all", "")
        clock.wait(store, f"{key}/all", key, dp.size)
    except Absent:
        _withdraw(store, prefix, key, rank, arrived)
        raise
    if store.check([f"{key}/differ"]):
        raise Mismatch(first, store.get(f"{key}/differ").decode())
    _forget(store, prefix, generation - 1, rank)
    dp.forget_note()  # every rank is here: a note this rank left at an earlier failed meeting is stale


@dataclasses.dataclass
class _Clock:
    """One meeting's deadlines."""

    start: float
    timeout: float
    warn_after: float
    late: Callable[[], str]
    warned: bool = False

    def wait(self, store: dist.Store, key: str, call_key: str, size: int) -> None:
        deadline, warn_at = self.start + self.timeout, self.start + self.warn_after
        if not self.warned and _wait_until(store, key, min(warn_at, deadline)):
            return
        if not self.warned and time.monotonic() < deadline:
            self.warned = True
            warnings.warn(self.late(), stacklevel=5)  # once: a log record besides would print it twice
        if _wait_until(store, key, deadline):
            return
        raise Absent(_missing(store, call_key, size), self.timeout)


def _missing(store: dist.Store, prefix: str, size: int) -> list[int]:
    return [r for r in range(size) if not store.check([f"{prefix}/{r}"])]


def _withdraw(store: dist.Store, prefix: str, key: str, rank: int, arrived: bool) -> None:
    """Take back this rank's part of a meeting that timed out, so that the ranks' next call
    meets again (the ranks that never came count no call for it)."""
    store.add(f"{prefix}/calls/{rank}", -1)
    store.delete_key(f"{key}/{rank}")
    if arrived:
        store.add(f"{key}/arrived", -1)


def _forget(store: dist.Store, prefix: str, generation: int, rank: int) -> None:
    """Every rank has arrived at the next call, so no one reads ``generation``'s keys any more."""
    if generation < 1:
        return
    key = f"{prefix}/{generation}"
    store.delete_key(f"{key}/{rank}")
    if rank == 0:
        for name in ("arrived", "all", "differ"):
            store.delete_key(f"{key}/{name}")


def _wait_until(store: dist.Store, key: str, deadline: float) -> bool:
    """Whether ``key`` appeared in ``store`` before ``deadline`` (``time.monotonic()``)."""
    try:
        store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError:  # DistStoreError: the timeout
        return False
    return True
