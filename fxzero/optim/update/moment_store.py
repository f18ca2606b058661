"""How :class:`~fxzero.optim.update.shard_adam.ShardAdamW` keeps one moment of one run: fp32,
bf16, or 8-bit blocks (``Config.exp_avg_dtype`` / ``Config.exp_avg_sq_dtype``).

Every store :meth:`~MomentStore.load`\\ s fp32 values for the update and :meth:`~MomentStore.save`\\ s
them back: the update itself always computes in fp32 (as Megatron-LM's precision-aware
optimizer does, and torchao's low-bit AdamW), and only what is kept between steps is narrower.
Each run of the shard is cut into blocks of 32 elements from its own start, so no block spans
two ranks' shards (a run lies in one rank's shard).

**The first moment in 8 bits** (:class:`BlockStore`): 32 ``float8_e4m3fn`` codes (round to
nearest) and one int8 exponent ``e`` per block, the scale ``2^e`` the smallest power of two that
puts the block's largest magnitude at or below 448 (nothing is clipped). 1 + 1/32 bytes per element.

**The second moment in 8 bits** (:class:`RootStore`) is kept as its square root ``r``, which
halves its range in octaves, in an unsigned 8-bit float of our own: ``r`` is never negative, so
E4M3's sign bit becomes a fourth mantissa bit (relative error at most 2^-5, as E4M3 on ``v``
itself, over 16 octaves of ``r``: 32 of ``v``, gradients spanning ~5 decades in one block).
Each block has one bf16 scale, its largest root / 1.875 (the largest code) rounded to nearest,
so the largest root is kept to bf16's precision (the largest code, clamped: never above it). Why not a power of two, as the first moment:
``v`` grows by ``1 - beta2`` (0.1%) of ``g^2`` a step, far below half a code, so a code on a
fixed grid stops growing while the bias correction keeps shrinking ``v``'s divisor, and the
steps grow (the first version of this codec, rounding roots up, froze them instead; drift 10x
torchao's). A scale that follows the block's largest value carries the whole block's growth,
as torchao's fp32 block scales do (``benchmarks/update.py`` measures the drift of each). Roots
too small for the block's codes keep the smallest one (never zero): quantization cannot make a
denominator vanish and blow an update up, whatever the gradients span. 1 + 2/32 bytes per element.

**Both moments in bf16, compiled** (:class:`PairHalf`, with ``Config.compiled_update``): one int32
word per element holds the first moment's bf16 bits in its high half and the second's in its low
half. The compiled update (:mod:`~fxzero.optim.update.fused_run`) then reads and writes both moments
with integer arithmetic on one word: Inductor steps a loop that writes the fp32 master in place 16
lanes at a time, so it would read and write two bf16 tensors in masked half-vectors
(``tests/test_inductor_cpu_code.py``; they took 1.7x the packed word's time over 5.24M elements,
``benchmarks/results/update_limits-2026-11-29.md``), while ``bits & 0xFFFF0000`` is already the fp32 value of
a bf16 one and the rounding to nearest even is three integer ops. Same bytes (2 per moment and
element), same values (rounded to nearest even, as ``copy_`` into bf16 does).

**Checkpoints**: both decode to exact fp32 values that encode back to the same codes and scales
(a code times a power of two or a bf16 scale is exact in fp32, and ``sqrt(r*r) == r`` in IEEE
arithmetic), so a checkpoint of decoded values resumes bitwise (:meth:`export` / :meth:`import_`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..params.bf16_rounding import nearest_even_bits

__all__ = ["BLOCK", "HIGH_HALF", "MomentStore", "PairHalf", "STATE_DTYPES", "make_stores", "moment_nbytes", "nearest_bf16_bits"]

BLOCK = 32
STATE_DTYPES = ("fp32", "bf16", "fp8")
_E4M3_MAX = 448.0
_ROOT_MAX = 1.875
"""The largest root code's value (before the block scale): 2^0 * (1 + 14/16)."""
_ROOT_BASE = ((127 - 15) << 23) - (1 << 19)
"""fp32 bits of code 0's place: code ``c >= 1`` is the fp32 ``2^-15 * (1 + (c - 1) / 16)`` for
``c <= 16`` and so on up by octaves: its bits are ``_ROOT_BASE + (c << 19)``."""


class MomentStore(Protocol):
    """One moment of one run (``numel`` elements)."""

    nbytes: int

    def load(self) -> torch.Tensor:
        """The values in fp32 (the stored tensor itself where it is fp32: updated in place)."""

    def save(self, values: torch.Tensor) -> None:
        """Keep ``values`` (what :meth:`load` returned, updated)."""

    def export(self) -> torch.Tensor:
        """The kept values, exactly, in a plain dtype (a view where they are kept plainly)."""

    def import_(self, values: torch.Tensor) -> None:
        """Keep ``values`` (any float dtype), rounded as :meth:`save` rounds."""


class PlainStore:
    """fp32 or bf16 elements."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.values = torch.zeros(numel, dtype=dtype, device=device)
        self.nbytes = self.values.nbytes

    def load(self) -> torch.Tensor:
        return self.values if self.values.dtype == torch.float32 else self.values.float()

    def save(self, values: torch.Tensor) -> None:
        if values is not self.values:
            self.values.copy_(values)

    def export(self) -> torch.Tensor:
        return self.values

    def import_(self, values: torch.Tensor) -> None:
        self.values.copy_(values.reshape(-1))


class _Blocks:
    """Codes padded to whole blocks, and the plumbing every 8-bit store shares."""

    def __init__(self, numel: int, device: torch.device, scale_dtype: torch.dtype, code_dtype: torch.dtype) -> None:
        self.numel = numel
        blocks = -(-numel // BLOCK)
        self.codes = torch.zeros(blocks * BLOCK, dtype=code_dtype, device=device)
        self.scales = torch.zeros(blocks, dtype=scale_dtype, device=device)
        self.nbytes = self.codes.nbytes + self.scales.nbytes

    def load(self) -> torch.Tensor:
        return self.decode(self.codes.view(-1, BLOCK), self.scales).view(-1)[: self.numel]

    def save(self, values: torch.Tensor) -> None:
        padded = torch.zeros(self.codes.numel(), dtype=torch.float32, device=values.device)
        padded[: self.numel] = values.reshape(-1)
        self.encode(padded.view(-1, BLOCK), self.codes.view(-1, BLOCK), self.scales)

    def export(self) -> torch.Tensor:
        return self.load()

    def import_(self, values: torch.Tensor) -> None:
        self.save(values.to(torch.float32))


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int32, in [-127, 127]) in fp32, exactly, built from its bits: ``torch.exp2``
    and ``torch.frexp`` are libm calls per element in Inductor's CPU loops, which recompute a block's
    scale for each of its elements (they made the compiled fp8 update 8 ns an element)."""
    bits = torch.where(exponent > -127, (exponent + 127) << 23, 1 << 22)  # 2^-127 is subnormal
    return bits.to(torch.int32).view(torch.float32)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` of fp32 ``x >= 0`` as int32 (0 for 0, at most -127 below 2^-127), from its bits."""
    bits = x.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    normal = biased - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    subnormal = torch.where(x <= 2.0**-127, -127, -126)
    return torch.where(x == 0, 0, torch.where(biased == 0, subnormal, normal)).to(torch.int32)


class BlockStore(_Blocks):
    """The first moment: E4M3 codes in blocks of :data:`BLOCK`, one power-of-two scale per block."""

    def __init__(self, numel: int, device: torch.device) -> None:
        super().__init__(numel, device, torch.int8, torch.float8_e4m3fn)

    @staticmethod
    def decode(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.float32) * _power_of_two(exponents.to(torch.int32)).unsqueeze(1)

    @staticmethod
    def encode(blocks: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor) -> None:
        exponent = _ceil_log2(blocks.abs().amax(dim=1) / _E4M3_MAX).clamp(-127, 127)
        exponents.copy_(exponent)
        codes.copy_((blocks * _power_of_two(-exponent).unsqueeze(1)).clamp(-_E4M3_MAX, _E4M3_MAX))  # exact: a power of two


class RootStore(_Blocks):
    """The second moment: unsigned 8-bit codes of its root in blocks of :data:`BLOCK`, one bf16 scale each."""

    def __init__(self, numel: int, device: torch.device) -> None:
        super().__init__(numel, device, torch.bfloat16, torch.uint8)

    @staticmethod
    def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        wide = codes.to(torch.int32)
        roots = torch.where(wide > 0, wide.bitwise_left_shift(19) + _ROOT_BASE, 0).view(torch.float32)
        return (roots * scales.to(torch.float32).unsqueeze(1)).square()

    @staticmethod
    def encode(blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        roots = blocks.sqrt()
        wanted = roots.amax(dim=1) / _ROOT_MAX
        scales.copy_(wanted)  # to nearest: a scale rounded up would compound, step after step, into a growing v
        scale = scales.to(torch.float32).unsqueeze(1)
        scaled = torch.where(scale > 0, roots / scale, 0.0)
        code = scaled.view(torch.int32).sub(_ROOT_BASE - (1 << 18)).bitwise_right_shift(19).clamp(1, 255)
        codes.copy_(torch.where(scaled > 0, code, 0).to(torch.uint8))


HIGH_HALF = -65536
"""0xFFFF0000 as an int32: the bits of a bf16 value in an fp32 word."""


def nearest_bf16_bits(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` rounded to bf16, to nearest even, as int32 bits with the low half zero (the
    fp32 value of the bf16 one): ``copy_`` into bf16 in integer arithmetic, overflow to inf included. A NaN
    stays a NaN unless its low 16 bits carry into the sign bit (bits 0x7FFF8000 and up, or 0xFFFF8000 and
    up: they become a zero; arithmetic makes no such NaN, only a payload written by hand does)."""
    return nearest_even_bits(values.view(torch.int32))


class PairHalf:
    """One moment of a run kept as bf16 in one half of an int32 word per element (the first moment
    in the high half, the second in the low one: see the module docstring)."""

    def __init__(self, words: torch.Tensor, high: bool) -> None:
        self.words, self.high = words, high
        self.nbytes = words.nbytes // 2

    def load(self) -> torch.Tensor:
        return (self.words & HIGH_HALF).view(torch.float32) if self.high else (self.words << 16).view(torch.float32)

    def save(self, values: torch.Tensor) -> None:
        bits = nearest_bf16_bits(values.reshape(-1).contiguous())
        if self.high:
            self.words.copy_(bits | (self.words & 0xFFFF))
        else:
            self.words.copy_((self.words & HIGH_HALF) | ((bits >> 16) & 0xFFFF))

    def export(self) -> torch.Tensor:
        return self.load().bfloat16()  # exact: the loaded values are bf16 values

    def import_(self, values: torch.Tensor) -> None:
        self.save(values.to(torch.float32))


_ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def moment_nbytes(state_dtype: str, numel: int, *, second: bool) -> int:
    """The bytes :func:`make_stores` keeps for one moment of a run of ``numel`` elements, without
    allocating it (``fxzero explain --size``): fp8 codes padded to whole blocks, and one scale per
    block (the first moment's int8 exponent, the second's bf16 scale); packed bf16 moments take
    half a word each, as two bf16 tensors would."""
    if state_dtype != "fp8":
        return _ELEMENT_BYTES[state_dtype] * numel
    return -(-numel // BLOCK) * (BLOCK + (2 if second else 1))


def make_store(state_dtype: str, numel: int, device: torch.device, *, second: bool) -> MomentStore:
    """A store for ``numel`` elements of the first (``second=False``) or second moment."""
    if state_dtype == "fp8":
        return RootStore(numel, device) if second else BlockStore(numel, device)
    return PlainStore(numel, torch.float32 if state_dtype == "fp32" else torch.bfloat16, device)


def make_stores(state_dtypes: tuple[str, str], numel: int, device: torch.device, *, paired: bool) -> tuple[MomentStore, MomentStore]:
    """The two moments' stores of a run of ``numel`` elements: packed in one word per element when
    ``paired`` (the compiled update) and both are bf16, else one store each."""
    if paired and state_dtypes == ("bf16", "bf16"):
        words = torch.zeros(numel, dtype=torch.int32, device=device)
        return PairHalf(words, high=True), PairHalf(words, high=False)
    return make_store(state_dtypes[0], numel, device, second=False), make_store(state_dtypes[1], numel, device, second=True)
