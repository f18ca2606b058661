"""``Config.measure_grad_norm=False``: ``step()`` reads no gradient to norm it, and steps as ``torch.optim`` does.

What must hold without the norm: the same update bits as with it (presence, stale gradients and
the all-reduce of the flags need no norm), ``clip_grad_norm_`` through ``p.grad`` still clipping
by the global norm, ``GradScaler`` still skipping a step with an inf, a NaN gradient applied (as
torch.optim applies it, not skipped), ``clip_grad`` refused with it, and no norm computed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional
from unittest import mock

import pytest
import torch

import fxzero
from fxzero.optim.gradients.fragment_norms import FragmentNorms
from fxzero.testing import run_ranks

from test_stale_grads import CLIP, LR, SCHEDULE, WD, _no_clip, _run, _torch_clip


def _opt(**config: Any) -> Callable[[torch.nn.Module], fxzero.DistributedOptimizer]:
    def build(model: torch.nn.Module) -> fxzero.DistributedOptimizer:
        return fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, module=model,
                                           config=fxzero.Config(bucket_size=100, **config))  # fmt: skip

    return build


def _without_against_with(inner: Optional[str], clip: Callable[[Any, torch.nn.Module], None]) -> list[bool]:
    """The stale-gradient schedule (params that come and go, ranks that disagree, accumulation,
    gradients zeroed or assigned by hand) with and without the norm."""
    torch._dynamo.reset()
    without = _run(_opt(measure_grad_norm=False), inner, clip)
    torch._dynamo.reset()
    with_norm = _run(_opt(), inner, clip)
    return [torch.equal(a, b) for a, b in zip(without, with_norm)]


@pytest.mark.parametrize("inner", [None, "inductor"], ids=["eager", "inductor"])
def test_without_the_norm_the_steps_are_bitwise_the_steps_with_it(inner: Optional[str]) -> None:
    assert all(_without_against_with(inner, _no_clip))


def test_clip_grad_norm_through_p_grad_still_clips_by_the_global_norm() -> None:
    assert all(_without_against_with(None, _torch_clip))


@pytest.mark.slow
def test_without_the_norm_the_steps_are_bitwise_the_steps_with_it_at_world_2() -> None:
    """Rank 0 and rank 1 disagree on which heads got gradients: presence is summed without norms."""
    results = run_ranks(2, _without_against_with, None, _no_clip, timeout=300)
    assert results[0] == results[1] == [True] * len(SCHEDULE), results


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_no_norm_is_computed_and_step_reports_none() -> None:
    model = _model()
    opt = _opt(measure_grad_norm=False)(model)
    with mock.patch.object(FragmentNorms, "compute", side_effect=AssertionError("a norm was computed")):
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            result = opt.step()
            opt.zero_grad()
            assert not result.skipped and result.grad_norm is None and result.reason is None


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_gradient_is_applied_as_torch_optim_applies_it(fused: bool) -> None:
    models = [_model(), _model()]
    ours = fxzero.DistributedOptimizer(models[0].parameters(), torch.optim.AdamW, lr=LR, fused=fused,
                                       config=fxzero.Config(measure_grad_norm=False))  # fmt: skip
    theirs = torch.optim.AdamW(models[1].parameters(), lr=LR, fused=fused)
    for model, opt in zip(models, (ours, theirs)):
        model(torch.ones(2, 8)).sum().backward()
        grad = model[0].weight.main_grad if opt is ours else model[0].weight.grad
        grad[0, 0] = float("nan")
        result = opt.step()
        assert opt is theirs or (not result.skipped and result.grad_norm is None)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    assert models[0][0].weight[0, 0].isnan()


def _scaled(config: fxzero.Config) -> tuple[list[Optional[str]], list[torch.Tensor]]:
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, config=config)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    reasons = []
    for step in range(3):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
        scaler.scale(loss * (torch.inf if step == 1 else 1.0)).backward()
        reasons.append(scaler.step(opt).reason)
        scaler.update()
        opt.zero_grad()
    return reasons, [p.detach().clone() for p in model.parameters()]


def test_grad_scaler_still_skips_the_step_with_an_inf() -> None:
    without, with_norm = _scaled(fxzero.Config(measure_grad_norm=False)), _scaled(fxzero.Config())
    assert without[0] == with_norm[0] == [None, "found_inf", None]
    assert all(torch.equal(a, b) for a, b in zip(without[1], with_norm[1]))


def test_clip_grad_without_the_norm_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"Config.clip_grad=0.3 .*measure_grad_norm=False"):
        fxzero.Config(clip_grad=CLIP, measure_grad_norm=False)
    with pytest.raises(TypeError, match="Config.measure_grad_norm must be a bool"):
        fxzero.Config(measure_grad_norm="no")  # type: ignore[arg-type]
