""".ci/run itself, with a stand-in ``python`` on PATH that records each call: it runs the README's
test command (every tier but ``job`` and ``models``), then those two tiers, then the fast tier in an environment
of its own for the newest torch (made once, then reused, keyed by the pins), prints one line per
part, and fails when any part fails, pytest's "no tests ran" (exit 5) included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in interpreter: answers the version query, makes a "venv", records the rest
case "$1 $2" in
  "-c "*) echo 3.11; exit 0 ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; echo "venv $3" >> "$CALLS"; exit 0 ;;
esac
where=global; [[ $0 == "$CACHE"/* ]] && where=venv
echo "$where $* PIP_CONSTRAINT=$(tr '\\n' ' ' < "${PIP_CONSTRAINT:-/dev/null}")" >> "$CALLS"
[[ $2 == pytest && $where == global && $5 == "job or models" ]] && exit "$JOB_PYTEST"
[[ $2 == pytest ]] && { [[ $where == global ]] && exit "$GLOBAL_PYTEST"; exit "$VENV_PYTEST"; }
exit 0
"""


def _run_ci(tmp: Path, global_pytest: int = 0, venv_pytest: int = 0, job_pytest: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    clone = tmp / "clone"
    if not clone.exists():
        (clone / ".ci").mkdir(parents=True)
        for name in (".ci/run", "constraints.txt", "constraints-torch2.15.txt"):
            shutil.copy(ROOT / name, clone / name)
        (tmp / "bin").mkdir()
        (tmp / "bin" / "python").write_text(FAKE_PYTHON)
        (tmp / "bin" / "python").chmod(0o755)
    calls = tmp / "calls"
    calls.write_text("")
    env = dict(os.environ, PATH=f"{tmp / 'bin'}:{os.environ['PATH']}", CALLS=str(calls), CACHE=str(tmp / "cache"),
               FXZERO_CI_CACHE=str(tmp / "cache"), GLOBAL_PYTEST=str(global_pytest), VENV_PYTEST=str(venv_pytest), JOB_PYTEST=str(job_pytest))
    env.pop("PIP_CONSTRAINT", None)
    run = subprocess.run(["bash", str(clone / ".ci/run")], env=env, capture_output=True, text=True, timeout=60)
    return run, calls.read_text().splitlines()


def test_ci_runs_the_readme_command_then_the_job_tier_then_the_fast_tier_on_the_newest_torch_in_an_environment_it_keeps(tmp_path: Path) -> None:
    run, calls = _run_ci(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    venv = tmp_path / "cache" / "torch2.15.0-torchvision0.29.2-py3.11"
    assert calls[0].startswith("global -m pip install -c constraints.txt torch==2.13.0 ")
    assert calls[2].startswith("global -m pytest -q -m not job and not models ")
    assert calls[3].startswith("global -m pytest -q -m job or models ")
    assert calls[4] == f"venv {venv}"
    assert calls[5].startswith("venv -m pip install torch==2.15.0 torchvision==0.29.2 PIP_CONSTRAINT=")
    constraints = calls[5].split("PIP_CONSTRAINT=", 1)[1].split()
    assert "torch==2.15.0" in constraints and "torch==2.13.0" not in constraints and "transformers==5.18.0" in constraints
    assert calls[6].startswith("venv -m pip install -e .[test] ") and calls[7].startswith('venv -m pytest -q -m not slow ')
    assert "== .ci/run part 1, whole suite but the job and models tiers on torch 2.13.0: passed" in run.stdout
    assert "== .ci/run part 2, job and models tiers on torch 2.13.0: passed" in run.stdout
    assert "== .ci/run part 3, fast tier on torch 2.15.0: passed" in run.stdout
    run, calls = _run_ci(tmp_path)  # a second run reuses the environment
    assert run.returncode == 0 and not [c for c in calls if c.startswith("venv /")], calls


@pytest.mark.parametrize(("global_pytest", "job_pytest", "venv_pytest", "line"), [
    (1, 0, 0, "part 1, whole suite but the job and models tiers on torch 2.13.0: FAILED (exit 1)"),
    (0, 5, 0, "part 2, job and models tiers on torch 2.13.0: FAILED (exit 5)"),  # no tests ran
    (0, 0, 5, "part 3, fast tier on torch 2.15.0: FAILED (exit 5)"),
])
def test_ci_fails_when_any_part_fails(tmp_path: Path, global_pytest: int, job_pytest: int, venv_pytest: int, line: str) -> None:
    run, calls = _run_ci(tmp_path, global_pytest, venv_pytest, job_pytest)
    assert run.returncode != 0 and line in run.stdout, run.stdout
    assert any(c.startswith("global -m pytest -q -m job or models") for c in calls), "part 2 runs after part 1 failed"
    assert any(c.startswith("venv -m pytest") for c in calls), "part 3 runs after an earlier part failed"


@pytest.mark.slow  # collects the whole suite in a subprocess: 6 s
def test_every_job_test_is_slow_too() -> None:
    """The ``job`` tier sits outside the development loop as well (``-m "not slow"``): conftest.py
    marks each ``job`` test ``slow``."""
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "tests/test_exit.py"],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert collected.returncode == 5, collected.stdout[-2000:]  # 5: no test selected (test_exit.py's one test is a job)
