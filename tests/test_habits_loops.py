"""GAN and RL loops, and the per-step habits they lean on, as torch.optim (+ DDP) run them.

* DCGAN (pytorch/examples): two optimizers, ``netD.zero_grad()`` after G's backward filled
  D's gradients; ``model.zero_grad()`` then does what ``opt.zero_grad()`` does.
* A2C: one compiled forward, the actor loss's backward (``retain_graph``) under ``no_sync()``,
  then the critic loss's.
* WGAN's ``p.data.clamp_`` and an EMA's ``copy_to``/``restore`` right after ``step()`` with
  ``overlap_param_gather``: an error on every rank naming ``finish_param_sync()``; with it, DDP's params.
* ``zero_grad(set_to_none=False)`` then a step with no backward: weight decay and momentum apply.
* ``opt.full_grads()``: whole averaged gradients for logging, as DDP's ``p.grad``.

World 1 against plain torch.optim in the same process; world 2 against DDP + torch.optim on the
same ranks, packed into one run.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxzero
from fxzero.optim.gradients.ledger import LateGradient
from fxzero.testing import run_ranks

STEPS = 3


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _draw(step: int, *shape: int) -> torch.Tensor:
    """This rank's slice of the step's global batch (the whole batch at world 1)."""
    rank, world = _rank()
    whole = torch.randn(shape[0] * 2, *shape[1:], generator=torch.Generator().manual_seed(step))
    size = whole.shape[0] // world
    return whole[rank * size : (rank + 1) * size]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=atol) if atol else torch.equal(x, y) for x, y in zip(a, b))


def _values(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


# ---- DCGAN: netD.zero_grad() after G's backward put gradients into D ---------------------------
def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    return generator, discriminator


def _adam(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"lr": 2e-3, "betas": (0.5, 0.999)}
    if kind == "fxzero":
        return fxzero.DistributedOptimizer(model.parameters(), torch.optim.Adam, module=model, config=fxzero.Config(bucket_size=100), **kwargs)
    return torch.optim.Adam(model.parameters(), **kwargs)


def _dcgan(kind: str, set_to_none: bool, compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    """pytorch/examples/dcgan/main.py's loop; ``kind`` is "fxzero", "torch" (world 1) or "ddp".
    fxzero runs D's first backward under ``no_sync()`` (every backward but a step's last), DDP too."""
    G, D = _gan()
    opt_d, opt_g = _adam(kind, D), _adam(kind, G)
    net_d, net_g = (nn.parallel.DistributedDataParallel(D), nn.parallel.DistributedDataParallel(G)) if kind == "ddp" else (D, G)
    if compiled:
        net_d, net_g = (torch.compile(m, backend="fxzero") for m in (net_d, net_g))
    criterion, losses = nn.BCELoss(), []
    for step in range(STEPS):
        real, noise = _draw(step, 6, 8), _draw(100 + step, 6, 4)
        D.zero_grad(set_to_none=set_to_none)
        label = torch.ones(real.shape[0], 1)
        with opt_d.no_sync() if kind == "fxzero" else net_d.no_sync() if kind == "ddp" else contextlib.nullcontext():
            err_real = criterion(net_d(real), label)
            err_real.backward()
        fake = net_g(noise)
        err_fake = criterion(net_d(fake.detach()), label.fill_(0.0))
        err_fake.backward()
        opt_d.step()
        G.zero_grad(set_to_none=set_to_none)
        err_g = criterion(net_d(fake), label.fill_(1.0))
        err_g.backward()
        opt_g.step()
        losses += [err_real.item(), err_fake.item(), err_g.item()]
    if kind == "fxzero":
        opt_d.finish_param_sync(), opt_g.finish_param_sync()
    return losses, _values(D, G)


@pytest.mark.parametrize(
    "set_to_none, compiled", [(True, False), (False, False), (True, True)], ids=["eager", "eager-set_to_none=False", "inductor"]
)
def test_dcgan_model_zero_grad_after_the_generators_backward_trains_like_torch_optim(set_to_none: bool, compiled: bool) -> None:
    """G's backward reduces D's gradients too; ``netD.zero_grad()`` then drops them, so D's next
    backward starts D's step over (it raised LateGradient). Eager: bitwise; Inductor: within 1e-6."""
    losses, params = _dcgan("fxzero", set_to_none, compiled)
    ref_losses, ref_params = _dcgan("torch", set_to_none, False)
    if compiled:
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6)
        assert _close(params, ref_params, atol=1e-6)
    else:
        assert losses == ref_losses and _close(params, ref_params)


def test_a_backward_into_gradients_not_cleared_is_still_late() -> None:
    """Only a ``model.zero_grad()`` over every param of the optimizer starts the step over."""
    G, D = _gan()
    opt = _adam("fxzero", D)
    D(torch.randn(3, 8)).sum().backward()
    D[0].weight.grad = None  # one param only
    with pytest.raises(RuntimeError, match=r"model\.zero_grad\(\) over every param"):  # autograd adds into a view
        D(torch.randn(3, 8)).sum().backward()
    opt.zero_grad()
    D(torch.randn(3, 8)).sum().backward()
    D[0].weight.grad = None
    with pytest.raises(LateGradient, match=r"model\.zero_grad\(\)` over every param"), opt.no_sync():  # a launched bucket
        D[0].weight.sum().backward()


def test_each_step_and_each_zero_grad_start_the_ledgers_step_once() -> None:
    """``step()`` starts one ledger step (the gradients are consumed), ``zero_grad()`` one; so does
    the ``model.zero_grad()`` reset a late gradient triggers, and a skipped step."""
    _, D = _gan()
    opt = _adam("fxzero", D)
    with mock.patch.object(opt.runtime.ledger, "start_step", wraps=opt.runtime.ledger.start_step) as start_step:
        D(torch.randn(3, 8)).sum().backward()
        opt.step()
        assert start_step.call_count == 1
        opt.zero_grad()
        assert start_step.call_count == 2
        with pytest.warns(UserWarning, match="found no gradient"):
            assert opt.step().reason == "no_gradients"
        assert start_step.call_count == 3
        D(torch.randn(3, 8)).sum().backward()
        D.zero_grad()  # every param's gradient cleared: the next backward starts the step over
        D(torch.randn(3, 8)).sum().backward()
        assert start_step.call_count == 4


# ---- A2C: one compiled forward, two backwards -----------------------------------------------------
class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.pi, self.v = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return torch.log_softmax(self.pi(h), -1), self.v(h)


def _a2c(kind: str) -> list[torch.Tensor]:
    """The actor's backward (``retain_graph``) under ``no_sync()``, then the critic's: fxzero
    compiled under Inductor, or eager torch.optim with DDP's averaging ("ddp": DDP itself refuses a
    second backward of one forward, "marked ready twice", so the gradients are all-reduced by hand);
    buckets small enough to launch during the critic's backward."""
    model = _ActorCritic()
    if kind == "fxzero":
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2, module=model, config=fxzero.Config(bucket_size=64))
        forward, quiet = torch.compile(model, backend="fxzero"), opt.no_sync
    else:
        opt, forward, quiet = torch.optim.Adam(model.parameters(), lr=1e-2), model, contextlib.nullcontext
    for step in range(STEPS + 1):  # the first compiled step learns the counts: three more use them
        x, reward = _draw(step, 5, 6), _draw(50 + step, 5, 1)
        action = torch.arange(x.shape[0]) % 3
        logp, value = forward(x)
        actor = -(logp.gather(1, action[:, None]) * (reward - value).detach()).mean()
        critic = (reward - value).pow(2).mean()
        with quiet():
            actor.backward(retain_graph=True)
        critic.backward()
        if kind == "ddp":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
    if kind == "fxzero":
        opt.finish_param_sync()
    return _values(model)


def test_a2c_compiled_forward_two_backwards_with_retain_graph_and_no_sync_trains_like_torch_optim() -> None:
    """The critic's backward runs the compiled graph's backward a second time: its gradients are
    counted again (they raised LateGradient: the first backward had consumed the counts)."""
    assert _close(_a2c("fxzero"), _a2c("torch"), atol=1e-6)


# ---- zero_grad(set_to_none=False), then a step with no backward ------------------------------------
_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.1}),
}


def _stepped_without_backward(kind: str, name: str, set_to_none: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """Each step: a backward and a step, then ``zero_grad(set_to_none)`` and a step with no
    backward. Returns the params and, for fxzero, whether each gradient-free step was skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    cls, kwargs = _OPTIMIZERS[name]
    if kind == "fxzero":
        opt = fxzero.DistributedOptimizer(model.parameters(), cls, module=model, config=fxzero.Config(bucket_size=20), **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)
    forward = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    skipped = []
    for step in range(STEPS):
        forward(_draw(step, 3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fxzero's "no gradients" warning, asserted below
            result = opt.step()
        skipped.append(bool(getattr(result, "skipped", False)))
    if kind == "fxzero":
        opt.finish_param_sync()
    return _values(model), skipped


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_zero_grad_keeping_zeros_then_a_step_without_backward_decays_like_torch_optim(name: str) -> None:
    """torch.optim keeps zero-filled gradients: the step applies weight decay and momentum (fxzero
    skipped it); with ``set_to_none=True`` (the default) there is nothing to apply: skipped, with a warning."""
    params, skipped = _stepped_without_backward("fxzero", name, set_to_none=False)
    assert skipped == [False] * STEPS and _close(params, _stepped_without_backward("torch", name, False)[0])
    params, skipped = _stepped_without_backward("fxzero", name, set_to_none=True)
    assert skipped == [True] * STEPS and _close(params, _stepped_without_backward("torch", name, True)[0])


def _zeroed_keeping_zeros(kind: str, zero_grad_first: bool, by: str, inner: Optional[str] = None) -> list[torch.Tensor]:
    """Step 0 reaches both heads; steps 1 and 2 zero the gradients with ``set_to_none=False`` (the
    optimizer's or the model's) and reach head ``a`` only. Head ``b`` holds a zero gradient in
    torch.optim unless ``zero_grad()`` set it to ``None`` after step 0."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    if kind == "fxzero":
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, weight_decay=0.1, module=model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    heads = {name: model[name] if inner is None else torch.compile(model[name], backend="fxzero", options={"inner_compiler": inner})
             for name in ("a", "b")}  # fmt: skip
    x = _draw(0, 2, 4)
    (heads["a"](x) + heads["b"](x)).sum().backward()
    opt.step()
    if zero_grad_first:
        opt.zero_grad()
    for _ in range(2):
        (opt if by == "opt" else model).zero_grad(set_to_none=False)
        heads["a"](x).sum().backward()
        opt.step()
    return _values(model)


@pytest.mark.parametrize("inner", [None, "inductor"], ids=["eager", "inductor"])
@pytest.mark.parametrize("zero_grad_first", [False, True], ids=["held", "set-to-None-first"])
def test_opt_zero_grad_keeping_zeros_zeroes_the_gradients_params_hold_as_torch_optim(zero_grad_first: bool, inner: Optional[str]) -> None:
    """A param whose gradient ``zero_grad()`` set to ``None`` stays without one (fxzero stepped it);
    compiled, the heads' gradients reach the buffers from the graphs' backward."""
    torch._dynamo.reset()
    ours = _zeroed_keeping_zeros("fxzero", zero_grad_first, "opt", inner)
    assert _close(ours, _zeroed_keeping_zeros("torch", zero_grad_first, "opt"), atol=0.0 if inner is None else 1e-6)


def test_model_zero_grad_keeping_zeros_after_a_step_zeroes_nothing() -> None:
    """The documented difference: ``step()`` consumed the gradients (``p.grad`` is ``None``), so the
    model's ``zero_grad(set_to_none=False)`` has none to zero and head ``b`` is not stepped, where
    torch.optim steps it on a zero gradient; ``opt.zero_grad(set_to_none=False)`` does that."""
    ours, theirs = _zeroed_keeping_zeros("fxzero", False, "model"), _zeroed_keeping_zeros("torch", False, "model")
    assert _close(ours[:2], theirs[:2]) and not _close(ours[2:], theirs[2:])
    assert _close(_zeroed_keeping_zeros("fxzero", False, "opt"), theirs)


def _added_group_keeping_zeros(kind: str, inner: Optional[str] = None) -> list[torch.Tensor]:
    """Step 0 reaches heads ``a`` and ``b``; then head ``c`` joins in a param group of its own, and
    steps 1 and 2 zero the gradients with ``set_to_none=False`` and reach ``a`` and ``c`` only: ``b``
    holds a zero gradient in torch.optim, across the new layout ``add_param_group`` makes in fxzero."""
    torch.manual_seed(0)
    model = nn.ModuleDict({name: nn.Linear(4, 4) for name in "abc"})
    first = [*model["a"].parameters(), *model["b"].parameters()]
    if kind == "fxzero":
        opt = fxzero.DistributedOptimizer(first, torch.optim.AdamW, lr=0.1, weight_decay=0.1, module=model)
    else:
        opt = torch.optim.AdamW(first, lr=0.1, weight_decay=0.1)
    heads = {name: model[name] if inner is None else torch.compile(model[name], backend="fxzero", options={"inner_compiler": inner})
             for name in "abc"}  # fmt: skip
    x = _draw(0, 2, 4)
    (heads["a"](x) + heads["b"](x)).sum().backward()
    opt.step()
    opt.add_param_group({"params": list(model["c"].parameters())})
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        (heads["a"](x) + heads["c"](x)).sum().backward()
        opt.step()
    return _values(model)


@pytest.mark.parametrize("inner", [None, "inductor"], ids=["eager", "inductor"])
def test_a_param_group_added_later_keeps_which_params_hold_a_gradient(inner: Optional[str]) -> None:
    """``add_param_group`` lays the params out anew; the record of which ones hold a gradient survives it
    (compiled: the graphs resolve their params against the new layout)."""
    torch._dynamo.reset()
    ours = _added_group_keeping_zeros("fxzero", inner)
    assert _close(ours, _added_group_keeping_zeros("torch"), atol=0.0 if inner is None else 1e-6)


# ---- full gradients for logging ----------------------------------------------------------------------
def _logged_grads(kind: str) -> list[dict[str, torch.Tensor]]:
    """Whole gradients between backward and step, after a backward and after clipping."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 2))
    if kind == "fxzero":
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model, config=fxzero.Config(bucket_size=20))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    logged = []
    for step in range(2):
        forward(_draw(step, 3, 4)).pow(2).mean().backward()
        logged.append(opt.full_grads() if kind == "fxzero" else {n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        logged.append(opt.full_grads() if kind == "fxzero" else {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return logged


def _same_grads(logged: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]) -> bool:
    return all(a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=1e-6, atol=1e-7) for n in a) for a, b in zip(logged, reference))


def test_full_grads_returns_each_params_whole_gradient_as_torch_optim_sees_it() -> None:
    assert _same_grads(_logged_grads("fxzero"), _logged_grads("torch"))


def test_unsupported_use_of_p_grad_points_to_full_grads() -> None:
    model = nn.Linear(4, 2)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)
    model(torch.randn(3, 4)).sum().backward()
    for use in (torch.Tensor.abs, torch.histc):
        with pytest.raises(RuntimeError, match=r"'weight'.*call `optimizer\.full_grads\(\)` on every rank"):
            use(model.weight.grad)
    assert torch.equal(opt.full_grads()["bias"], torch.full((2,), 3.0))


# ---- writes through p.data after step() with overlap_param_gather ---------------------------------------
def _written_through_data(pattern: str, finish_first: bool, overlap: bool = True, kind: str = "fxzero") -> Any:
    """WGAN's weight clamp, or an EMA's store/copy_to/eval/restore, right after each step. Returns
    the params, or the error's message."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    if kind == "fxzero":
        config = fxzero.Config(bucket_size=300, overlap_param_gather=overlap)
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.RMSprop, lr=5e-3, module=model, config=config)
        forward: nn.Module = model
    else:
        opt, forward = torch.optim.RMSprop(model.parameters(), lr=5e-3), nn.parallel.DistributedDataParallel(model)
    ema = _values(model)
    try:
        for step in range(STEPS):
            forward(_draw(step, 4, 8)).mean().backward()
            opt.step()
            opt.zero_grad()
            if finish_first:
                opt.finish_param_sync()
            _PATTERNS[pattern](model, ema)
    except RuntimeError as err:
        return str(err)
    if kind == "fxzero":
        opt.finish_param_sync()
    return _values(model)


def _clamp(model: nn.Module, ema: list[torch.Tensor]) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


def _ema_eval(model: nn.Module, ema: list[torch.Tensor]) -> None:
    """diffusers' EMAModel habit: update, store, copy_to, evaluate, restore."""
    with torch.no_grad():
        for shadow, p in zip(ema, model.parameters()):
            shadow.mul_(0.9).add_(p, alpha=0.1)
    stored = [p.detach().clone() for p in model.parameters()]
    for shadow, p in zip(ema, model.parameters()):
        p.data.copy_(shadow.data)
    with torch.no_grad():
        model(torch.ones(2, 8))
    for kept, p in zip(stored, model.parameters()):
        p.data.copy_(kept.data)


_PATTERNS: dict[str, Callable[[nn.Module, list[torch.Tensor]], None]] = {"clamp": _clamp, "ema": _ema_eval}


def test_a_data_write_while_gathers_are_in_flight_is_an_error_naming_the_fix() -> None:
    """World 1 with the MXFP8 gather (buckets wait to be landed, as at world 2): a write through
    ``p.data`` has no version counter to see, the values show it. The next step raises."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    config = fxzero.Config(bucket_size=2000, mxfp8_param_gather=True, overlap_param_gather=True)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, config=config, module=model)
    for finish_first in (True, False):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        if finish_first:
            opt.finish_param_sync()
        model[0].weight.data.clamp_(-0.01, 0.01)
        model(torch.randn(5, 4)).sum().backward()
        if finish_first:
            opt.step()
    with pytest.raises(RuntimeError, match=r"written after step\(\) .*through `p\.data`.*Call opt\.finish_param_sync\(\) after step\(\)"):
        opt.step()


# ---- world 2, against DDP + torch.optim -----------------------------------------------------------
def _beside_ddp() -> dict[str, Any]:
    dcgan = _dcgan("fxzero", True, False), _dcgan("ddp", True, False)
    dcgan_keep = _dcgan("fxzero", False, False), _dcgan("ddp", False, False)
    writes = {
        pattern: (_written_through_data(pattern, False), _written_through_data(pattern, True), _written_through_data(pattern, False, kind="ddp"))
        for pattern in _PATTERNS
    }
    return {
        "dcgan": dcgan[0][0] == dcgan[1][0] and _close(dcgan[0][1], dcgan[1][1]),
        "dcgan_keep": dcgan_keep[0][0] == dcgan_keep[1][0] and _close(dcgan_keep[0][1], dcgan_keep[1][1]),
        "a2c": _close(_a2c("fxzero"), _a2c("ddp"), atol=1e-6),
        "no_backward": [
            _close(_stepped_without_backward("fxzero", name, False)[0], _stepped_without_backward("ddp", name, False)[0]) for name in sorted(_OPTIMIZERS)
        ],
        "full_grads": _same_grads(_logged_grads("fxzero"), _logged_grads("ddp")),
        "writes": {p: (isinstance(raised, str) and raised, _close(finished, ddp)) for p, (raised, finished, ddp) in writes.items()},
    }


@pytest.mark.slow
def test_gan_and_rl_loops_and_step_habits_at_world_2_match_ddp() -> None:
    """DCGAN (both ``set_to_none``), A2C compiled under Inductor, a step with no backward after
    ``zero_grad(set_to_none=False)``, ``full_grads()`` against DDP's ``p.grad``, and writes through
    ``p.data`` after ``step()`` with overlap on: an error on every rank without
    ``finish_param_sync()``, DDP's params bit for bit with it."""
    for result in run_ranks(2, _beside_ddp, timeout=300):
        assert result["dcgan"] and result["dcgan_keep"] and result["a2c"], result
        assert result["no_backward"] == [True, True] and result["full_grads"], result
        for pattern, (raised, same) in result["writes"].items():
            assert raised and "opt.finish_param_sync() after step()" in raised, (pattern, raised)
            assert same, pattern
