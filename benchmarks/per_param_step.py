"""What ``step()`` costs per param tensor: the same 3.1M elements split into 2 to 384 tensors.

A step's work over the elements does not change with how they are split into params; what a step
does per param (Python over the param list, a kernel launch per tensor) does. This prints, for
torch's fused AdamW and fxzero's modes, ``step()`` at world 1 for the same element count split into
more and more tensors, paired in one run (each setup once a round, the order alternating; medians),
and each row's extra time per tensor over the 2-tensor split. torch's fused AdamW is the peer: its
per-tensor cost is one kernel call in one C++ loop.

    python benchmarks/per_param_step.py            # about a minute on one CPU thread
    python benchmarks/per_param_step.py --rounds 21
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxzero  # noqa: E402

ELEMENTS = 3 * 1024 * 1024
SPLITS = (2, 48, 192, 384)
MODES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # label: (who, Config options, optimizer flags)
    "torch AdamW fused=True": ("torch", {}, {"fused": True}),
    "fxzero fp32 state, fused=True": ("fxzero", {}, {"fused": True}),
    "fxzero bf16 state": ("fxzero", {"optimizer_state_dtype": "bf16"}, {}),
    "fxzero fp8 state": ("fxzero", {"optimizer_state_dtype": "fp8"}, {}),
}


class _Side(torch.nn.Module):
    """Bias-free layers side by side on one input, their outputs concatenated: every weight gets a
    gradient of the same size whatever the split (a deep chain of layers would shrink them into fp32's
    subnormal range, whose arithmetic is many times slower on x86 and would time that instead)."""

    def __init__(self, tensors: int, width: int = 256) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, ELEMENTS // tensors // width, bias=False) for _ in range(tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=1)


def _model(tensors: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return _Side(tensors)


def _optimizer(label: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    who, options, flags = MODES[label]
    if who == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, **flags)
    config = fxzero.Config(bucket_size=None, measure_grad_norm=False, **options)
    return fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, module=model, config=config, **flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setups = {}
    for tensors in SPLITS:
        for label in MODES:
            model = _model(tensors)
            setups[(label, tensors)] = (model, _optimizer(label, model), torch.randn(8, 256))
    times: dict[Any, list[float]] = {key: [] for key in setups}
    for r in range(args.rounds + 1):  # round 0 warms up (fxzero's compiles)
        for key in setups if r % 2 == 0 else reversed(list(setups)):
            model, opt, x = setups[key]
            model(x).square().mean().backward()
            start = time.perf_counter()
            opt.step()
            if r:
                times[key].append(time.perf_counter() - start)
            opt.zero_grad()
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    print(f"step() at world 1, {ELEMENTS / 1e6:.2f}M elements split into N param tensors, median of {args.rounds} paired rounds, "
          "measure_grad_norm=False (the norm is one pass over the elements whatever the split), ms:\n")  # fmt: skip
    print("| update | " + " | ".join(f"N={n}" for n in SPLITS) + f" | extra us per tensor (N={SPLITS[-1]} vs N={SPLITS[0]}) |")
    print("|---|" + "---|" * (len(SPLITS) + 1))
    for label in MODES:
        row = [ms[(label, n)] for n in SPLITS]
        slope = 1e3 * (row[-1] - row[0]) / (SPLITS[-1] - SPLITS[0])
        print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {slope:.1f} |")


if __name__ == "__main__":
    main()
