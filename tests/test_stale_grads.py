"""Consumed gradients are overwritten by the next step's, not zeroed (``fxzero.optim.gradients.stale_grads``).

The danger of leaving the last step's bytes in the grad buffers is a gradient that counts
them: a param that got a gradient in one step and none in the next (a branch not taken, a
head frozen again, an expert no token reached, a rank whose batch skipped it), whose stale
bytes would then be reduced, normed, clipped by and stepped on. Each run below trains a
model whose params come and go like that, with clipping (so one wrong norm moves every
param), accumulation, ``zero_grad(set_to_none=False)``, gradients assigned by hand and
ranks that disagree, and is compared bit for bit with the same run on buffers zeroed after
every step (what fxzero did before) and, at world 1, with ``torch.optim`` itself.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.gradients.stale_grads import StaleGrads
from fxzero.testing import run_ranks

LR, WD, CLIP = 0.05, 0.1, 0.3


class Heads(torch.nn.Module):
    """A trunk and three heads; each call says which heads it uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.a, self.b, self.c = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use: tuple[str, ...]) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return sum((getattr(self, name)(h) for name in use), h[:, :4])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# step -> one entry per microbatch: the heads each rank uses (rank 0's, rank 1's)
SCHEDULE: tuple[tuple[tuple[tuple[str, ...], tuple[str, ...]], ...], ...] = (
    ((("a", "b"), ("a", "b")),),
    ((("a",), ("a",)),),  # b got a gradient last step and none now
    ((("b",), ("b",)), (("c",), ("c",))),  # accumulation: a absent, c first reached by the second microbatch
    ((("a", "b"), ("c",)),),  # the ranks disagree: a and b present on rank 0 only, c on rank 1 only
    (((), ()),),  # no head on any rank: what the reduction left in each rank's shard is stale
    ((("c",), ("c",)),),
    ("zero_grad(set_to_none=False)",),  # a backward, then zeroed: every param steps on a zero gradient
    ((("a", "b"), ("a", "b")),),
    ("hand",),  # b's gradient assigned by hand, a's from backward
    ((("a",), ("c",)),),
)


def _run(opt_of: Callable[[torch.nn.Module], Any], compile_inner: Optional[str], clip: Callable[[Any, torch.nn.Module], None]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Heads()
    opt = opt_of(model)
    forward = model if compile_inner is None else torch.compile(model, backend="fxzero", options={"inner_compiler": compile_inner})
    rank = _rank()
    seen = []
    for step, entry in enumerate(SCHEDULE):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        if entry == ("zero_grad(set_to_none=False)",):
            forward(x, ("a", "b", "c")).square().mean().backward()
            opt.zero_grad(set_to_none=False)
        elif entry == ("hand",):
            forward(x, ("a",)).square().mean().backward()
            model.b.weight.grad = torch.full_like(model.b.weight, 0.25 * (rank + 1))
        else:
            for k, uses in enumerate(entry):
                last = k == len(entry) - 1
                context = contextlib.nullcontext() if last or not hasattr(opt, "no_sync") else opt.no_sync()
                with context:
                    forward(x + k, uses[rank % 2]).square().mean().backward()
        clip(opt, model)
        opt.step()
        opt.zero_grad()
        seen.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    return seen


def _fxzero(zeroed: bool) -> Callable[[torch.nn.Module], fxzero.DistributedOptimizer]:
    def build(model: torch.nn.Module) -> fxzero.DistributedOptimizer:
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, module=model,
                                          config=fxzero.Config(bucket_size=100, clip_grad=CLIP))  # fmt: skip
        if zeroed:  # the buffers zeroed after every step, as before stale gradients: nothing is ever stale
            buckets = opt.runtime.buckets
            opt.runtime.stale.consumed = lambda present: [b.grad_data.zero_() for b in buckets]
        return opt

    return build


def _no_clip(opt: Any, model: torch.nn.Module) -> None:
    pass


def _torch_clip(opt: Any, model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def _stale_against_zeroed(compile_inner: Optional[str]) -> list[bool]:
    ours = _run(_fxzero(False), compile_inner, _no_clip)
    zeroed = _run(_fxzero(True), compile_inner, _no_clip)
    return [torch.equal(a, b) for a, b in zip(ours, zeroed)]


@pytest.mark.parametrize("inner", [None, "inductor"], ids=["eager", "inductor"])
def test_stale_gradients_step_bitwise_as_zeroed_buffers_at_world_1(inner: Optional[str]) -> None:
    torch._dynamo.reset()
    assert all(_stale_against_zeroed(inner))


def test_stale_gradients_step_bitwise_as_torch_optim_at_world_1() -> None:
    """The eager run against ``torch.optim.AdamW`` with ``clip_grad_norm_`` and the same schedule."""
    ours = _run(_fxzero(False), None, _no_clip)
    theirs = _run(lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD), None, _torch_clip)
    for a, b in zip(ours, theirs):  # the clip factor may differ in its last bit (the norm's summation order)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _world_2(inner: Optional[str]) -> list[bool]:
    torch._dynamo.reset()
    return _stale_against_zeroed(inner)


@pytest.mark.parametrize("inner", [None, pytest.param("inductor", marks=pytest.mark.slow)], ids=["eager", "inductor"])  # inductor: 6 s
def test_stale_gradients_step_bitwise_as_zeroed_buffers_at_world_2(inner: Optional[str]) -> None:
    results = run_ranks(2, _world_2, inner, timeout=300)
    assert results[0] == results[1] == [True] * len(SCHEDULE), results


def test_a_bucket_with_no_gradient_is_zeroed_whole_and_a_partial_one_param_by_param() -> None:
    """The bookkeeping alone, on two buckets of three params."""
    data = [torch.full((6,), 7.0), torch.full((6,), 7.0)]

    class _Bucket:
        def __init__(self, grad_data: torch.Tensor) -> None:
            self.grad_data = grad_data

    mains = [data[0][0:2], data[0][2:4], data[0][4:6], data[1][0:2], data[1][2:4], data[1][4:6]]
    stale = StaleGrads(mains, [0, 0, 0, 1, 1, 1], [_Bucket(d) for d in data])  # type: ignore[list-item]
    stale.consumed(None)
    assert all(stale.stale(s) for s in range(6))
    stale.write(3, torch.tensor([1.0, 2.0]))  # overwrites: no 7 left
    stale.write(3, torch.tensor([1.0, 1.0]))  # adds
    assert mains[3].tolist() == [2.0, 3.0] and not stale.stale(3)
    stale.write_group(1, [mains[4]], [torch.tensor([5.0, 5.0])], torch.tensor([4]), slice(4, 5))
    stale.zero_left(0)
    stale.zero_left(1)
    assert data[0].tolist() == [0.0] * 6
    assert data[1].tolist() == [2.0, 3.0, 5.0, 5.0, 0.0, 0.0]
    assert not any(stale.stale(s) for s in range(6))
    stale.consumed([1.0, 0.0, 0.0, 2.0, 0.0, 1.0])  # counted: only params some rank gave a gradient
    assert [stale.stale(s) for s in range(6)] == [True, False, False, True, False, True]
