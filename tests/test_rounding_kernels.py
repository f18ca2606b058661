"""The compiled bit operations (``Config.compiled_update``) give the eager ones' bits, element for element.

Integer arithmetic has one answer, so Inductor's loop must give exactly what the eager chain of
torch ops gives: for every kind of fp32 value (zeros of both signs, denormals, the largest
finite values, infinities, values next to a rounding tie and ties themselves) and for runs whose
length is not a multiple of the vector width. Then a run with ``compiled_update`` trains bitwise
like the same run without it, for remainders (bitwise the half-away fp32-master run) and for
stochastic rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxzero
from fxzero.optim.params import bf16_rounding
from fxzero.optim.params.rounding_kernels import RoundingKernels

from models import batch, build, forward_kwargs, loss_fn, param_groups

COMPILED, EAGER = RoundingKernels(compiled=True), RoundingKernels(compiled=False)


def _masters(n: int) -> torch.Tensor:
    """fp32 values of every kind but NaN (the module docstring says why NaN is left out)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    values = bits.view(torch.float32)
    wide = torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-40, 38, generator=g)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38])
    ties = (torch.randint(0, 2**15, (64,), dtype=torch.int32, generator=g) << 16 | 0x8000).view(torch.float32)
    near = ((torch.randint(0, 2**15, (64,), dtype=torch.int32, generator=g) << 16) | 0x7FFF).view(torch.float32)
    every = torch.cat([values, wide, special, ties, -ties, near, -near])
    return every[~every.isnan()]


@pytest.mark.parametrize("n", [1, 15, 17, 4099])
def test_compiled_rounding_split_and_join_give_the_eager_bits(n: int) -> None:
    masters = _masters(n)
    for rounding in ("half_away", "stochastic", "nearest_even"):
        eager, compiled = torch.empty(masters.shape, dtype=torch.bfloat16), torch.empty(masters.shape, dtype=torch.bfloat16)
        EAGER.round_into(masters, eager, rounding)
        COMPILED.round_into(masters, compiled, rounding)
        assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16)), rounding
    param, remainder = torch.empty(masters.shape, dtype=torch.bfloat16), torch.empty(masters.shape, dtype=torch.int16)
    param_c, remainder_c = torch.empty_like(param), torch.empty_like(remainder)
    EAGER.split_consuming(masters.clone(), param, remainder)
    COMPILED.split_consuming(masters.clone(), param_c, remainder_c)  # the remainders pass through the master's memory
    assert torch.equal(param.view(torch.int16), param_c.view(torch.int16)) and torch.equal(remainder, remainder_c)
    joined = COMPILED.join(param, remainder)
    assert torch.equal(joined.view(torch.int32), masters.view(torch.int32))  # the master, exactly
    assert torch.equal(joined.view(torch.int32), bf16_rounding.join(param, remainder).view(torch.int32))


@pytest.mark.parametrize("n", [1, 17, 4099])
def test_the_compiled_watch_check_finds_every_changed_param_even_the_other_neighbour(n: int) -> None:
    """``holds_rounding`` answers whether a bf16 param is its master's stochastic rounding without
    writing: any changed element is found, also a param set to the other of the two bf16 values the
    master lies between (which a check of the neighbours alone would miss)."""
    masters = _masters(n)
    param = torch.empty(masters.shape, dtype=torch.bfloat16)
    EAGER.round_into(masters, param, "stochastic")
    assert COMPILED.holds_rounding(masters, param, "stochastic") is True
    assert COMPILED.holds_rounding(masters, param, "half_away") is None and EAGER.holds_rounding(masters, param, "stochastic") is None
    for at in {0, n // 2, n - 1}:
        other = param.clone()
        other.view(torch.int16)[at] ^= 1  # the last bit flipped: the other neighbour, or the code past it
        assert COMPILED.holds_rounding(masters, other, "stochastic") is False, at


def _run(name: str, options: dict[str, Any], steps: int = 4) -> list[torch.Tensor]:
    model = build(name).to(torch.bfloat16)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, module=model,
                                      config=fxzero.Config(bucket_size=2000, **options))  # fmt: skip
    torch.manual_seed(0)
    for step in range(steps):
        x, y = batch(name, step, 8)
        x = x if x.dtype == torch.long else x.to(torch.bfloat16)
        loss_fn(name, model(x, **forward_kwargs(name, step)).float(), y).backward()
        assert not opt.step().skipped
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [{"param_remainders": True}, {"param_rounding": "stochastic"}, {"param_rounding": "half_away"}],
                         ids=["remainders", "stochastic", "half_away"])  # fmt: skip
def test_a_run_with_the_compiled_bit_operations_trains_bitwise_like_the_eager_one(options: dict[str, Any]) -> None:
    """``mlp_branch`` leaves a param without gradient in some steps (its run then steps fragment by fragment)."""
    eager = _run("mlp_branch", options)
    compiled = _run("mlp_branch", {**options, "compiled_update": True})
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(eager, compiled))
