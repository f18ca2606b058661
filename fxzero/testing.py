"""A multi-rank harness: N gloo ranks on 127.0.0.1 that run functions on request.

Starting a rank costs seconds (process spawn, torch import, gloo init), so a
:class:`RankPool` starts its ranks once and runs many functions on them. Functions are
sent by reference (module-level functions only) and run on every rank at once.

Failure behaviour, which is the point of a harness:

* an exception on any rank raises :class:`RankError` in the caller with that rank's
  traceback (other ranks blocked in a collective with it are then killed);
* if any rank does not answer within ``timeout`` seconds (a hung collective), the pool
  is killed and :class:`RankTimeout` names the ranks that were still running;
* a pool that failed is closed; :func:`get_pool` makes a fresh one next time;
* ranks whose caller died without closing the pool (killed, crashed) exit by themselves once idle;
* a function, argument or result that cannot be pickled is reported at once (the task is
  pickled in the caller before anything is sent, each result on its rank), not as a timeout:
  a queue's feeder thread would only print the pickling error and drop the message.

The process group is created with a short timeout too, so a rank stuck in a
collective also raises on its own.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler  # the pickler mp queues use (torch adds its tensor sharing)

__all__ = ["RankError", "RankPool", "RankTimeout", "close_pools", "get_pool", "run_ranks"]


class RankError(RuntimeError):
    """A function raised on one or more ranks."""


class RankTimeout(RuntimeError):
    """One or more ranks did not finish in time (for example, a hung collective)."""


def _worker(rank: int, world_size: int, port: int, sys_path: list[str], tasks: Any, results: Any, pg_timeout: float, parent: int) -> None:
    faulthandler.enable()  # a hard crash still prints where it happened
    sys.path[:] = sys_path
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
    )
    results.put((rank, True, _dumps("ready")))
    while (payload := _next_task(tasks, parent)) is not None:
        results.put((rank, *_run_task(payload)))
        torch.compiler.reset()  # compiled code must not leak into the next function
    dist.destroy_process_group()


_ORPHAN_CHECK = 1.0
"""Seconds an idle rank waits for a task before it checks that the process that started it lives."""


def _next_task(tasks: Any, parent: int) -> Any:
    """The next task, or ``None`` (stop) once the pool's process is gone. A rank's queue holds both
    ends of its pipe, so a killed caller (SIGKILL, a crash, a killed pytest) sends no stop and no
    end of file: the rank would wait for ever, a process the user has to find and kill. Orphaned,
    it is adopted by another process, which :func:`os.getppid` shows."""
    while True:
        try:
            return tasks.get(timeout=_ORPHAN_CHECK)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _dumps(obj: Any) -> bytes:
    return bytes(ForkingPickler.dumps(obj))


def _run_task(payload: bytes) -> tuple[bool, Any]:
    """``(True, pickled result)`` or ``(False, traceback text)``; never raises, so the rank
    answers whatever goes wrong (unpickling the task, the function, pickling its result)."""
    try:
        fn, args, kwargs = pickle.loads(payload)
    except BaseException:  # noqa: BLE001 - the traceback is the message
        return False, "the task could not be unpickled on this rank:\n" + traceback.format_exc()
    try:
        value = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - the traceback is the message
        return False, traceback.format_exc()
    try:
        return True, _dumps(value)
    except BaseException:  # noqa: BLE001 - the traceback is the message
        what = getattr(fn, "__qualname__", repr(fn))
        return False, f"{what} returned a {type(value).__name__} that cannot be pickled:\n" + traceback.format_exc()


def _loads(payload: bytes) -> tuple[bool, Any]:
    """A rank's pickled result, or ``(False, why)`` if it cannot be unpickled here."""
    try:
        return True, pickle.loads(payload)
    except Exception:  # noqa: BLE001 - the traceback is the message
        return False, "its result could not be unpickled in the caller:\n" + traceback.format_exc()


_GRACE = 2.0
"""Seconds ranks asked to stop get to exit by themselves (an idle rank needs about one)."""


class RankPool:
    """``world_size`` long-lived gloo ranks; :meth:`run` executes a function on all of them."""

    def __init__(self, world_size: int, *, pg_timeout: float = 30.0, start_timeout: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        # The parent hosts the rendezvous store on a port the OS picks: no free-port race.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self._store.port, list(sys.path), self._tasks[r], self._results, pg_timeout, os.getpid()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.closed = False
        self._collect(start_timeout, "start")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if self.closed:
            raise RuntimeError("RankPool is closed")
        what = getattr(fn, "__qualname__", repr(fn))
        try:  # once per rank: torch's tensor sharing hands each file descriptor out once
            payloads = [_dumps((fn, args, kwargs)) for _ in self._tasks]
        except Exception as err:  # noqa: BLE001 - pickle raises PicklingError, TypeError or AttributeError
            raise TypeError(
                f"run_ranks: cannot send {what} to the ranks, it does not pickle ({type(err).__name__}: {err}); "
                "pass a module-level function and picklable arguments"
            ) from err
        for q, payload in zip(self._tasks, payloads):
            q.put(payload)
        return self._collect(timeout, what)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        in_grace = False
        while len(values) + len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                ok, value = _loads(value) if ok else (ok, value)
                (values if ok else errors)[rank] = value
            except queue.Empty:  # drained: a rank that is not running any more has died
                self._note_dead(values, errors)
            if errors and not in_grace:  # the others get a short grace: ranks blocked with a failed one never answer
                deadline, in_grace = min(deadline, time.monotonic() + 5.0), True
        self._note_dead(values, errors)
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{what} failed on rank(s) {sorted(errors)} of {self.world_size}:\n{detail}")
        if len(values) < self.world_size:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(values))
            raise RankTimeout(f"{what}: rank(s) {missing} of {self.world_size} did not finish within {timeout:.0f}s")
        return [values[r] for r in range(self.world_size)]

    def _note_dead(self, values: dict[int, Any], errors: dict[int, str]) -> None:
        for rank, proc in enumerate(self._procs):
            if rank not in values and rank not in errors and not proc.is_alive():
                errors[rank] = f"rank {rank} process died (exit code {proc.exitcode}) without a Python exception"

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the ranks (politely if idle, by force after a short grace)."""
        self._ask_to_stop()
        self._reap(time.monotonic() + _GRACE)

    def _ask_to_stop(self) -> None:
        if not self.closed:
            self.closed = True
            for q in self._tasks:
                q.put(None)

    def _reap(self, deadline: float) -> None:
        """Wait for the ranks until ``deadline`` (one grace for all of them, not one each:
        they exit side by side), then kill those still running."""
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """A live pool of ``world_size`` ranks, reused across calls (restarted after a failure)."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.closed:
        if not _POOLS:
            # Stop idle ranks politely at exit (``fxzero.parity`` leaves its pool for the next
            # call): left to multiprocessing's own exit handler, their queues' semaphores leak
            # with a warning. Registered with the first pool, not on import; close_pools unregisters.
            atexit.register(close_pools)
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks (a shared, reused pool); per-rank results."""
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def close_pools() -> None:
    """Stop every pool's ranks, all pools at once (they exit side by side)."""
    pools = list(_POOLS.values())
    for pool in pools:
        pool._ask_to_stop()
    deadline = time.monotonic() + _GRACE
    for pool in pools:
        pool._reap(deadline)
    _POOLS.clear()
    atexit.unregister(close_pools)

