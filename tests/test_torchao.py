"""torchao's low-bit AdamW (8-bit, 4-bit, FP8 state) wrapped by DistributedOptimizer.

Their blockwise quantisation must see whole params, which the default for a class fxzero
does not know gives (whole-param ownership). They keep ``lr`` as a tensor in each group and
refuse a step whose ``lr`` became a number ("lr was changed to a non-Tensor object"): fxzero
hands a scheduler's number over with ``fill_`` (:func:`fxzero.optim.state.state_dict.copy_hyperparameters`).
At world 1 training is bitwise torchao's own; at world 2 it matches torchao stepping on the
gradients averaged over both ranks' batches, as under DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.testing import run_ranks

torchao_optim = pytest.importorskip("torchao.optim")
CLASSES = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
STEPS, LR = 4, 1e-3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # torchao quantises params of >= 4096 elements, in blocks of 256 (8-bit) or 128 (4-bit)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 128, generator=torch.Generator().manual_seed(100 * step + rank))


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """As a scheduler would: a number into every group (torchao's own groups need ``fill_``)."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@pytest.mark.models  # a third-party optimizer: torchao's, an Inductor-compiled step each
@pytest.mark.parametrize("name", CLASSES)
def test_torchao_low_bit_adamw_trains_bitwise_like_itself_at_world_1(name: str) -> None:
    cls = getattr(torchao_optim, name)
    model, reference = _model(), _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), cls, lr=LR, module=model)
    plain = cls(reference.parameters(), lr=LR)
    for step in range(STEPS):
        for m, o in ((model, opt), (reference, plain)):
            _set_lr(o, LR * (step + 1))  # a warm-up schedule: a number each step
            m(_batch(step, 0)).square().mean().backward()
            o.step()
            o.zero_grad()
    assert opt.runtime.whole_params
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def _world_2() -> dict[str, float]:
    rank, out = dist.get_rank(), {}
    for name in CLASSES:
        cls = getattr(torchao_optim, name)
        model, reference = _model(), _model()
        opt = fxzero.DistributedOptimizer(model.parameters(), cls, lr=LR, module=model)
        plain = cls(reference.parameters(), lr=LR)
        for step in range(STEPS):
            model(_batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            grads = []
            for r in range(2):
                reference.zero_grad()
                reference(_batch(step, r)).square().mean().backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
            for p, g0, g1 in zip(reference.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            plain.step()
        out[name] = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    return out


@pytest.mark.slow
@pytest.mark.models
def test_torchao_low_bit_adamw_at_world_2_matches_itself_on_averaged_gradients() -> None:
    for result in run_ranks(2, _world_2, timeout=300):
        for name in CLASSES:
            assert result[name] <= 1e-6, (name, result)
