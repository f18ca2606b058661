"""How an fp32 master becomes a bf16 param, and how a 16-bit remainder rebuilds it exactly.

Three roundings (``Config.param_rounding``):

* ``"nearest_even"``: torch's ``copy_`` (IEEE round to nearest, ties to even); the default
  with fp32 masters.
* ``"half_away"``: round to nearest, ties away from zero, done on the bit pattern: the high
  16 bits of ``bits + 0x8000``. It differs from ``nearest_even`` only when the low 16 bits are
  exactly ``0x8000``. Why it exists: with it, the low 16 bits become a *signed* 16-bit
  remainder in ``[-32768, 32767]`` that rebuilds the fp32 master exactly from the bf16 param
  (:func:`split` / :func:`join`, Megatron-LM's ``store_param_remainders``). Round to nearest
  even cannot: an even bf16 value is the rounding of 65537 fp32 values (both ties included),
  one more than 16 bits can tell apart. So ``Config.param_remainders`` rounds this way, and
  an fp32-master run that rounds this way too trains bitwise like it.
* ``"stochastic"``: rounds up with probability (low 16 bits) / 2^16, so the bf16 params follow
  the fp32 masters in expectation. The random 16 bits are a hash of the master's own 32 bits,
  not a generator's draw: the same master always gives the same param, so a run, a resume
  from a checkpoint and every rank give the same bits, with no generator state to save.

All three work on magnitudes: a negative value rounds as its absolute value would.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

__all__ = ["ROUNDINGS", "Rounding", "hash16", "join", "nearest_even_bits", "round_into", "split"]

Rounding = Literal["nearest_even", "half_away", "stochastic"]
ROUNDINGS = ("nearest_even", "half_away", "stochastic")

_HALF = 0x8000
_GOLDEN = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / phi)


def round_into(master: torch.Tensor, out: torch.Tensor, rounding: Rounding) -> None:
    """Write fp32 ``master`` into the bf16 tensor ``out`` (same shape) with ``rounding``."""
    if rounding == "nearest_even":
        out.copy_(master)
        return
    bits = master.view(torch.int32)
    add = _HALF if rounding == "half_away" else hash16(bits)
    out.view(torch.int16).copy_(torch.add(bits, add).bitwise_right_shift_(16))


def split(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """fp32 ``master`` -> bf16 ``param`` (rounded ``"half_away"``) and int16 ``remainder``,
    with ``join(param, remainder) == master`` bitwise."""
    bits = master.view(torch.int32)
    high = torch.add(bits, _HALF).bitwise_right_shift_(16)
    param.view(torch.int16).copy_(high)
    remainder.copy_(bits - high.bitwise_left_shift_(16))


def join(param: torch.Tensor, remainder: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 master that ``param`` (bf16) and ``remainder`` (int16) stand for: written into ``out``
    (fp32, the same shape: the step's scratch, so the update allocates nothing) or a new tensor."""
    if out is None:
        high = param.view(torch.int16).to(torch.int32)
    else:
        high = out.view(torch.int32)
        high.copy_(param.view(torch.int16))
    return high.bitwise_left_shift_(16).add_(remainder).view(torch.float32)


def nearest_even_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (int32, or int64 lanes whose low 32 bits are one) rounded to bf16 to nearest
    even, as bits with the low half zero: c10's ``round_to_nearest_even``, what ``copy_`` into bf16
    does to a finite or infinite value, in integer arithmetic (compiled loops have no bf16 to round to
    without a masked half-vector)."""
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536


def hash16(bits: torch.Tensor) -> torch.Tensor:
    """16 pseudo-random bits per element, a function of its 32 bits. int32 arithmetic that wraps as
    unsigned 32-bit arithmetic does (a product's low 32 bits do not depend on the sign; the shift is
    made logical by its mask): the same bits as the int64 form, at half its bytes and a third of its ops."""
    wide = bits.mul(_GOLDEN - (1 << 32))
    wide.bitwise_xor_(wide.bitwise_right_shift(15).bitwise_and_(0x1FFFF)).mul_(0x2C1B3C6D)
    return wide.bitwise_right_shift_(12).bitwise_and_(0xFFFF)


def _hash16_wide(bits: torch.Tensor) -> torch.Tensor:
    """:func:`hash16` in int64 arithmetic, which cannot overflow: its reference (tested equal)."""
    wide = bits.to(torch.int64).bitwise_and_(0xFFFFFFFF)
    wide.mul_(_GOLDEN).bitwise_and_(0xFFFFFFFF)
    wide.bitwise_xor_(wide >> 15).mul_(0x2C1B3C6D).bitwise_and_(0xFFFFFFFF)
    return wide.bitwise_right_shift_(12).bitwise_and_(0xFFFF).to(torch.int32)
