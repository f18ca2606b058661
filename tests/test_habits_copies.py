"""Habits around copies of the model and its buffers, next to DDP + the same torch.optim.

Each rank trains a fxzero model (compiled with ``backend="fxzero"``) and a DDP model over
the same process group on its own slice of the data; with two ranks the averaged
gradients are bitwise DDP's, so everything here is compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fxzero
from fxzero.optim.binding import owner_of
from fxzero.testing import run_ranks

warnings.filterwarnings("ignore", message="fxzero: this compiled graph")

LR, STEPS = 1e-2, 4


class _Tiny(torch.nn.Module):
    """A layer and params of the root itself, over three buckets: ``deepcopy`` copies the
    root's own params before it reaches any hook, and with overlap on the step leaves the
    third bucket's gather for the next forward to launch."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(16, 8) / 3), torch.nn.Parameter(torch.zeros(16))
        self.w2, self.b2 = torch.nn.Parameter(torch.randn(4, 16) / 4), torch.nn.Parameter(torch.zeros(4))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.linear(x, self.w1, self.b1).relu()
        return self.out(torch.nn.functional.linear(hidden, self.w2, self.b2))


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Tiny()


def _local(step: int, shape: tuple[int, ...] = (8,)) -> torch.Tensor:
    """This rank's slice of step ``step``'s global batch (ranks see different data)."""
    x = torch.randn(2 * dist.get_world_size(), *shape, generator=torch.Generator().manual_seed(step))
    return x[2 * dist.get_rank() : 2 * dist.get_rank() + 2]


def _pair(build, config: fxzero.Config) -> tuple:
    """(model, its compiled form, fxzero optimizer), (DDP's own copy, DDP, AdamW)."""
    torch._dynamo.reset()
    model, reference = build(), build()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=config)
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    ddp = DDP(reference)
    return (model, compiled, opt), (reference, ddp, torch.optim.AdamW(reference.parameters(), lr=LR))


def _train(run: tuple, x: torch.Tensor) -> None:
    _, forward, opt = run
    forward(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _values(module: torch.nn.Module) -> dict:
    return {n: v.detach().clone() for n, v in module.state_dict().items()}


def _assert_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


# ---- 1. EMA / teacher copies: deepcopy, AveragedModel, torch.save(model) --------------------
def _copies(overlap: bool) -> dict:
    ours, ref = _pair(_tiny, fxzero.Config(bucket_size=16, overlap_param_gather=overlap))
    ema_fn = get_ema_multi_avg_fn(0.9)
    emas = [AveragedModel(ours[0], multi_avg_fn=ema_fn)], [AveragedModel(ref[0], multi_avg_fn=ema_fn)]
    out: dict = {"buckets": len(ours[2].buckets)}
    for step in range(STEPS):
        _train(ours, _local(step))
        _train(ref, _local(step))
        # right after a step: with overlap on, its gathers are in flight
        if step == 1:
            saved = io.BytesIO()
            torch.save(ours[0], saved)
            out["saved"] = _values(torch.load(io.BytesIO(saved.getvalue()), weights_only=False)), _values(ref[0])
        if step == 2:
            copied, ref_copied = copy.deepcopy(ours[0]), copy.deepcopy(ref[0])
            emas[0].append(AveragedModel(ours[0], multi_avg_fn=ema_fn))
            emas[1].append(AveragedModel(ref[0], multi_avg_fn=ema_fn))
            out["copied"] = _values(copied), _values(ref_copied)
        ours[2].finish_param_sync()  # reading the params by hand after step() (a no-op without overlap)
        for mine, theirs in zip(*emas):
            mine.update_parameters(ours[0])
            theirs.update_parameters(ref[0])
    x = _local(STEPS)
    out["ema"] = [(_values(m), m(x).detach(), _values(t), t(x).detach()) for m, t in zip(*emas)]
    out["plain"] = _plain_copy(copied, ref_copied, ours[2], x)
    return out


def _plain_copy(copied: torch.nn.Module, reference: torch.nn.Module, opt: fxzero.DistributedOptimizer, x: torch.Tensor) -> dict:
    """The copy trains as a plain module: its own grads, no fxzero hook, nothing reaches ``opt``."""
    for module in (copied, reference):
        module(x).square().mean().backward()
    return {
        "grads": [torch.equal(p.grad, q.grad) for p, q in zip(copied.parameters(), reference.parameters())],
        "owners": [owner_of(p) for p in copied.parameters()],
        "opt_grads_untouched": all(not b.grad_data.any() for b in opt.buckets),
    }


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_deepcopy_averaged_model_and_torch_save_of_a_managed_model_are_plain_current_copies(overlap: bool) -> None:
    for result in run_ranks(2, _copies, overlap):
        assert result["buckets"] == 4
        _assert_equal(*result["copied"])
        _assert_equal(*result["saved"])
        for ours, ours_out, theirs, theirs_out in result["ema"]:  # made before step 1, and after step 3
            _assert_equal(ours, theirs)
            assert torch.equal(ours_out, theirs_out)
        assert all(result["plain"]["grads"]), result["plain"]
        assert result["plain"]["owners"] == [None] * 6
        assert result["plain"]["opt_grads_untouched"]
