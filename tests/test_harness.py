"""The multi-rank harness reports failures and hangs instead of hanging itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fxzero.testing import RankError, RankPool, RankTimeout, get_pool, run_ranks


def _ranks_and_sum() -> tuple[int, int, float]:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_runs_with_its_own_rank(world: int) -> None:
    results = run_ranks(world, _ranks_and_sum)
    assert results == [(r, world, world * (world + 1) / 2) for r in range(world)]


@pytest.mark.slow  # starts a second pool after the failed one
def test_a_failing_rank_shows_its_traceback() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(2, _fail_on_rank_one)
    message = str(info.value)
    assert "rank(s) [1]" in message and "--- rank 1 ---" in message
    assert "ValueError: rank one is broken" in message and "_fail_on_rank_one" in message
    assert run_ranks(2, _ranks_and_sum)[1][2] == 3.0  # a fresh pool replaces the failed one


@pytest.mark.job  # waits out the timeout
def test_a_hung_collective_fails_within_the_timeout() -> None:
    pool = RankPool(2)
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0\] of 2 did not finish within 3s"):
        pool.run(_hang_on_rank_zero, timeout=3)
    assert time.monotonic() - start < 15
    assert pool.closed


def _returns_a_lock() -> object:
    import threading

    return threading.Lock()


def test_an_unpicklable_function_or_argument_is_reported_at_once() -> None:
    """Not a timeout: the caller pickles the task before sending it (and a rank its result, below)."""
    get_pool(2)  # started before the clock starts
    start = time.monotonic()
    with pytest.raises(TypeError, match=r"run_ranks: cannot send .*<lambda> to the ranks, it does not pickle"):
        run_ranks(2, lambda: 1, timeout=20)
    with pytest.raises(TypeError, match="cannot send _ranks_and_sum .*does not pickle.*lock"):
        run_ranks(2, _ranks_and_sum, __import__("threading").Lock(), timeout=20)
    assert time.monotonic() - start < 2
    assert run_ranks(2, _ranks_and_sum)[1][2] == 3.0  # nothing was sent: the pool still works


@pytest.mark.slow  # restarts the pool after the failure: 3.5 s
def test_an_unpicklable_result_is_reported_at_once() -> None:
    """On a pool of its own: a failed task closes its pool, and the suite's shared one would
    then start over (seconds of imports and warm-up for the tests after this one)."""
    with RankPool(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank\(s\) \[0, 1\] of 2(.|\n)*_returns_a_lock returned a lock that cannot be pickled"):
            pool.run(_returns_a_lock, timeout=20)
        assert time.monotonic() - start < 10
        assert pool.closed


_POOL_THEN_SLEEP = """
import sys, time
from fxzero.testing import RankPool
pool = RankPool(2)
print(*(proc.pid for proc in pool._procs), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # a pool of its own starts: 7 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_ranks_of_a_killed_caller_exit_by_themselves() -> None:
    """A caller killed by SIGKILL closes nothing; its idle ranks notice they were orphaned and exit
    (they used to wait on their task queues for ever, holding their memory)."""
    caller = subprocess.Popen([sys.executable, "-c", _POOL_THEN_SLEEP], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in caller.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(map(_running, pids))
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 30
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} still ran 30 s after their caller was killed"
