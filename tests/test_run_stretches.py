"""A run some of whose fragments got no gradient steps stretch by stretch, not fragment by fragment.

fxzero's own Adam steps each run of adjacent fragments as one tensor. When a fragment of the run has
no gradient this step (a frozen layer passed to the optimizer, an adapter or expert not picked), it
keeps its values and its count, and the rest of the run steps as its stretches: adjacent fragments
with a gradient and the same count. Under ``compiled_update`` each stretch takes the compiled update,
where it does not cut an 8-bit block; only the runs holding such a fragment are affected, not the
rest of its param group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxzero
from fxzero.inductor_function import Compiling
from fxzero.optim.update import fused_run
from fxzero.optim.update.moment_store import make_stores

from models import batch, build, forward_kwargs, loss_fn

HYPER = (1e-3, 0.9, 0.999, 1e-8, 0.01, False, True)


def _stored(stores: tuple[Any, Any]) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for store in stores for t in fused_run._parts(store)]


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("fp8", "fp8"), ("fp32", "fp8"), ("bf16", "fp8")], ids="-".join)
def test_a_stretch_steps_with_the_bits_of_a_run_of_its_own_and_the_rest_is_untouched(dtypes: tuple[str, str]) -> None:
    """Cold Inductor compiles (rows and flat graphs of four kinds, 31 s cold on this CPU): slow. Fragments of 64, 32 and 97 elements, the middle one hidden: the two stretches step in place
    with the bits of two runs of their own (the same values in), master and every stored byte; the
    hidden elements' master and moments stay as they were (their 8-bit block is not re-encoded)."""
    n, stretches = 193, [(0, 64), (96, 193)]
    g = torch.Generator().manual_seed(1)
    update, master = fused_run.FusedRunUpdate(Compiling(True, "the test's update")), torch.randn(n, generator=g)
    stores = make_stores(dtypes, n, master.device, paired=True)
    update(master, torch.randn(n, generator=g), *stores, 1, HYPER)  # moments that are not zero
    grad = torch.randn(n, generator=g)
    hidden = [master[64:96].clone()] + [store.export()[64:96].clone() for store in stores]
    for lo, hi in stretches:
        own_master, own = master[lo:hi].clone(), make_stores(dtypes, hi - lo, master.device, paired=True)
        for store, mine in zip(own, stores):
            store.import_(mine.export()[lo:hi])
        assert update.takes(*stores, lo, hi)
        update(master[lo:hi], grad[lo:hi], *stores, 2, HYPER, span=(lo, hi))
        update(own_master, grad[lo:hi].clone(), *own, 2, HYPER)
        assert torch.equal(master[lo:hi].view(torch.int32), own_master.view(torch.int32))
        assert all(torch.equal(a.export(), b.export()[lo:hi]) for a, b in zip(own, stores))
        assert _stored(own)[0].numel() > 0 and not torch.equal(own_master, master[lo:hi] * 0)
    compiles = update.compiles
    for lo, hi in stretches:  # a next step: the stretches' graphs again (views with an offset), no recompile
        update(master[lo:hi], grad[lo:hi], *stores, 3, HYPER, span=(lo, hi))
    assert update.compiles == compiles
    now = [master[64:96]] + [store.export()[64:96] for store in stores]
    assert all(torch.equal(a, b) for a, b in zip(hidden, now))


@pytest.mark.parametrize("start, stop, n", [(0, 64, 193), (96, 193, 193), (5, 64, 193), (0, 70, 193), (32, 96, 96)])
def test_a_stretch_that_cuts_an_8_bit_block_is_not_taken(start: int, stop: int, n: int) -> None:
    stores = make_stores(("bf16", "fp8"), n, torch.device("cpu"), paired=True)
    cut = start % 32 != 0 or (stop % 32 != 0 and stop != n)
    assert fused_run.FusedRunUpdate.takes(*stores, start, stop) is not cut
    assert fused_run.FusedRunUpdate.takes(*make_stores(("bf16", "bf16"), n, torch.device("cpu"), paired=True), start, stop)


def _train(groups: str, spans: list, monkeypatch: pytest.MonkeyPatch, compiled: bool, steps: int = 6) -> list[torch.Tensor]:
    """``mlp_branch`` (its ``extra`` layer gets a gradient on every third step) with bf16 moments, the
    update compiled (the default): one param group, or ``extra`` in a group of its own."""
    call = fused_run.FusedRunUpdate.__call__

    def spy(self: Any, *args: Any, span: Any = None) -> bool:
        spans.append(span)
        return call(self, *args, span=span)

    monkeypatch.setattr(fused_run.FusedRunUpdate, "__call__", spy)
    model = build("mlp_branch")
    extra = set(map(id, model.extra.parameters()))
    params = [p for p in model.parameters() if id(p) not in extra] + list(model.extra.parameters())
    split = [{"params": params[: -len(extra)]}, {"params": list(model.extra.parameters())}]
    opt = fxzero.DistributedOptimizer(params if groups == "one" else split, torch.optim.AdamW, lr=1e-2, module=model,
                                      config=fxzero.Config(optimizer_state_dtype="bf16"))  # fmt: skip
    forward = torch.compile(model, backend="fxzero") if compiled else model  # Inductor, the default inner compiler
    for step in range(steps):
        x, y = batch("mlp_branch", step, 8)
        used = forward_kwargs("mlp_branch", step)["use_extra"]
        before = [p.detach().clone() for p in model.extra.parameters()]
        loss_fn("mlp_branch", forward(x, use_extra=used), y).backward()
        opt.step()
        opt.zero_grad()
        assert used or all(torch.equal(a, b) for a, b in zip(before, model.extra.parameters())), step  # hidden: kept
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_a_layer_without_gradient_holds_back_only_its_stretch_and_the_params_are_those_of_a_group_of_its_own(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``extra`` in the one param group: the steps it misses step the rest of its run as stretches under
    the compiled update (no fragment-by-fragment eager update), and every param ends bitwise where it
    ends with ``extra`` in a group of its own (the bf16 update is elementwise: a run's layout changes no bit)."""
    spans: list = []
    one = _train("one", spans, monkeypatch, compiled)
    assert any(span is not None for span in spans)
    spans.clear()
    split = _train("split", spans, monkeypatch, compiled)
    assert all(torch.equal(a, b) for a, b in zip(one, split))


@pytest.mark.parametrize("options", [{}, {"optimizer_state_dtype": "bf16"}, {"param_remainders": True}], ids=["fp32", "bf16-state", "remainders"])
def test_a_step_compares_no_tensor_with_none(options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``None in grads`` calls ``Tensor.__eq__`` on each gradient (a torch op that raises and is caught:
    12 us a param, 0.56 ms a step with 48 params); the step finds the missing gradients by identity."""
    model = build("mlp_branch").to(torch.bfloat16 if options.get("param_remainders") else torch.float32)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model, config=fxzero.Config(**options))
    x, y = batch("mlp_branch", 0, 8)

    def step() -> None:
        loss_fn("mlp_branch", model(x.to(next(model.parameters()).dtype), use_extra=True).float(), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    calls: list[Any] = []
    eq = torch.Tensor.__eq__

    def counting(self: torch.Tensor, other: Any) -> Any:
        calls.append(other)
        return eq(self, other)

    monkeypatch.setattr(torch.Tensor, "__eq__", counting)
    step()
    assert calls == []
