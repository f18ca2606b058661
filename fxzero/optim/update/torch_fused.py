"""torch's fused Adam(W) kernel over the fp32 masters that remainders rebuild (``fused=True``).

With ``Config.param_remainders`` fxzero steps Adam itself (:mod:`.shard_adam`): the fp32 master
of a run is rebuilt from the bf16 param and its int16 remainder, updated and split again. The
update in between can be torch's own fused kernel when the user asks for ``fused=True``, with
the bits of the fp32-master run that asks for it: that run steps each fragment's master with
``torch.optim.AdamW(fused=True)`` (torch's CPU kernel gives other bits over one flat tensor than
over each param, so fxzero keeps its fragments apart), and so does this class, over views of the
rebuilt master at each fragment's place, with torch's functional ``adam`` (the function
``torch.optim.Adam.step`` calls), per-fragment step tensors and the same hyperparameters. So
training with remainders and ``fused=True`` is bitwise the half-away fp32-master run with
``fused=True`` (``tests/test_precision.py``).

Moments in fp32 only: the narrow moments have no fused kernel in torch (refused, naming the option).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.adam import adam as functional_adam

__all__ = ["TorchFusedRun"]


class TorchFusedRun:
    """One run's fragments, stepped by torch's fused Adam(W) kernel."""

    def __init__(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 spans: Sequence[slice]) -> None:  # fmt: skip
        """``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``: the run's fp32 tensors (the master
        rebuilt in place each step); ``spans``: each fragment's place in them."""
        self.masters = [master[at] for at in spans]
        self.grads = [grad[at] for at in spans]
        self.exp_avgs = [exp_avg[at] for at in spans]
        self.exp_avg_sqs = [exp_avg_sq[at] for at in spans]
        # torch.optim keeps a param's fused step count as an fp32 tensor on the param's device
        self.steps = [torch.zeros((), dtype=torch.float32, device=master.device) for _ in spans]

    def step(self, counts: list[int], present: Sequence[int], hyper: tuple) -> None:
        """Step fragments ``present`` (their positions in the run) from step counts ``counts``
        (one per fragment, advanced here for those stepped)."""
        lr, beta1, beta2, eps, weight_decay, maximize, decoupled = hyper
        for k in present:
            self.steps[k].fill_(counts[k])
            counts[k] += 1
        pick = lambda tensors: [tensors[k] for k in present]  # noqa: E731
        functional_adam(pick(self.masters), pick(self.grads), pick(self.exp_avgs), pick(self.exp_avg_sqs), [], pick(self.steps),
                        fused=True, decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                        weight_decay=weight_decay, eps=eps, maximize=maximize)  # fmt: skip
