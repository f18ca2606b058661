"""What params without a gradient cost fxzero's own compiled update: ``step()`` of a model with adapters picked
in Python, against the same model with only the adapters it uses, paired in one run.

A frozen layer passed to the optimizer, an adapter or an expert a step does not pick has no gradient in that
step. It holds back only the run of the shard it lies in, whose other params step as stretches under the
compiled update (``fxzero/optim/update/shard_adam.py``); before, it sent every run of its param group to the
eager update, fragment by fragment. The model: four blocks, each a layer and two same-shaped adapters, the
step picking one adapter per block by its parity, so a third of the params have no gradient in each step and
the adapters' step counts part. The peer has one adapter per block (the same update work, nothing hidden): the
target is that the hidden adapters cost next to nothing (``x peer`` at most 1.1).

    python benchmarks/hidden_params.py [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fxzero

DIM = 640


class _Adapted(torch.nn.Module):
    def __init__(self, adapters: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.adapters = torch.nn.ModuleList(torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(adapters)) for _ in range(4))

    def forward(self, x: torch.Tensor, pick: int) -> torch.Tensor:
        for layer, adapters in zip(self.layers, self.adapters):
            x = F.gelu(layer(x)) + adapters[pick % len(adapters)](x)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for dtype in ("bf16", "fp8"):
        for adapters in (1, 2):
            model = _Adapted(adapters)
            config = fxzero.Config(optimizer_state_dtype=dtype)  # the update compiled: the default
            rows[(dtype, adapters)] = (model, fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model, config=config))
    x = torch.randn(32, DIM)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    for step in range(args.rounds + 2):  # two warm-up rounds: the compiles
        for key, (model, opt) in rows.items():
            model(x, step).square().mean().backward()
            start = time.perf_counter()
            opt.step()
            times[key].append(time.perf_counter() - start)
            opt.zero_grad()
    params = sum(p.numel() for p in rows[("bf16", 2)][0].parameters())
    print(f"# step() with adapters picked in Python, {params / 1e6:.2f}M params, torch {torch.__version__}, 1 thread, "
          f"median of {args.rounds} paired rounds\n")
    print("| state (update compiled, the default) | one adapter per block (peer), ms | two, one without gradient, ms | x peer | target | met |")
    print("|---|---|---|---|---|---|")
    for dtype in ("bf16", "fp8"):
        peer, hidden = (statistics.median(times[(dtype, adapters)][2:]) * 1e3 for adapters in (1, 2))
        print(f"| {dtype} | {peer:.1f} | {hidden:.1f} | {hidden / peer:.2f} | <= 1.1 | {'yes' if hidden <= 1.1 * peer else 'no'} |")

if __name__ == "__main__":
    main()
