"""``python -m fxzero explain``: one real run (with TORCH_LOGS), and its argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxzero.cli import main
from fxzero.dump import DUMP_DIR_ENV
from fxzero.target import load_target

from derived_layout import derive_layout

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a CLI run in a subprocess with TORCH_LOGS: 5 s
def test_cli_with_torch_logs_prints_the_table_logs_and_dumps(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TORCH_LOGS": "fxzero",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop(DUMP_DIR_ENV, None)
    command = [sys.executable, "-m", "fxzero", "explain", "examples/explain_mlp.py", "--bucket-size", "5000", "--inner-compiler", "eager"]
    result = subprocess.run(
        [*command, "--world-size", "2", "--dump-dir", str(tmp_path), "--full", "--json", str(tmp_path / "e.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("fxzero explain: ResidualMLP, world size 2, bucket size 5,000, inner compiler eager")
    model, _ = load_target(str(ROOT / "examples" / "explain_mlp.py"), "fxzero_explain", "")()
    assert derive_layout(list(model.parameters()), 2, 5000).summary_line() in result.stdout  # the figures, from the rules
    index = json.loads((tmp_path / "summary.json").read_text())
    first, second = (g["graph_id"] for g in index["graphs"])  # the dumps, the log and the summary name graphs alike
    assert f"buckets read by several graphs: 0 (graphs {first}, {second})" in result.stdout
    assert result.stdout.count("def forward(self") == 4  # --full: both graphs' forward and backward
    assert f"JSON written to {tmp_path / 'e.json'}" in result.stdout
    assert [b["index"] for b in json.loads((tmp_path / "e.json").read_text())["buckets"]] == [0, 1]
    assert f"fxzero graph {first} forward: " in result.stderr and "reduce-scatter launches for buckets 0, 1" in result.stderr
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

class Raises(torch.nn.Linear):
    def forward(self, x):
        raise ValueError("my model's own error")


def raises():
    return Raises(2, 2), torch.randn(1, 2)


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
        "not_a_pair() must return (model, example_inputs[, optimizer[, loss_fn]]), got Linear"
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
    assert main(["explain", "my_targets:with_optimizer", "--inner-compiler", "eager", "--full"]) == 0
    out = capsys.readouterr().out
    assert derive_layout(list(torch.nn.Linear(2, 2).parameters()), 1, None).summary_line() in out
    assert "def forward(self, weight, bias, primals_3):" in out


def _pasted_explains() -> list[tuple[str, str, str]]:
    """``(file, command, output)`` of every ``$ fxzero explain ...`` block pasted in the
    README, the docs pages and the results files."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]:
        for block in path.read_text().split("```")[1::2]:
            first, _, rest = block.lstrip("\n").partition("\n")
            for prefix in ("$ python -m fxzero explain ", "$ fxzero explain "):
                if first.startswith(prefix):
                    found.append((str(path.relative_to(ROOT)), first[len(prefix) :], rest))
    return found


def test_pasted_explain_output_is_the_real_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    pasted = _pasted_explains()
    assert pasted, "no `$ fxzero explain ...` block found in README.md, docs/ or benchmarks/results/"
    for where, command, shown in pasted:
        torch._dynamo.reset()  # graphs are named by Dynamo's compile ids: as in the fresh process the command ran in
        assert main(["explain", *command.split()]) == 0
        assert capsys.readouterr().out == shown, f"{where}: paste the output of `fxzero explain {command}`"


def test_timeline_without_matplotlib_is_refused_before_compiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import fxzero.explainer as explainer
    import fxzero.explainer.timeline as timeline

    def missing() -> None:
        raise timeline.PlottingMissing("fxzero explain --timeline needs matplotlib: pip install 'fxzero[bench]'")

    monkeypatch.setattr(timeline, "matplotlib_parts", missing)
    monkeypatch.setattr(explainer, "record", lambda *args: pytest.fail("compiled before refusing"))
    target = tmp_path / "targets.py"
    target.write_text(_TARGETS)
    assert _error([str(target), "--timeline", str(tmp_path / "t.png")], capsys).endswith(
        "fxzero explain --timeline needs matplotlib: pip install 'fxzero[bench]'"
    )


def test_an_error_in_the_model_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """Not a traceback (under a process group, one with ``[rank0]:`` before every line)."""
    (tmp_path / "my_raising.py").write_text(_TARGETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "my_raising:raises", "--inner-compiler", "eager", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fxzero explain: error: ") and "my model's own error" in err
    assert "Traceback" not in err and len(err.splitlines()) <= 8
    assert "(rerun with --traceback to see where it was raised)" in err
