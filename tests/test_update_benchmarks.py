"""The update benchmarks still run: ``docs/benchmarks.md`` and issue 54's notes quote their rows,
and ``benchmarks/update_limits.py`` reaches into fxzero's internals (``FusedRunUpdate``, the stores),
which change. It once built ``FusedRunUpdate()`` for a session after the constructor took a
``Compiling``, and nothing noticed. One round over a small run each: the tables print, every row
is timed; the numbers are not looked at (a unit test is no place to time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| pass") and "---" not in line]


@pytest.mark.slow
def test_update_limits_times_every_row() -> None:
    out = _run("benchmarks/update_limits.py", "--rounds", "1", "--numel", "4096")
    rows = _table_rows(out)
    assert len(rows) == 10, out
    assert all(row.split("|")[2].strip() for row in rows), out  # every row has its ms
    assert "fxzero fp8 run pass: 1.5x its bound is" in out


@pytest.mark.slow
def test_per_param_step_times_every_split() -> None:
    out = _run("benchmarks/per_param_step.py", "--rounds", "1")
    assert "torch AdamW fused=True" in out and "fxzero bf16 state" in out, out
