"""Gradual unfreezing and param groups added later, as under torch.optim.

Frozen params (``requires_grad=False``) passed at construction sit in the buffers and are
left alone while frozen (no gradient: no state, no weight decay, ``.grad`` stays None), and
train once unfrozen, their gradients averaged over ranks. ``add_param_group`` after
construction lays the buffers out anew and keeps every existing param's state and fp32
master bitwise (LoRA adapters added after some steps). Each is compared with torch.optim
(world 1) or DDP + AdamW (world 2), bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.gradients import grad_sync
from fxzero.testing import run_ranks

LR, WD = 0.05, 0.1


class Lora(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(16, 2) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(2, 16) * 0.1)


class LoraNet(torch.nn.Module):
    """Two hidden layers, a low-rank adapter on the second one's output, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.lora = Lora()  # registered between body and head: its params sit between theirs in the buffers
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = getattr(self, "run_body", self.body)(x)
        return self.head(h + h @ self.lora.a @ self.lora.b)


def _nets(dtype: torch.dtype = torch.float32) -> tuple[LoraNet, LoraNet]:
    torch.manual_seed(0)
    model = LoraNet().to(dtype)
    return model, copy.deepcopy(model)


def _base(model: LoraNet) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if "lora" not in name]


def _lora(model: LoraNet) -> list[torch.nn.Parameter]:
    return [model.lora.a, model.lora.b]


def _batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step)).to(dtype)


def _train_step(forward: Callable[..., Any], opt: torch.optim.Optimizer, step: int, dtype: torch.dtype = torch.float32) -> None:
    forward(_batch(step, dtype)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _config() -> fxzero.Config:
    return fxzero.Config(bucket_size=200)  # several buckets: a new param moves the others'


def _compiled(model: torch.nn.Module, inner: Optional[str], fxzero_backend: bool) -> Callable[..., Any]:
    if inner is None:
        return model
    if fxzero_backend:
        return torch.compile(model, backend="fxzero", options={"inner_compiler": inner})
    return torch.compile(model, backend="inductor" if inner == "inductor" else "aot_eager")


def _same(model: torch.nn.Module, ref: torch.nn.Module) -> bool:
    return all(map(torch.equal, model.parameters(), ref.parameters()))


# ---- frozen at construction, unfrozen layer by layer --------------------------------
def _unfreezing_run(inner: Optional[str]) -> list[bool]:
    """ULMFiT-style: the head trains first, then the second layer, then the first; every
    param is given to the optimizer at construction, frozen or not."""
    model, ref = _nets()
    for net in (model, ref):
        net.body.requires_grad_(False)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=LR, weight_decay=WD, config=_config())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    forward, ref_forward = _compiled(model, inner, True), _compiled(ref, inner, False)
    same = []
    for step in range(6):
        if step in (2, 4):
            for net in (model, ref):
                net.body[4 - step].requires_grad_(True)  # step 2: body.2, step 4: body.0
        forward(_batch(step)).square().mean().backward()
        frozen = [p for p in model.parameters() if not p.requires_grad]
        same.append(all(p.grad is None for p in frozen))  # no gradient view for a frozen param
        opt.step()
        opt.zero_grad()
        same.append(all(not opt.state[p] for p in frozen))  # no state: never stepped
        _train_step(ref_forward, ref_opt, step)
        same.append(_same(model, ref))
    return same


def test_frozen_params_are_left_alone_and_train_once_unfrozen_as_under_torch_optim() -> None:
    assert all(_unfreezing_run(None))


# ---- add_param_group after construction -----------------------------------------------
def _lora_added_run(inner: Optional[str], body_only: bool = False) -> list[bool]:
    """A LoRA adapter added as a new param group after 3 steps, next to torch.optim doing
    the same; an LR scheduler over the optimizer sees the new group. ``body_only``: only
    the body is compiled, so its graph (no adapter in it) is not recompiled and runs on
    over the new layout, where its params sit in other buckets."""
    model, ref = _nets()
    for net in (model, ref):
        for p in _lora(net):
            p.requires_grad_(False)
    opt = fxzero.DistributedOptimizer(_base(model), torch.optim.AdamW, module=model, lr=LR, weight_decay=WD, config=_config())
    ref_opt = torch.optim.AdamW(_base(ref), lr=LR, weight_decay=WD)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (opt, ref_opt)]
    if body_only:
        for net, ours in ((model, True), (ref, False)):  # an attribute, not a submodule: names and order unchanged
            object.__setattr__(net, "run_body", _compiled(net.body, inner, ours))
        inner = None
    forward, ref_forward = _compiled(model, inner, True), _compiled(ref, inner, False)
    same = []
    for step in range(6):
        if step == 3:
            before, buckets = opt.consolidated_state_dict(), opt.param_table.bucket_of_slot
            for net, o in ((model, opt), (ref, ref_opt)):
                for p in _lora(net):
                    p.requires_grad_(True)
                o.add_param_group({"params": _lora(net), "lr": LR / 2, "weight_decay": 0.0})
            after = opt.consolidated_state_dict()
            kept = after["state"]
            same.append(all(k in kept.get(s, {}) and torch.equal(v, kept[s][k]) for s, state in before["state"].items() for k, v in state.items()))
            same.append(opt.param_table.bucket_of_slot[: len(buckets)] != buckets)  # the old params moved
            same.append(schedules[0].optimizer.param_groups is opt.param_groups and len(opt.param_groups) == 2)
        for fwd, o, schedule in ((forward, opt, schedules[0]), (ref_forward, ref_opt, schedules[1])):
            _train_step(fwd, o, step)
            schedule.step()
        same.append(_same(model, ref) and [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups])
    return same


def test_add_param_group_after_steps_keeps_the_state_and_trains_as_torch_optim() -> None:
    assert all(_lora_added_run(None))


@pytest.mark.slow
def test_unfreezing_and_add_param_group_compiled_with_inductor() -> None:
    """Unfreezing recompiles (Dynamo guards on requires_grad), and graphs compiled before a
    new group resolve their params against the new layout: bit for bit as Inductor alone."""
    assert all(_unfreezing_run("inductor"))
    assert all(_lora_added_run("inductor"))
    assert all(_lora_added_run("inductor", body_only=True))


def _bf16_run(add_later: bool) -> list[torch.Tensor]:
    """bf16 params, fp32 masters kept apart: added later, or present from the start (frozen)."""
    model, _ = _nets(torch.bfloat16)
    for p in _lora(model):
        p.requires_grad_(False)
    params = _base(model) if add_later else [{"params": _base(model)}, {"params": _lora(model), "lr": LR / 2}]
    opt = fxzero.DistributedOptimizer(params, torch.optim.AdamW, module=model, lr=LR, config=_config())
    for step in range(5):
        if step == 2:
            for p in _lora(model):
                p.requires_grad_(True)
            if add_later:
                opt.add_param_group({"params": _lora(model), "lr": LR / 2})
        _train_step(model, opt, step, torch.bfloat16)
    return [p.detach().clone() for p in model.parameters()]


def test_add_param_group_keeps_fp32_masters_of_bf16_params_bitwise() -> None:
    """Re-deriving the masters from the bf16 values would change every later update."""
    assert all(map(torch.equal, _bf16_run(add_later=True), _bf16_run(add_later=False)))


def test_add_param_group_refusals_name_the_fix_and_leave_the_optimizer_as_it_was() -> None:
    model, _ = _nets()
    opt = fxzero.DistributedOptimizer(_base(model), torch.optim.AdamW, module=model, lr=LR)
    model(_batch(0)).square().mean().backward()
    with pytest.raises(ValueError, match=r"add_param_group after a backward .* between steps"):
        opt.add_param_group({"params": _lora(model)})
    opt.step()
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.head.weight]})
    model.register_parameter("steps", torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    with pytest.raises(ValueError, match=r"param 'steps' \(shape \(2,\)\) has dtype torch.int64"):  # named by module path
        opt.add_param_group({"params": [model.lora.a, model.steps]})
    assert len(opt.param_groups) == 1
    opt.zero_grad()
    _train_step(model, opt, 1)


# ---- world 2: next to DDP ------------------------------------------------------------
def _beside_ddp() -> list[bool]:
    """Both behaviours at world 2 next to DDP + AdamW (DDP is wrapped anew whenever the
    trainable params change, as it must be), and ranks adding different groups."""
    model, ref = _nets()
    for net in (model, ref):
        net.body.requires_grad_(False)
        for p in _lora(net):
            p.requires_grad_(False)
    opt = fxzero.DistributedOptimizer(_base(model), torch.optim.AdamW, module=model, lr=LR, weight_decay=WD, config=_config())
    ref_opt = torch.optim.AdamW(_base(ref), lr=LR, weight_decay=WD)
    same = []
    for step in range(6):
        if step == 2:
            for net in (model, ref):
                net.body[2].requires_grad_(True)
        if step == 4:
            for net in (model, ref):
                for p in _lora(net):
                    p.requires_grad_(True)
            mine = _lora(model)[dist.get_rank() : dist.get_rank() + 1]  # ranks disagree
            try:
                opt.add_param_group({"params": mine})
                same.append(False)
            except ValueError as error:
                same.append("ranks disagree" in str(error))
            same.append(len(opt.param_groups) == 1)
            for net, o in ((model, opt), (ref, ref_opt)):
                o.add_param_group({"params": _lora(net), "lr": LR / 2})
        _train_step(model, opt, step)
        _train_step(torch.nn.parallel.DistributedDataParallel(ref), ref_opt, step)
        same.append(_same(model, ref))
    return same


@pytest.mark.slow
def test_unfreezing_and_add_param_group_at_world_2_train_as_ddp() -> None:
    results = run_ranks(2, _beside_ddp, timeout=180)
    assert all(results[0]) and results[0] == results[1], results


def _launch_order(opt: fxzero.DistributedOptimizer, run: Callable[[], None]) -> list[Any]:
    """What launched, and when the end of backward came, during ``run()``: the reductions'
    launches through the runtime's surface, the end of backward through the one function that
    queues fxzero's callback on the autograd engine (``_torch_compat.queue_end_of_backward``)."""
    events: list[Any] = []
    launch, queue = opt.runtime.reductions.launch, grad_sync.queue_end_of_backward

    def recorded_launch(indices: range) -> None:
        events.extend(indices)
        launch(indices)

    def recorded_queue(callback: Callable[[], None]) -> None:
        queue(lambda: (events.append("end"), callback()))

    opt.runtime.reductions.launch = recorded_launch  # type: ignore[method-assign]
    try:
        with mock.patch.object(grad_sync, "queue_end_of_backward", recorded_queue):
            run()
    finally:
        del opt.runtime.reductions.launch
    return events


def test_a_frozen_layer_does_not_hold_its_bucket_and_the_later_ones_to_the_end_of_backward() -> None:
    """Eagerly, every bucket's reduction launches inside the backward with a layer frozen
    (it was launched only at the end, with every bucket after it: a frozen backbone lost all
    overlap), and again once the layer is unfrozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    for p in model[1].parameters():
        p.requires_grad_(False)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model,
                                      config=fxzero.Config(bucket_size=16 * 16 + 16))  # fmt: skip

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()

    assert _launch_order(opt, step) == [0, 1, 2, 3, "end"]
    for p in model[1].parameters():
        p.requires_grad_(True)
    assert _launch_order(opt, step) == [0, 1, 2, 3, "end"]
    assert all(p.abs().sum() > 0 for p in model[1].parameters())
