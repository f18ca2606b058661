"""The README's claims: its commands are the ones CI runs, its quickstart runs as printed, its
diagram's caption is the plan the diagram script draws, its links resolve, and it stays short
enough to read (issue 48: <= 250 lines, the user contract done within the first 150)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICKSTART_MARK = "<!-- quickstart: the block below is run verbatim under torchrun by the test suite -->\n```python\n"


def _quickstart() -> str:
    return README.split(QUICKSTART_MARK, 1)[1].split("```", 1)[0]


def _line_of(text: str) -> int:
    return README[: README.index(text)].count("\n") + 1


TEST_COMMAND_MARK = "Set up and run the whole test suite but the `job` and `models` tiers (`.ci/run` runs this first):\n\n```bash\n"


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run``'s first part is the README's test command, verbatim (``tests/test_ci.py`` runs
    the script itself)."""
    command = README.split(TEST_COMMAND_MARK, 1)[1].split("\n```", 1)[0]
    assert f"\nif {command}\n" in (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt torch==2.13.0" in command  # never an unpinned torch


def test_constraints_pin_torch() -> None:
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_the_readme_is_short_and_the_contract_comes_early() -> None:
    assert README.count("\n") <= 250
    assert len(_quickstart().splitlines()) <= 30
    contract = README.index("## The user contract")
    end_of_contract = README.index("\n## ", contract + 1)
    assert README[:end_of_contract].count("\n") < 150  # a safe first run of one's own model by line 150


def test_every_relative_link_of_the_readme_resolves() -> None:
    """Links to docs pages, charts, results files and the diagram script (images included)."""
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    relative = sorted({t for t in targets if "://" not in t})
    assert relative, "the README links its docs pages"
    assert [t for t in relative if not (ROOT / t).exists()] == []


def test_the_status_box_cites_the_gpu_run() -> None:
    """The status box's one-GPU row: the log it links shows tests/test_cuda.py passing on an H100."""
    log = (ROOT / "benchmarks/results/gpu_check-2026-11-27-h100.log").read_text()
    assert "benchmarks/results/gpu_check-2026-11-27-h100.log" in README
    assert "NVIDIA H100" in log and "tests/test_cuda.py" in log and "\n4 passed" in log
    assert "**not yet verified**" in README.split("NCCL across GPUs", 1)[1].splitlines()[0]


def _layout_script():
    spec = importlib.util.spec_from_file_location("layout_diagram", ROOT / "docs/diagrams/layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports fxzero and torch only; matplotlib only when drawing
    return module


def test_the_layout_caption_is_the_plan_the_diagram_draws() -> None:
    """docs/layout.png is drawn from ``plan()``; the README prints that plan's caption, so a change
    to the layout rules fails here until the picture is redrawn (``python docs/diagrams/layout.py``)."""
    layout = _layout_script()
    shown = README.split("<!-- layout-caption -->", 1)[1].split("<!-- /layout-caption -->", 1)[0]
    plan = layout.plan()
    assert shown == layout.caption(plan)
    assert len(plan.plan.buckets) == 3 and plan.plan.dp_size == 2
    assert (ROOT / "docs/layout.png").stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.job  # torchrun, two ranks importing torch and compiling with Inductor: ~18 s on two cores, cold
def test_the_quickstart_runs_verbatim_and_resumes_at_another_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's quickstart, written to a file as printed, under torchrun at world 2 (gloo);
    then the same code again in this process at world 1, which resumes from the checkpoint
    the first run committed last (the README: "a second torchrun resumes ... with any number
    of ranks")."""
    code = _quickstart()
    (tmp_path / "train.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in printed] == ["epoch 0", "epoch 1"], run.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_0000000", "step_0000001"]

    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(tmp_path / "train.py"), "exec"), {"__name__": "__main__"})
    finally:
        if dist.is_initialized():  # the code failed before its own destroy_process_group()
            dist.destroy_process_group()
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == ["epoch 2", "epoch 3"]
    assert (tmp_path / "ckpt" / "step_0000003").is_dir()
