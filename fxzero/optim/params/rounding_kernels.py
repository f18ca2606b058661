"""The bit operations of :mod:`.bf16_rounding`, eager or Inductor-compiled, with the same bits.

Rounding fp32 masters into bf16 params (``"half_away"``, ``"stochastic"``), splitting them into
param and remainder and joining them again are integer arithmetic on the masters' bit patterns.
Eagerly each is a chain of up to nine torch ops, a pass over memory each: stochastic rounding
cost 2.5x a whole fp32 AdamW step (``benchmarks/update.py``). Integer arithmetic has one
answer, so Inductor's single loop gives the eager chain's bits exactly (checked element for
element in ``tests/test_rounding_kernels.py``, hash included), and the step uses these.

**Compiled by default.** ``Config.compiled_update=None`` (the default) compiles these loops too: they give
the eager ops' bits, so compiling them changes no number, and eagerly stochastic rounding cost 3.6x a
nearest-even step (its hash is seven ops, run twice: to round, and to check that the params still
hold the rounding; ``benchmarks/update.py``, 2026-11-29). The compiles (seconds) fall in the first
``step()``. Where Inductor cannot build them (no C++ compiler), the first failure is logged as a
warning and the step runs the eager ops from then on (the same bits, at their cost:
:class:`~fxzero.inductor_function.Compiling`); under ``compiled_update=True`` a failure raises, and
``compiled_update=False`` runs the eager ops throughout.

**How the loops stay vectorized.** Inductor's CPU code generator vectorizes a loop only if it has
vectors for every dtype in it (not int16: ``tests/test_inductor_cpu_code.py``).
So where the memory allows (:func:`~.paired_words.words`: even lengths and offsets, the common
case), the loops see two elements per word (:mod:`.paired_words`): int64 words of fp32 masters,
int32 words of bf16 params and int16 remainders, all of it int32 and int64 arithmetic, 1.3x to 3x
faster. The element loops here serve the rest: the masters come in as int32 views (the cast is a
view made outside the graph), and a bf16 param is written as the fp32 value whose low 16 bits are
zero (``bits & 0xFFFF0000``): converting it to bf16 is exact, and vectorized. Their remainders are
narrowed to int16 by ``copy_`` after the loop, and their half-away rounding is eager (two ops and
a narrowing copy, faster than Inductor's element loop).

The element loops differ from the eager ops only on NaN masters whose payload lies in the high 16
bits (bf16 conversion makes them the canonical NaN; the eager shift keeps the payload): a NaN param
either way. The word loops convert nothing and keep every payload.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...inductor_function import Compiling
from . import bf16_rounding, paired_words
from .bf16_rounding import Rounding

__all__ = ["RoundingKernels", "join_into", "join_values", "round_bits", "rounding_differs", "split_in_place"]

_HALF = 0x8000
_HIGH = -65536  # 0xFFFF0000 as an int32


def round_bits(bits: torch.Tensor, out: torch.Tensor) -> None:
    """Stochastic ``round_into`` on the masters' bits (an int32 view), into bf16 ``out``."""
    out.copy_(torch.add(bits, bf16_rounding.hash16(bits)).bitwise_and_(_HIGH).view(torch.float32))


def rounding_differs(bits: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Whether any bf16 ``param`` differs from the stochastic rounding of its master (``bits``, an int32
    view), compared as bit patterns (the param's fp32 value is its bits shifted left by 16); nothing written."""
    expected = torch.add(bits, bf16_rounding.hash16(bits)).bitwise_and_(_HIGH)
    return torch.ne(expected, param.float().view(torch.int32)).any()


def split_in_place(bits: torch.Tensor, param: torch.Tensor) -> None:
    """``split`` whose remainders stay in ``bits`` (the masters' int32 view, overwritten) as int32 values:
    every load and store of the loop is 32-bit or the bf16 param, so all of it is vectorized."""
    high = torch.add(bits, _HALF).bitwise_and_(_HIGH)
    param.copy_(high.view(torch.float32))
    bits.sub_(high)


def join_values(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """``join`` without a bit cast of a bf16 param: its fp32 value's bits are the param's shifted left by 16."""
    return (param.float().view(torch.int32) + remainder.to(torch.int32)).view(torch.float32)


def join_into(param: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`join_values` written into ``out``."""
    out.copy_(join_values(param, remainder))


_WORD_ROUNDS = {"half_away": paired_words.round_half_away, "stochastic": paired_words.round_stochastic}
"""Each rounding's word loop (nearest even stays ``copy_``)."""

_DIFFERS = {"nearest_even": paired_words.differs_nearest_even, "half_away": paired_words.differs_half_away,
            "stochastic": paired_words.differs_stochastic}
"""Each rounding's word loop that tells whether params still hold their masters' rounding."""

_GRAPHS = 8
"""Graphs per function at most: one per rounding and kinds of input (contiguous or not)."""


class RoundingKernels:
    """:func:`~.bf16_rounding.round_into`, :func:`~.bf16_rounding.split` and :func:`~.bf16_rounding.join`,
    eager or as one Inductor-generated loop each, with the same bits. ``compiled``: ``Config.compiled_update``
    (``None`` compiles, falling back to the eager ops where Inductor fails; ``False`` is the tests' eager reference)."""

    def __init__(self, compiled: Optional[bool]) -> None:
        self.compiling = Compiling(compiled, "bf16 rounding's bit loops")

    def _call(self, fn: Callable[..., Any], *args: torch.Tensor) -> tuple[bool, Any]:
        """``(True, fn(*args))`` compiled; ``(False, None)``: the caller runs the eager ops (the same bits)."""
        return self.compiling.call(fn, _GRAPHS, *args)

    def round_into(self, master: torch.Tensor, out: torch.Tensor, rounding: Rounding) -> None:
        """Write fp32 ``master`` into the bf16 tensor ``out`` with ``rounding``."""
        if rounding != "nearest_even" and self.compiling.active:
            paired = paired_words.words(master, out)
            if paired is not None:
                if self._call(_WORD_ROUNDS[rounding], *paired)[0]:
                    return
            elif rounding == "stochastic" and self._call(round_bits, master.view(torch.int32), out)[0]:
                return
        # nearest even is one copy_ already; half away on elements is two eager ops and a narrowing copy_,
        # faster than Inductor's element loop on this CPU (5.24M elements, one thread: 3.2 ms against
        # 4.6 ms; benchmarks/results/update-2026-11-28.md, part 4), with the same bits
        bf16_rounding.round_into(master, out, rounding)

    def holds_rounding(self, master: torch.Tensor, param: torch.Tensor, rounding: Rounding) -> Optional[bool]:
        """Whether bf16 ``param`` is exactly ``master`` rounded with ``rounding``, in one compiled loop that
        writes nothing (rounding into a scratch, then comparing, reads and writes the scratch besides): a
        word loop for every rounding (a NaN master's param may be any NaN under nearest even), the element
        loop for stochastic rounding (its hash is the costly part); ``None`` otherwise (the caller rounds
        and compares)."""
        if not self.compiling.active:
            return None
        paired = paired_words.words(master, param)
        if paired is not None:
            done, differs = self._call(_DIFFERS[rounding], *paired)
        elif rounding == "stochastic":
            done, differs = self._call(rounding_differs, master.view(torch.int32), param)
        else:
            return None
        return not bool(differs) if done else None

    def split_consuming(self, master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
        """fp32 ``master`` -> bf16 ``param`` (half away) and int16 ``remainder``, with ``master``'s memory
        as scratch: its values are lost (the step's rebuilt master, no longer read). Compiled: one word loop
        (2.4 ms per 5.24M elements, one thread), or where the words cannot pair elements, an element loop
        whose remainders go through ``master`` as int32 and are then narrowed by ``copy_`` (the loop's int16
        store is scalar; the two passes together take half its time: 2.9-3.1 ms against 6.1 ms; the same bits)."""
        paired = paired_words.words(master, param, remainder) if self.compiling.active else None
        if paired is not None:
            if self._call(paired_words.split, *paired)[0]:
                return
        elif self.compiling.active and self._call(split_in_place, master.view(torch.int32), param)[0]:
            remainder.copy_(master.view(torch.int32))
            return
        bf16_rounding.split(master, param, remainder)

    def join(self, param: torch.Tensor, remainder: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fp32 master ``param`` and ``remainder`` stand for, written into ``out`` (or a new tensor)."""
        if not self.compiling.active:
            return bf16_rounding.join(param, remainder, out)
        target = torch.empty(param.shape, dtype=torch.float32, device=param.device) if out is None else out
        paired = paired_words.words(target, param, remainder)
        if paired is not None:
            master_words, param_words, remainder_words = paired
            done = self._call(paired_words.join, param_words, remainder_words, master_words)[0]
        else:
            done = self._call(join_into, param, remainder, target)[0]
        return target if done else bf16_rounding.join(param, remainder, target)
