"""The bit operations of :mod:`.bf16_rounding` on two elements per word, so that Inductor vectorizes all of them.

Inductor's CPU code generator vectorizes a loop only when every dtype in it is one it has vectors
for: int16 is not one, so a loop that loads a remainder or stores a bf16 param's bits as int16
runs element by element, all of it (``tests/test_inductor_cpu_code.py``). Bit casts between float
and int are written as scalar loops too, though those cost little (``benchmarks/update_limits.py``).
Measured on this project's CPU (5.24M elements, one thread, ``benchmarks/update.py``'s machine):
joining param and remainder took 3.4 ms, splitting a master 3.1 ms (a loop and a narrowing ``copy_``),
rounding stochastically 5.1 ms, where a bf16 ``copy_`` of the same elements takes 1.6-2.2 ms.

So these functions see the same memory as words, through views made outside the graph: the fp32
masters as int64 words (elements ``2i`` and ``2i + 1`` in the low and high 32 bits), the bf16
params and int16 remainders as int32 words (the two elements in the low and high 16 bits). Every
load, store and operation is then on int32 or int64 vectors, nothing is converted to float, and the
results are the eager ops' bits exactly (``tests/test_rounding_kernels.py``), NaN payloads included:
join 2.5 ms, split 2.4 ms, stochastic rounding 2.1 ms on the same elements (copying the fp32 master
alone takes 1.8 ms). The check that a bf16 param still holds its master's rounding (``param_watch``'s,
each step) reads both once and writes nothing.

The word views need what :func:`words` checks: 1-D contiguous tensors of one even length at even
offsets, on a little-endian machine. Anything else takes the element loops of
:mod:`.rounding_kernels`, with the same bits.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from .bf16_rounding import hash16, nearest_even_bits

__all__ = ["differs_half_away", "differs_nearest_even", "differs_stochastic", "join", "round_half_away", "round_stochastic", "split", "words"]

_HALF = 0x8000
_HIGH = -65536  # 0xFFFF0000 as an int32
_LOW16 = 0xFFFF
_LOW32 = 0xFFFFFFFF
_MIN_WORDS = 2
"""Fewer elements than this many words take the element loops: Dynamo specializes sizes 0 and 1,
and a graph per tiny size is not worth it."""


def words(master: torch.Tensor, *halves: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
    """fp32 ``master`` as int64 words and each bf16 or int16 tensor of ``halves`` as int32 words, or ``None``
    where the views cannot pair the same elements (odd length or offset, not contiguous, big-endian) or
    the dtypes are not those (the word loops assume them)."""
    n = master.numel()
    tensors = (master, *halves)
    if sys.byteorder != "little" or n % 2 or n < 2 * _MIN_WORDS:
        return None
    if master.dtype != torch.float32 or any(h.dtype not in (torch.bfloat16, torch.int16) for h in halves):
        return None
    if any(t.dim() != 1 or t.numel() != n or t.stride(0) != 1 or t.storage_offset() % 2 for t in tensors):
        return None
    return (master.view(torch.int64), *(h.view(torch.int32) for h in halves))


def _elements(master_words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 bit patterns of the even and the odd elements (the low 32 bits wrap into an int32)."""
    return master_words.to(torch.int32), (master_words >> 32).to(torch.int32)


def _pack(even_high: torch.Tensor, odd_high: torch.Tensor) -> torch.Tensor:
    """bf16 words from the two elements' rounded bits, each ``(bits + add) & 0xFFFF0000``."""
    return ((even_high >> 16) & _LOW16) | odd_high


def _rounded(master_words: torch.Tensor, stochastic: bool) -> torch.Tensor:
    even, odd = _elements(master_words)
    add_even, add_odd = (hash16(even), hash16(odd)) if stochastic else (_HALF, _HALF)
    return _pack((even + add_even) & _HIGH, (odd + add_odd) & _HIGH)


def round_stochastic(master_words: torch.Tensor, param_words: torch.Tensor) -> None:
    """:func:`~.bf16_rounding.round_into` ``"stochastic"`` on words."""
    param_words.copy_(_rounded(master_words, stochastic=True))


def round_half_away(master_words: torch.Tensor, param_words: torch.Tensor) -> None:
    """:func:`~.bf16_rounding.round_into` ``"half_away"`` on words."""
    param_words.copy_(_rounded(master_words, stochastic=False))


def differs_stochastic(master_words: torch.Tensor, param_words: torch.Tensor) -> torch.Tensor:
    """Whether any param differs from its master's stochastic rounding (nothing written)."""
    return torch.ne(_rounded(master_words, stochastic=True), param_words).any()


def differs_half_away(master_words: torch.Tensor, param_words: torch.Tensor) -> torch.Tensor:
    """Whether any param differs from its master's half-away rounding (nothing written)."""
    return torch.ne(_rounded(master_words, stochastic=False), param_words).any()


def differs_nearest_even(master_words: torch.Tensor, param_words: torch.Tensor) -> torch.Tensor:
    """Whether any param differs from ``copy_``'s rounding of its master (nothing written). A NaN
    master's param is any NaN: ``copy_`` writes 0xFFFF in its vector loop and 0x7FC0 in its scalar one."""
    even, odd = _elements(master_words)
    differ = _pack(nearest_even_bits(even), nearest_even_bits(odd)) ^ param_words
    nan_even = ((even & 0x7FFFFFFF) > 0x7F800000) & ((param_words & 0x7FFF) > 0x7F80)
    nan_odd = ((odd & 0x7FFFFFFF) > 0x7F800000) & (((param_words >> 16) & 0x7FFF) > 0x7F80)
    return ((((differ & _LOW16) != 0) & ~nan_even) | (((differ >> 16) != 0) & ~nan_odd)).any()


def split(master_words: torch.Tensor, param_words: torch.Tensor, remainder_words: torch.Tensor) -> None:
    """:func:`~.bf16_rounding.split` on words: half-away params and the signed remainders. In int64
    lanes, narrowed to int32 words at the end (a carry past bit 31 is masked or narrowed away, as int32
    arithmetic wraps it): 2.4 ms per 5.24M elements against 3.4 ms in int32 lanes."""
    even = master_words & _LOW32
    even_high = (even + _HALF) & 0xFFFF0000
    odd = master_words >> 32  # sign-extended
    odd_high = (odd + _HALF) & _HIGH
    param_words.copy_(((even_high >> 16) | odd_high).to(torch.int32))
    remainder_words.copy_((((even - even_high) & _LOW16) | ((odd - odd_high) << 16)).to(torch.int32))


def join(param_words: torch.Tensor, remainder_words: torch.Tensor, master_words: torch.Tensor) -> None:
    """:func:`~.bf16_rounding.join` on words: each master's bits are its param's shifted left by 16 plus
    its remainder, sign-extended. In int64 lanes (an arithmetic shift right extends the sign; bits
    shifted past either end fall away): 2.5 ms per 5.24M elements against 3.0 ms in int32 lanes packed
    into int64 words at the end."""
    params, remainders = param_words.to(torch.int64), remainder_words.to(torch.int64)
    even = ((params << 16) + ((remainders << 48) >> 48)) & _LOW32
    odd = ((params & 0xFFFF0000) + (remainders >> 16)) << 32
    master_words.copy_(even | odd)
