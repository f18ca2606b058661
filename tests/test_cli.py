"""``python -m fxzero explain``: one real run (with TORCH_LOGS), and its argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxzero.cli import main
from fxzero.dump import DUMP_DIR_ENV

ROOT = Path(__file__).resolve().parent.parent


def test_cli_with_torch_logs_prints_the_table_logs_and_dumps(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TORCH_LOGS": "fxzero",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop(DUMP_DIR_ENV, None)
    command = [sys.executable, "-m", "fxzero", "explain", "examples/explain_mlp.py", "--bucket-size", "5000"]
    result = subprocess.run(
        [*command, "--world-size", "2", "--dump-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("fxzero buckets (dp=2): 2 buckets, 9,060 param elements in 9,216 buffer elements")
    assert "buckets spanning several graphs: 0 (graphs 0, 1)" in result.stdout
    assert "fxzero graph 000 forward: " in result.stderr and "reduce-scatter launches for buckets 0, 1" in result.stderr
    index = json.loads((tmp_path / "summary.json").read_text())
    assert [g["kinds"] for g in index["graphs"]] == [["backward", "forward", "joint"]] * 2


_TARGETS = """
import torch
import fxzero

def fxzero_explain():
    return torch.nn.Linear(2, 2), torch.randn(1, 2)

def not_a_pair():
    return torch.nn.Linear(2, 2)

def not_a_model():
    return "model", (torch.randn(1, 2),)

def with_optimizer():
    model = torch.nn.Linear(2, 2)
    return model, (torch.randn(1, 2),), fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
"""


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_errors_name_the_bad_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "targets.py"
    target.write_text(_TARGETS)
    missing = tmp_path / "missing.py"
    assert _error([str(missing)], capsys).endswith(f"TARGET file {str(missing)!r} does not exist")
    assert _error([str(tmp_path)], capsys).endswith(
        f"TARGET {str(tmp_path)!r} is a directory; TARGET must be a Python file (path/to/file.py[:function]) "
        "or an importable module (package.module[:function])"
    )
    assert _error(["no_such_module_xyz"], capsys).endswith(
        "TARGET module 'no_such_module_xyz' not found (give a .py path or an importable module)"
    )
    assert f"{target} has no function 'build'" in _error([f"{target}:build"], capsys)
    assert _error([f"{target}:not_a_pair"], capsys).endswith(
        "not_a_pair() must return (model, example_inputs) or (model, example_inputs, optimizer), got Linear"
    )
    assert _error([f"{target}:not_a_model"], capsys).endswith(
        "not_a_model() returned a model of type str; expected a torch.nn.Module"
    )
    assert "--bucket-size takes a number of elements, 'auto' or 'none', got 'big'" in _error(
        [str(target), "--bucket-size", "big"], capsys
    )
    assert "--world-size must be a whole number >= 1, got '0'" in _error([str(target), "--world-size", "0"], capsys)
    assert _error([f"{target}:with_optimizer", "--bucket-size", "64"], capsys).endswith(
        "--bucket-size/--pad-for-high-busbw/--overlap-param-gather: TARGET returned its own optimizer, "
        "whose Config decides the layout and the waits"
    )


def test_cli_explains_a_module_target_with_its_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_targets.py").write_text(_TARGETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "my_targets:with_optimizer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxzero buckets (dp=1): 1 bucket, 6 param elements in 128 buffer elements")
    assert "def forward(self, weight, bias, primals_3):" in out


def test_readme_shows_the_real_explain_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    command = "python -m fxzero explain examples/explain_mlp.py --bucket-size 5000 --world-size 2 --overlap-param-gather"
    shown_in = (ROOT / "benchmarks/results/explain_mlp-2026-11-27.md").read_text()  # was the README's
    shown = shown_in.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    assert main(command.split()[3:]) == 0
    assert capsys.readouterr().out == shown
