"""``Config.compiled_update``: ``None`` (the default) compiles fxzero's own per-run work and falls back to
the eager ops where Inductor cannot compile; ``True`` requires the compile; ``False`` never compiles.

A machine without a C++ compiler is played by making every compile fail
(:func:`fxzero.inductor_function.shared` raising): the default must then log one warning naming what runs
eagerly and train exactly as ``compiled_update=False`` does, from the first step on; ``True`` must raise.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import pytest
import torch

import fxzero
from fxzero import inductor_function
from fxzero.optim.params.bf16_rounding import round_into
from fxzero.optim.params.rounding_kernels import RoundingKernels

from models import batch, build, forward_kwargs, loss_fn


def _no_compiler(fn: Any, graphs: int) -> Any:
    raise RuntimeError("no C++ compiler here")


def _warnings_of(action: Callable[[], Any]) -> tuple[Any, list[logging.LogRecord]]:
    """``action()`` and the warnings it logs through :mod:`fxzero.inductor_function`'s logger (a handler of
    its own: another test's log setup may stop the ``fxzero`` logger's propagation, which ``caplog`` needs)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(inductor_function.__name__)
    logger.addHandler(handler)
    try:
        return action(), records
    finally:
        logger.removeHandler(handler)


def _train(options: dict[str, Any], steps: int = 4) -> tuple[list[torch.Tensor], fxzero.DistributedOptimizer]:
    """``mlp_branch`` (its ``extra`` layer without a gradient on two steps of three: stretches) in fp32."""
    model = build("mlp_branch")
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model,
                                      config=fxzero.Config(bucket_size=2000, **options))  # fmt: skip
    for step in range(steps):
        x, y = batch("mlp_branch", step, 8)
        loss_fn("mlp_branch", model(x, **forward_kwargs("mlp_branch", step)), y).backward()
        assert not opt.step().skipped
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_narrow_moments_step_compiled_by_default_and_fall_back_to_the_eager_update_with_one_warning(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default steps the moments with the compiled update (bitwise the ``compiled_update=True`` run);
    every compile failing, it logs one warning and steps eagerly from the first step (bitwise the
    ``compiled_update=False`` run); ``True`` then raises."""
    options = {"optimizer_state_dtype": dtype}
    required, _ = _train({**options, "compiled_update": True})
    default, opt = _train(options)
    assert opt.runtime.local.fused.compiling.active and opt.runtime.local.fused.compiles > 0
    assert all(torch.equal(a, b) for a, b in zip(default, required))
    eager, opt = _train({**options, "compiled_update": False})
    assert opt.runtime.local.fused is None
    monkeypatch.setattr(inductor_function, "shared", _no_compiler)
    (fallback, opt), records = _warnings_of(lambda: _train(options))
    assert not opt.runtime.local.fused.compiling.active
    assert all(torch.equal(a, b) for a, b in zip(fallback, eager))
    assert len(records) == 1 and "the narrow moments' Adam update" in records[0].getMessage()
    assert "no C++ compiler here" in records[0].getMessage() and "compiled_update=False" in records[0].getMessage()
    with pytest.raises(RuntimeError, match="no C.. compiler here"):
        _train({**options, "compiled_update": True}, steps=1)


@pytest.mark.parametrize("n", [4098, 4099])
def test_the_bit_loops_are_compiled_by_default_and_fall_back_to_the_eager_bits_with_one_warning(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default stochastic rounding runs its compiled loops (the check that params hold their rounding
    answers in one loop: not ``None``); where the compile fails, one warning, the eager bits, and the eager
    ops from then on. ``True`` raises; ``False`` compiles nothing. Even lengths take the word loops, odd
    ones the element loop."""
    g = torch.Generator().manual_seed(n)
    masters = torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-30, 30, generator=g)
    expected, out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    round_into(masters, expected, "stochastic")
    assert RoundingKernels(compiled=None).holds_rounding(masters, expected, "stochastic") is True
    assert RoundingKernels(compiled=False).holds_rounding(masters, expected, "stochastic") is None  # the caller rounds and compares
    monkeypatch.setattr(inductor_function, "shared", _no_compiler)
    fallback = RoundingKernels(compiled=None)

    def round_and_check() -> None:
        fallback.round_into(masters, out, "stochastic")
        assert fallback.holds_rounding(masters, out, "stochastic") is None and not fallback.compiling.active

    _, records = _warnings_of(round_and_check)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert len(records) == 1 and "no C++ compiler here" in records[0].getMessage()
    with pytest.raises(RuntimeError, match="no C.. compiler here"):
        RoundingKernels(compiled=True).round_into(masters, out, "stochastic")


@pytest.mark.parametrize("value", [1, "auto", 0.0])
def test_a_setting_other_than_none_true_or_false_is_refused_naming_the_flag(value: Any) -> None:
    with pytest.raises(TypeError, match=rf"Config.compiled_update must be None .*, True or False, got {value!r}"):
        fxzero.Config(compiled_update=value)


def test_running_out_of_memory_is_raised_and_not_taken_for_a_missing_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory that runs out is no reason to fall back (the eager ops need memory too): it is raised, and the
    compiled loops stay on for the next call."""

    def out_of_memory(fn: Any, graphs: int) -> Any:
        raise torch.OutOfMemoryError("out of memory here")

    monkeypatch.setattr(inductor_function, "shared", out_of_memory)
    compiling = inductor_function.Compiling(None, "a test's loop")
    with pytest.raises(torch.OutOfMemoryError, match="out of memory here"):
        compiling.call(torch.add, 1, torch.ones(2), torch.ones(2))
    assert compiling.active


def test_a_compiled_step_traces_into_the_compiled_update() -> None:
    """torch's compiled-optimizer recipe, ``torch.compile(opt.step)``, over bf16 moments: Dynamo traces into
    fxzero's own compiled update (its try/except and the compile it holds) and the params stay within the last
    bits of the plain step's (torch's own compiled and plain AdamW steps differ so too); the update's
    compile held: no fallback."""
    models = [build("mlp") for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [fxzero.DistributedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, module=m, config=fxzero.Config(optimizer_state_dtype="bf16"))
            for m in models]  # fmt: skip
    steps = [torch.compile(opts[0].step, backend="aot_eager"), opts[1].step]
    for i in range(3):
        x, y = batch("mlp", i, 8)
        for model, opt, step in zip(models, opts, steps):
            loss_fn("mlp", model(x), y).backward()
            step()
            opt.zero_grad()
    assert opts[0].runtime.local.fused.compiling.active
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("beta2", [0.999, 0.9999, 0.99999])
def test_the_compiled_update_weighs_the_moments_by_the_betas_as_the_eager_update(beta2: float) -> None:
    """``1 - beta2`` is small where ``beta2`` is near 1, and taken in fp32 from an fp32 ``beta2`` it is off
    by up to half of fp32's spacing near 1 (2^-25 absolute): 1.3e-5 relative at 0.999, 1.7e-4 at 0.9999,
    1.4e-3 at 0.99999, in every element of the second moment. torch.optim and the eager update take
    ``1 - beta2``, ``1 - beta1`` and ``1 - lr * weight_decay`` in Python's double. The compiled update over
    fp32 moments (no rounding of the moments in between) must then agree with the eager one to a few ulp."""
    from fxzero.inductor_function import Compiling
    from fxzero.optim.update import fused_run, shard_adam
    from fxzero.optim.update.moment_store import make_stores

    n, hyper = 4096, (1e-3, 0.9, beta2, 1e-8, 0.1, False, True)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    compiled_master = master.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    stores = make_stores(("fp32", "fp32"), n, torch.device("cpu"), paired=True)
    update = fused_run.FusedRunUpdate(Compiling(True, "the test's update"))
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen) * torch.logspace(-3, 0, n)
        shard_adam._adam(master, grad.clone(), m, v, step, hyper)
        assert update(compiled_master, grad, *stores, step, hyper)
    # v is a sum of squares, never near a cancellation: element by element; m and the params against their largest
    assert float(((stores[1].values - v).abs() / v).max()) < 1e-5
    for eager, compiled in ((m, stores[0].values), (master, compiled_master)):
        assert float((compiled - eager).abs().max()) < 1e-5 * float(eager.abs().max())
