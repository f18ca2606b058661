"""Gradients made by hand (``p.grad = g``) and ``torch.autograd.grad`` behave as under DDP + torch.optim.

A gradient assigned by hand is used as is on each rank (DDP averages only what backward
produces, and ZeroRedundancyOptimizer steps each shard from its rank's ``.grad``): with the
same ``g`` on every rank the step equals plain torch.optim bit for bit. ``autograd.grad``
accumulates nothing, so it never touches fxzero's buffers (DDP's reducer is bypassed the
same way) and the next ``backward()`` + ``step()`` is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from models import batch, build, loss_fn, param_groups
from torch.distributed.checkpoint.state_dict import _init_optim_state

import fxzero
from fxzero.testing import run_ranks

LR, GLOBAL, STEPS, CLIP = 1e-2, 8, 3, 0.05


def _fxzero() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    model = build("mlp")
    opt = fxzero.DistributedOptimizer(
        param_groups(model), torch.optim.AdamW, lr=LR, module=model, config=fxzero.Config(bucket_size=500)
    )
    return model, opt


def _reference() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build("mlp")
    return model, torch.optim.AdamW(param_groups(model), lr=LR)


def _local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch("mlp", step, GLOBAL)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    size = GLOBAL // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: v.clone() for n, v in model.state_dict().items()}  # waits for the gathers


def _untouched(opt: fxzero.DistributedOptimizer) -> bool:
    """No gradient reached fxzero's buffers and no bucket launched since the last step."""
    return not opt.runtime.ledger.written and not any(opt.runtime.ledger.launched) and not any(opt.runtime.ledger.presence)


# ---- p.grad = g ------------------------------------------------------------------------------
def _pcgrad(model: torch.nn.Module, step: int) -> None:
    """PCGrad on two tasks (the halves of the global batch, the same on every rank): each
    task's gradient by autograd.grad, the conflicting one projected, the sum assigned."""
    x, y = batch("mlp", step, GLOBAL)
    params = list(model.parameters())
    tasks = [torch.autograd.grad(loss_fn("mlp", model(x[s]), y[s]), params) for s in (slice(0, 4), slice(4, 8))]
    first, second = (torch.cat([g.flatten() for g in grads]) for grads in tasks)
    dot = first @ second
    if dot < 0:
        first = first - dot / second.square().sum() * second
    for param, grad in zip(params, (first + second).split([p.numel() for p in params])):
        param.grad = grad.view_as(param)  # a view into one flat tensor, as PCGrad code makes them


def _pcgrad_fxzero() -> list[str]:
    """fxzero and plain AdamW with PCGrad's gradients, side by side in this rank's process
    (the same threads make the same gradients); the names of params that differ."""
    model, opt = _fxzero()
    reference, reference_opt = _reference()
    for step in range(STEPS):
        _pcgrad(model, step)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # it used to skip the step with a "second step()" warning
            assert not opt.step().skipped
        assert all(p.grad is None for p in model.parameters())  # consumed, like backward's
        _pcgrad(reference, step)
        reference_opt.step()
        reference_opt.zero_grad()
    ours = _params(model)
    return [name for name, value in reference.named_parameters() if not torch.equal(ours[name], value)]


@pytest.mark.parametrize("world", [1, 2])
def test_hand_made_gradients_step_bitwise_like_adamw(world: int) -> None:
    """The same g on every rank: DDP + AdamW (which leaves assigned gradients alone) is plain
    AdamW, and so is fxzero, bit for bit."""
    assert run_ranks(world, _pcgrad_fxzero) == [[]] * world


def _hand_habit(model: torch.nn.Module, opt: torch.optim.Optimizer, how: str, scaler: torch.amp.GradScaler) -> float:
    """Between backward and step: one param's gradient replaced by hand (the same tensor on
    every rank), one dropped, then clipping or GradScaler over the mix."""
    model.fc1.weight.grad = model.fc1.weight.detach().sign() * 1e-2
    model.norm.weight.grad = None
    if how == "clip":
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


def _mixed(how: str, world: int) -> dict:
    model, opt = _fxzero() if world else _reference()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    seen = []
    for step in range(STEPS):
        x, y = _local(step) if world else batch("mlp", step, GLOBAL)
        loss = loss_fn("mlp", model(x), y)
        (scaler.scale(loss) if how == "scaler" else loss).backward()
        seen.append(_hand_habit(model, opt, how, scaler))
        if how == "clip":
            opt.step()
        opt.zero_grad()
    return {"seen": seen, "params": _params(model)}


@pytest.mark.parametrize("how", ["clip", "scaler"])
def test_hand_gradient_mixed_with_backward_ones_like_ddp(how: str) -> None:
    """Backward's gradients averaged, the assigned one used as is and counted once in the
    global norm (every rank holds all of it), the dropped one skipped: as under DDP."""
    reference = _mixed(how, world=0)
    for result in run_ranks(2, _mixed, how, 2):
        torch.testing.assert_close(result["seen"], reference["seen"], atol=1e-5, rtol=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)
    assert reference["params"]["norm.weight"].eq(1.0).all()  # dropped every step: never moved


def test_bad_hand_gradient_names_the_param() -> None:
    model, opt = _fxzero()
    model.out.bias.grad = torch.zeros_like(model.out.bias)
    model.out.bias.grad.data = torch.zeros(3)  # .data slips past torch's own shape check
    with pytest.raises(RuntimeError, match=r"p.grad of param 'out.bias' was assigned a tensor of shape \(3,\)"):
        opt.step()


def test_hand_gradient_assigned_before_a_compiled_backward() -> None:
    """Kept for step() when that backward does not reach the param, as torch.optim would use
    it (the end of backward put the param's view over it)."""
    torch._dynamo.reset()
    model = build("mlp_branch")
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=1.0, module=model)
    forward = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    x, y = batch("mlp", 0, GLOBAL)
    start = model.extra.weight.detach().clone()
    model.extra.weight.grad = torch.ones_like(start)
    loss_fn("mlp", forward(x), y).backward()  # the extra layer is not used
    opt.step()
    assert torch.equal(model.extra.weight.detach(), start - 1.0)


def _dcp_init_then_train() -> dict[str, torch.Tensor]:
    model, opt = _fxzero()
    before = _params(model)
    _init_optim_state(opt)  # what torch.distributed.checkpoint.state_dict does: zero grads, lr=0, step()
    assert all(torch.equal(v, before[k]) for k, v in _params(model).items())
    states = [opt.runtime.sharded_state.fragment_state(f) for f in opt.runtime.fragments]
    assert all(float(s["step"]) == 1 and not s["exp_avg"].any() for s in states)
    assert all(p.grad is None for p in model.parameters()) and opt.param_groups[0]["lr"] == LR
    for step in range(STEPS):
        x, y = _local(step)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_torch_dcp_optimizer_state_init_works_as_for_adamw() -> None:
    model, opt = _reference()
    _init_optim_state(opt)
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for result in run_ranks(2, _dcp_init_then_train):
        for name, value in model.named_parameters():
            torch.testing.assert_close(result[name], value, atol=1e-5, rtol=0, msg=name)


# ---- torch.autograd.grad ----------------------------------------------------------------------
def _with_input_grads(compile_with: str | None, world: int) -> dict:
    """Each step: input saliency by autograd.grad first, then the training backward and step
    (``world`` 0: plain AdamW, and plain torch.compile when ``compile_with``)."""
    torch._dynamo.reset()
    model, opt = _fxzero() if world else _reference()
    options = {"inner_compiler": compile_with} if world else None
    backend = "fxzero" if world else ("aot_eager" if compile_with == "eager" else "inductor")
    forward = torch.compile(model, backend=backend, options=options) if compile_with else model
    saliency = []
    for step in range(STEPS):
        x, y = _local(step)
        x.requires_grad_()
        loss = loss_fn("mlp", forward(x), y)
        (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
        assert not world or _untouched(opt)
        saliency.append(grad)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"saliency": saliency, "params": _params(model)}


def _saliency_side_by_side(compile_with: str | None) -> tuple[bool, bool]:
    """In one process (the same threads make the same floats): is fxzero's saliency plain
    torch.compile's bit for bit, and after training close to it?"""
    plain, ours = _with_input_grads(compile_with, world=0), _with_input_grads(compile_with, world=1)
    pairs = list(zip(ours["saliency"], plain["saliency"]))
    exact = all(torch.equal(a, b) for a, b in pairs)
    close = all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in pairs)
    return exact, close


@pytest.mark.parametrize("compile_with", [None, "eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_autograd_grad_wrt_inputs_leaves_the_buffers_alone(compile_with: str | None) -> None:
    """A saliency map (or a gradient penalty's input gradient): plain torch.compile's result,
    and nothing reaches fxzero's buffers or launches (it did, and the next backward found
    its buckets launched)."""
    ((exact, close),) = run_ranks(1, _saliency_side_by_side, compile_with)
    assert exact or (compile_with == "inductor" and close)
    if compile_with == "inductor":
        return  # Inductor compiles cost ~25 s each here; the 2-rank run is the eager one's
    reference = _trained_reference()
    for result in run_ranks(2, _with_input_grads, compile_with, 2):
        for name, value in reference.items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)


def _trained_reference() -> dict[str, torch.Tensor]:
    """Plain AdamW on the whole batch: what 2 ranks training on its halves must match."""
    model, opt = _reference()
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _param_grads_then_train(compiled: bool) -> dict:
    """Step 0: autograd.grad(loss, params) (grad-norm logging, SAM's first pass) before the
    training backward; then plain steps."""
    torch._dynamo.reset()
    model, opt = _fxzero()
    forward = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"}) if compiled else model
    logged = None
    for step in range(STEPS):
        x, y = _local(step)
        loss = loss_fn("mlp", forward(x), y)
        if step == 0 and compiled:
            with pytest.raises(RuntimeError, match="autograd.grad asked for the gradient of param .*loss.backward()"):
                torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            assert _untouched(opt)
        elif step == 0:
            logged = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            assert _untouched(opt)
            plain = build("mlp")  # this rank's own gradients, as under DDP (the reducer is bypassed)
            expected = torch.autograd.grad(loss_fn("mlp", plain(x), y), list(plain.parameters()))
            logged = all(torch.equal(a, b) for a, b in zip(logged, expected))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"logged": logged, "params": _params(model)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autograd_grad_wrt_params_then_backward_is_exact(compiled: bool) -> None:
    """Eager: autograd.grad returns this rank's own gradients (as under DDP) and fxzero sees
    nothing. Compiled: a clear error naming the fix, and nothing reached the buffers."""
    trained = _trained_reference()
    for result in run_ranks(2, _param_grads_then_train, compiled):
        for name, value in trained.items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)
        assert result["logged"] is (None if compiled else True)


def _backward_into_some(compiled: bool) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    model, opt = _fxzero()
    forward = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"}) if compiled else model
    for step in range(STEPS):
        x, y = _local(step)
        loss_fn("mlp", forward(x), y).backward(inputs=list(model.fc2.parameters()))
        opt.step()
        opt.zero_grad()
    return _params(model)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_with_inputs_updates_only_those(compiled: bool) -> None:
    model, opt = _reference()
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL)
        loss_fn("mlp", model(x), y).backward(inputs=list(model.fc2.parameters()))
        opt.step()
        opt.zero_grad()
    start = build("mlp").state_dict()
    for result in run_ranks(2, _backward_into_some, compiled):
        for name, value in model.named_parameters():
            torch.testing.assert_close(result[name], value, atol=1e-5, rtol=0, msg=name)
            assert name.startswith("fc2") or torch.equal(result[name], start[name]), name
