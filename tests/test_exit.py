"""Process exit with fxzero's work left behind is clean: exit code 0 and no ``terminate
called`` on any rank, in bounded time (issue 22 reported intermittent SIGABRTs, which make
torchrun mark the job failed).

Each case is two real rank processes running ``tests/exit_script.py`` (as torchrun would
start them, without its agent), all cases at once; each ends by returning from the script,
with and without ``dist.destroy_process_group()``. Slow tier: ten processes importing torch
take ~20 s on two cores. A backward error caught, then exit without ``destroy_process_group``,
aborted 7 in 10 runs (a gloo worker thread releasing an all-to-all's tensors during Python's
finalization); fxzero now settles its collectives at exit (:func:`fxzero.optim.communication.comm.settle`):
0 in 60 runs. At the old rate, the one pair here catches a regression 7 times in 10.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("exit_script.py")
CASES = [
    ("caught-backward-error", False),  # aborted 7 in 10 runs before fxzero settled its work at exit
    ("caught-backward-error", True),
    ("gathers-in-flight", False),
    ("gathers-in-flight", True),
    ("peer-gone", False),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pair(scenario: str, destroy: bool) -> list[subprocess.Popen]:
    port = _free_port()
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        command = [sys.executable, str(SCRIPT), scenario, "1" if destroy else "0"]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return ranks


@pytest.mark.job
def test_exit_with_work_in_flight_or_after_a_caught_error_is_clean() -> None:
    started = time.monotonic()
    pairs = {case: _start_pair(*case) for case in CASES}
    failures = []
    for case, ranks in pairs.items():
        for rank, process in enumerate(ranks):
            try:
                _, stderr = process.communicate(timeout=max(1.0, 120 - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                process.kill()
                _, stderr = process.communicate()
                failures.append(f"{case} rank {rank}: still running after 120 s (a hang at exit)")
                continue
            if process.returncode != 0 or "terminate called" in stderr:
                failures.append(f"{case} rank {rank}: exit code {process.returncode}\n{stderr[-3000:]}")
    assert not failures, "\n\n".join(failures)

