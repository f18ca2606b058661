"""``benchmarks/graph_overhead.py --ops``: the rows the README quotes are the ops whose call
counts differ between plain torch.compile and fxzero, most extra fxzero calls first."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _graph_overhead():
    sys.path.insert(0, str(_BENCHMARKS))
    try:
        import graph_overhead
    finally:
        sys.path.remove(str(_BENCHMARKS))
    return graph_overhead


def test_op_rows_keep_only_differing_counts_most_extra_first_without_per_compile_names() -> None:
    tool = _graph_overhead()
    plain = {"aten::add_": (96, 1.0), "aten::mm": (32, 9.0), "aten::detach": (48, 2.0), "## Call CompiledFxGraph fa": (8, 5.0)}
    fx = {"aten::add_": (144, 3.0), "aten::mm": (32, 9.0), "fxzero::grads_ready": (8, 7.0), "Torch-Compiled Region: 1/3": (8, 4.0)}
    rows = tool.op_rows(plain, fx)
    assert [row[:3] for row in rows] == [
        ["aten::add_", "96", "144"],
        ["fxzero::grads_ready", "0", "8"],
        ["aten::detach", "48", "0"],
    ]


def test_op_counts_profile_one_step_of_a_config() -> None:
    calls = []

    def step(x: torch.Tensor) -> float:
        calls.append(x)
        return (x + 1).sum().item()

    counts = _graph_overhead().op_counts(step, torch.ones(3))
    assert len(calls) == 1 and counts["aten::add"][0] == 1 and counts["aten::sum"][0] == 1


def test_every_timed_entry_point_is_a_function_fxzero_calls_by_that_name() -> None:
    """``--timers`` patches each entry by name: a renamed method must fail here, not time nothing.
    Module attributes must be what the module's callers look up at call time (a global)."""
    tool = _graph_overhead()
    for label, owner, name in tool.TIMED:
        assert callable(getattr(owner, name)), label
    assert tool.grad_sync.foreach_add_ is torch._foreach_add_  # grad_sync calls it as a global
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    with mock.patch.object(tool.torch_adam, "adam", wraps=tool.torch_adam.adam) as update:
        torch.optim.AdamW([param]).step()  # AdamW's step reaches the update through that global
    assert update.call_count == 1


def test_the_gpu_check_runs_what_the_readme_says() -> None:
    """The README: gpu_check.sh runs the CUDA tests, graph_overhead on the GPU with --ops and
    again with --sync-phases, the main job at one rank, the optimizer update's world-1 speed rows
    (issue 54's CUDA part), and the world-1 memory table."""
    steps = [line.split(maxsplit=2)[2] for line in (_BENCHMARKS / "gpu_check.sh").read_text().splitlines() if line.startswith("step ")]
    assert steps == [
        "python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rfE --durations=5",
        "python3 benchmarks/graph_overhead.py --device cuda --steps 40 --ops",
        "python3 benchmarks/graph_overhead.py --device cuda --steps 40 --sync-phases",
        "torchrun --nproc-per-node 1 examples/train_gpt.py --steps 30 --log-every 5 --overlap",
        "python3 benchmarks/update.py --device cuda --skip-drift --skip-world-2 --rounds 11",
        'python3 benchmarks/memory.py --world 1 --device cuda --only "DDP gabv + compile" fxzero --steps 4 --png "${OUT:-benchmarks/results}/memory_cuda.png"',
    ]
