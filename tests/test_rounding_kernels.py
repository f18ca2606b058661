"""The compiled bit operations (``Config.compiled_update``, on by default) give the eager ones' bits, element for element.

Integer arithmetic has one answer, so Inductor's loop must give exactly what the eager chain of
torch ops gives: for every kind of fp32 value (zeros of both signs, denormals, the largest
finite values, infinities, values next to a rounding tie and ties themselves) and for runs whose
length is not a multiple of the vector width. Then a run with the compiled loops trains bitwise
like the same run with the eager ops, for remainders (bitwise the half-away fp32-master run) and for
half-away and stochastic rounding; where Inductor cannot compile, the default falls back to those ops.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxzero
from fxzero import inductor_function
from fxzero.optim.params import bf16_rounding, paired_words
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


@pytest.mark.parametrize("n, offset", [(1, 0), (15, 0), (17, 0), (4099, 0), (4099, 1), (4099, 2), (4099, 3)])
def test_compiled_rounding_split_and_join_give_the_eager_bits(n: int, offset: int) -> None:
    """Both loops: ``_masters(4099)`` has an even length (so offsets 0 and 2 take the word loops of
    :mod:`~fxzero.optim.params.paired_words`), ``_masters(n)[1:]`` an odd one (the element loops)."""
    masters = _masters(n)[offset:]
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
    into = torch.full(masters.shape, 7.0)
    assert COMPILED.join(param, remainder, into) is into and torch.equal(into.view(torch.int32), masters.view(torch.int32))
    assert torch.equal(joined.view(torch.int32), bf16_rounding.join(param, remainder).view(torch.int32))


@pytest.mark.parametrize("n, offset", [(1, 0), (17, 0), (4099, 0), (4099, 2)])
@pytest.mark.parametrize("rounding", ["stochastic", "half_away", "nearest_even"])
def test_the_compiled_watch_check_finds_every_changed_param_even_the_other_neighbour(n: int, offset: int, rounding: str) -> None:
    """``holds_rounding`` answers whether a bf16 param is its master's rounding without writing: any
    changed element is found, also a param set to the other of the two bf16 values the master lies
    between (which a check of the neighbours alone would miss). Even lengths take the word loops,
    odd ones the element loop (stochastic) or none (the caller rounds and compares)."""
    masters = _masters(n)[offset:]
    param = torch.empty(masters.shape, dtype=torch.bfloat16)
    EAGER.round_into(masters, param, rounding)
    words = paired_words.words(masters, param) is not None
    if not words and rounding != "stochastic":
        assert COMPILED.holds_rounding(masters, param, rounding) is None
        return
    assert COMPILED.holds_rounding(masters, param, rounding) is True
    assert EAGER.holds_rounding(masters, param, rounding) is None
    for at in {0, 1, masters.numel() // 2, masters.numel() - 1}:
        other = param.clone()
        other.view(torch.int16)[at] ^= 1  # the last bit flipped: the other neighbour, or the code past it
        assert COMPILED.holds_rounding(masters, other, rounding) is False, at
        other = param.clone()
        other.view(torch.int16)[at] ^= -32768  # the sign flipped
        assert COMPILED.holds_rounding(masters, other, rounding) is False, at


def test_the_nearest_even_check_takes_any_nan_for_a_nan_master_and_nothing_else() -> None:
    """``copy_`` writes a NaN master as 0xFFFF in its vector loop and 0x7FC0 in its scalar one, so the
    word check holds any NaN param for a NaN master, and finds a NaN where the master is a number."""
    masters = torch.tensor([float("nan"), 1.0, -float("nan"), 2.5, float("inf"), 3.4e38, -0.0, 1e-40])
    param = masters.to(torch.bfloat16)
    assert COMPILED.holds_rounding(masters, param, "nearest_even") is True
    param.view(torch.int16)[0] = 0x7FC0
    param.view(torch.int16)[2] = -1
    assert COMPILED.holds_rounding(masters, param, "nearest_even") is True
    for at in (1, 4, 5, 6, 7):
        other = param.clone()
        other[at] = float("nan")
        assert COMPILED.holds_rounding(masters, other, "nearest_even") is False, at
    other = param.clone()
    other[0] = 1.0  # a number where the master is NaN
    assert COMPILED.holds_rounding(masters, other, "nearest_even") is False


def test_the_word_loops_pair_the_same_elements_or_decline() -> None:
    """Word views exist exactly where both sides pair elements ``2i`` and ``2i + 1`` of each tensor."""
    master, param = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    assert paired_words.words(master, param) is not None and paired_words.words(master[2:], param[2:]) is not None
    assert paired_words.words(master[1:], param[1:]) is None  # odd offset and length
    assert paired_words.words(master[1:-1], param[1:-1]) is None  # even length, odd offset
    assert paired_words.words(master[:-1], param[:-1]) is None  # odd length
    assert paired_words.words(master[:2], param[:2]) is None  # one word: Dynamo would specialize it
    assert paired_words.words(master[::2], param[::2]) is None  # not contiguous
    assert paired_words.words(master, param[:32]) is None  # not the same length
    assert paired_words.words(master.double(), param) is None and paired_words.words(master, param.half()) is None  # other dtypes
    assert paired_words.words(master, torch.zeros(64, dtype=torch.int16)) is not None  # remainders


def test_the_word_loops_keep_nan_payloads_as_the_eager_ops_do() -> None:
    """The element loops' one difference from the eager ops (a bf16 conversion makes NaNs canonical)
    is not the word loops': they convert nothing."""
    nans = torch.tensor([0x7FC12345, 0x7F812345, -0x00800001, 0x7FFFFFFF, 0x7FFF8000, -1, 0x7FA0FFFF, 0x3F800000], dtype=torch.int32)
    masters = nans.view(torch.float32)
    for rounding in ("half_away", "stochastic"):
        eager, compiled = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
        EAGER.round_into(masters, eager, rounding)
        COMPILED.round_into(masters, compiled, rounding)
        assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16)), rounding
    param, remainder = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.int16)
    COMPILED.split_consuming(masters.clone(), param, remainder)
    assert torch.equal(COMPILED.join(param, remainder).view(torch.int32), nans)


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


def _no_compiler(fn: Any, graphs: int) -> Any:
    raise RuntimeError("no C++ compiler here")


@pytest.mark.parametrize("options", [{"param_remainders": True}, {"param_rounding": "stochastic"}, {"param_rounding": "half_away"}],
                         ids=["remainders", "stochastic", "half_away"])  # fmt: skip
def test_a_run_with_the_compiled_bit_operations_trains_bitwise_like_the_eager_one(options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``mlp_branch`` leaves a param without gradient in some steps (its run then steps as stretches).
    Four runs: ``compiled_update=True``; the default (``None``: compiled); ``False`` (the eager ops); and the
    default with every compile failing (the fallback of a machine without a C++ compiler)."""
    compiled = _run("mlp_branch", {**options, "compiled_update": True})
    default = _run("mlp_branch", options)
    eager = _run("mlp_branch", {**options, "compiled_update": False})
    monkeypatch.setattr(inductor_function, "shared", _no_compiler)
    fallback = _run("mlp_branch", options)
    for run in (default, eager, fallback):
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(run, compiled))
