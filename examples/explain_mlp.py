"""A small model to read fxzero's work on: ``fxzero explain examples/explain_mlp.py``.

A residual MLP whose forward breaks the Dynamo graph between its two blocks (as a
``print``, an ``.item()`` or an unsupported call does in real models), so the output
shows two compiled graphs and a bucket whose params are read by both.

    fxzero explain examples/explain_mlp.py --bucket-size 5000 --world-size 2 --overlap-param-gather
    fxzero explain examples/explain_mlp.py --bucket-size 5000 --world-size 2 --overlap-param-gather \
        --timeline docs/timeline.png      # the picture in docs/ (needs matplotlib)
"""

import torch
import torch.nn as nn


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 16, dim: int = 32, hidden: int = 64, d_out: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.mlp1 = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.mlp2 = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.mlp1(x)
        torch._dynamo.graph_break()  # what a print() or .item() here would do
        x = x + self.mlp2(x)
        return self.head(x)


def fxzero_explain() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """What ``fxzero explain`` calls: a model and example inputs (no optimizer:
    the command makes one with its ``--bucket-size``)."""
    torch.manual_seed(0)
    return ResidualMLP(), (torch.randn(8, 16),)
