"""``fxzero.parity`` / ``python -m fxzero parity`` on real ranks: a clean GPT passes under
Inductor, an injected rank-dependent bug fails naming its param, BatchNorm is not
comparable; and the command's exit statuses and TARGET errors."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.cli import main
from fxzero.testing import RankPool

ROOT = Path(__file__).resolve().parent.parent

_BUGGY = """
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist


class Buggy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        loss = F.mse_loss(self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return loss + 0.1 * rank * self.fc2.bias.square().sum()  # the bug: rank 1 adds a term on fc2.bias


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def fxzero_parity():
    torch.manual_seed(0)
    return Buggy(), batch


def odd_batch():
    torch.manual_seed(0)
    return Buggy(), lambda step: (torch.randn(7, 8), torch.randn(7, 4))


class RaisesOnRanks(Buggy):
    def forward(self, x, y):
        if dist.is_initialized():
            raise RuntimeError("boom on a rank")
        return super().forward(x, y)


def raises_on_ranks():
    return RaisesOnRanks(), batch


def not_a_pair():
    return Buggy()


def not_a_model():
    return "model", batch
"""


@pytest.fixture()
def targets(tmp_path: Path) -> Path:
    path = tmp_path / "targets.py"
    path.write_text(_BUGGY)
    return path


@pytest.mark.slow  # a fresh interpreter and its own rank pool
def test_injected_rank_dependent_bug_fails_and_names_its_param_first(targets: Path) -> None:
    """As a user runs it: a fresh interpreter, whose rank pool is also closed cleanly at
    exit (left to multiprocessing, its queues' semaphores leaked with a warning)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fxzero", "parity", str(targets), "--inner-compiler", "eager", "--steps", "3"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    out = result.stdout
    param_table = out.split("| param ", 1)[1].splitlines()
    assert param_table[2].startswith("| fc2.bias ")  # first row under the header
    assert "first 'fc2.bias' (from step 1)" in out.splitlines()[-1]
    # fxzero agrees with itself: the bug is in the model
    assert "overlap check (fxzero again with overlap_param_gather=False): losses and params bitwise identical" in out
    assert "leaked" not in result.stderr, result.stderr


class BatchNormNet(nn.Module):
    """Module level: fxzero.parity pickles the model to its ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.relu(self.bn(self.fc(x)))), y)


def _regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def test_mxfp8_gather_over_several_buckets_passes() -> None:
    """The reference computes on the MXFP8 round trip of its fp32 masters, as fxzero does."""
    torch.manual_seed(0)
    report = fxzero.parity(Regression(), _regression_batch, inner_compiler="eager", steps=3, mxfp8=True, bucket_size=100)
    assert report.verdict == "PASS", str(report)
    assert report.setup.buckets == 3 and {p.bucket for p in report.params} == {0, 1, 2}
    assert "MXFP8 param gather on" in str(report)


def test_batchnorm_in_train_mode_is_not_comparable_before_training_with_the_fix() -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fxzero.parity(model, _regression_batch, inner_compiler="eager", steps=2)
    assert (report.verdict, report.exit_code, report.trained) == ("NOT COMPARABLE", 3, False)
    assert report.seconds < 30 and report.fxzero_losses == ()  # found before training: no rank ran
    text = str(report)
    assert "not comparable: bn (BatchNorm1d in train mode): per-rank batch statistics. Fix: check the model" in text
    # per-rank statistics are far from the global batch's: the losses already differ before training.
    # The figures are computed here, in this run, not copied from a printout: the last digit
    # of such a sum varies between CPUs of the same machine kind (BLAS reduction order).
    found = re.search(r"the loss on the global batch (\S+) != mean of its 2 slices' losses (\S+?):", text)
    assert found is not None, text
    x, y, twin = *_regression_batch(0), copy.deepcopy(model)  # train mode: the twin's statistics move
    with torch.no_grad():
        whole, halves = twin(x, y).item(), (twin(x[:4], y[:4]).item() + twin(x[4:], y[4:]).item()) / 2
    assert float(found[1]) == pytest.approx(whole, abs=1e-5) and float(found[2]) == pytest.approx(halves, abs=1e-5)
    assert abs(whole - halves) > 1e-2
    assert "Fix: make the loss a mean over the batch" in text
    assert text.splitlines()[-1].startswith("verdict: NOT COMPARABLE: found before training")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the caller's model is untouched


@pytest.mark.slow  # Inductor compiles for 2 ranks and the reference: ~16 s on a cold cache
def test_clean_gpt_passes_under_inductor_as_its_results_file_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """The example run of benchmarks/results/parity_gpt-2026-11-27.md (once the README's), repeated:
    same setup lines, same checks, PASS."""
    command = "python -m fxzero parity examples/parity_gpt.py --world-size 2"
    assert main(command.split()[3:]) == 0
    out = capsys.readouterr().out
    shown_in = (ROOT / "benchmarks/results/parity_gpt-2026-11-27.md").read_text()  # was the README's
    shown = shown_in.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    assert out.splitlines()[:2] == shown.splitlines()[:2]
    checks = ("overlap check", "ranks:", "verdict: PASS: ")
    for line in out.splitlines() + shown.splitlines():
        if line.startswith(checks):
            assert line.split(" (")[0] in out and line.split(" (")[0] in shown, line
    assert "inner compiler inductor" in out and "compiled by plain Inductor" in out


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["parity", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_errors_name_the_bad_argument(targets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.py"
    assert _error([str(missing)], capsys).endswith(f"TARGET file {str(missing)!r} does not exist")
    assert _error(["no_such_module_xyz"], capsys).endswith(
        "TARGET module 'no_such_module_xyz' not found (give a .py path or an importable module)"
    )
    assert _error([f"{targets}:build"], capsys).endswith(
        "has no function 'build'; define build() returning (model, batch_fn[, optimizer_factory[, loss_fn]]) or name one as "
        f"{targets}:FUNCTION"
    )
    assert _error([f"{targets}:not_a_pair"], capsys).endswith(
        "not_a_pair() must return (model, batch_fn[, optimizer_factory[, loss_fn]]), got Buggy"
    )
    assert _error([f"{targets}:not_a_model"], capsys).endswith(
        "not_a_model() returned a model of type str; expected a torch.nn.Module"
    )
    assert _error([f"{targets}:odd_batch"], capsys).endswith(
        "batch_fn(0)[0] has shape (7, 8): its size along dim 0 (7) is not divisible by 2 "
        "(each rank takes an equal slice of the global batch)"
    )
    assert "--steps must be a whole number >= 1, got '0'" in _error([str(targets), "--steps", "0"], capsys)
    assert "--atol-param must be a finite number >= 0, got '-1'" in _error([str(targets), "--atol-param", "-1"], capsys)
    assert "--bucket-size takes a number of elements, 'auto' or 'none', got 'x'" in _error(
        [str(targets), "--bucket-size", "x"], capsys
    )
    assert "invalid choice: 'aot'" in _error([str(targets), "--inner-compiler", "aot"], capsys)


@pytest.mark.slow  # fresh ranks that fail
def test_fxzero_raising_on_a_rank_is_a_fail(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On ranks of its own: a failed rank closes its pool, and the suite's shared one would
    then start over (seconds of imports and warm-up for the tests after this one)."""
    with RankPool(2) as pool:
        with mock.patch("fxzero.parity_check.run.run_ranks", lambda world, fn, *args, **kwargs: pool.run(fn, *args, **kwargs)):
            assert main(["parity", f"{targets}:raises_on_ranks", "--inner-compiler", "eager", "--steps", "1"]) == 1
        assert pool.closed
    err = capsys.readouterr().err
    assert err.startswith("fxzero parity: FAIL: the fxzero run did not finish: train_rank failed on rank(s) [0, 1]")
    assert "RuntimeError: boom on a rank" in err
