"""The update benchmarks still run: ``docs/benchmarks.md`` and issue 54's notes quote their rows,
and ``benchmarks/update_limits.py`` reaches into fxzero's internals (``FusedRunUpdate``, the stores),
which change. It once built ``FusedRunUpdate()`` for a session after the constructor took a
``Compiling``, and nothing noticed. One round over a small run each: the tables print, every row
is timed; the numbers are not looked at (a unit test is no place to time). Whole benchmark processes with
cold compiles: the ``job`` tier (``.ci/run``'s second part)."""

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


@pytest.mark.job
def test_update_limits_times_every_row() -> None:
    out = _run("benchmarks/update_limits.py", "--rounds", "1", "--numel", "4096")
    rows = _table_rows(out)
    assert len(rows) == 10, out
    assert all(row.split("|")[2].strip() for row in rows), out  # every row has its ms
    assert "fxzero fp8 run pass: 1.5x its bound is" in out


@pytest.mark.job
def test_update_times_its_rows_with_a_steady_malloc() -> None:
    out = _run("benchmarks/update.py", "--skip-drift", "--skip-world-2", "--rounds", "1", "--steady-malloc",
               "--only", "fxzero bf16 state,torch AdamW fused=True (fp32)")  # fmt: skip
    assert "glibc kept from returning memory (--steady-malloc)" in out
    assert "| bf16 state vs its bound" in out, out


@pytest.mark.job
def test_per_param_step_times_every_split() -> None:
    out = _run("benchmarks/per_param_step.py", "--rounds", "1")
    assert "torch AdamW fused=True" in out and "fxzero bf16 state" in out, out


def _update_benchmark():
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    try:
        import update
    finally:
        sys.path.remove(str(_ROOT / "benchmarks"))
    return update


def test_targets_are_ratios_taken_round_by_round() -> None:
    """Rounds where the row took 3.0x, 1.2x and 1.1x its peer: the target is the middle one, 1.2,
    where the ratio of the two medians (30 / 10) would read 3.0."""
    update = _update_benchmark()
    row, peer = "fxzero stochastic rounding", "fxzero fp32 state, bf16 params + fp32 masters"
    result = {"ms": {row: 30.0, peer: 10.0}, "rounds": {row: [30.0, 12.0, 44.0], peer: [10.0, 10.0, 40.0]},
              "params": 1000, "bandwidth": 1e9, "round_bandwidth": [1e9] * 3}  # fmt: skip
    rows = {r[0]: r for r in update._target_rows(result, 1)}
    what = "stochastic vs nearest (same flags)"
    assert rows[what][1] == "30.0 / 10.0"
    assert rows[what][2:] == ["1.20", "1.10-3.00", "<= 1.2", "yes"]


def test_a_ratio_to_the_bound_uses_each_rounds_bandwidth() -> None:
    update = _update_benchmark()
    row = "fxzero bf16 state"
    bound_bytes = update.SPEED_MODES[row][3] * 1000
    bandwidths = [1e9, 2e9, 4e9]
    times = [1.2e3 * bound_bytes / bw for bw in bandwidths]  # 1.2x the bound of its own round, every round
    result = {"ms": {row: times[1]}, "rounds": {row: times}, "params": 1000, "bandwidth": 2e9, "round_bandwidth": bandwidths}
    ratios = update._paired_ratios(result, 1, row, "bound")
    assert all(abs(r - 1.2) < 1e-9 for r in ratios)
