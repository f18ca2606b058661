"""How :class:`~fxzero.optim.update.shard_adam.ShardAdamW` keeps one moment of one run: fp32,
bf16, or 8-bit blocks (``Config.optimizer_state_dtype``).

Every store :meth:`~MomentStore.load`\\ s fp32 values for the update and :meth:`~MomentStore.save`\\ s
them back: the update itself always computes in fp32 (as Megatron-LM's precision-aware
optimizer does), and only what is kept between steps is narrower.

**8-bit blocks** (``"fp8"``): each run of the shard is cut into blocks of 32 elements from its
own start, so no block spans two ranks' shards (a run lies in one rank's shard); a block keeps
32 ``float8_e4m3fn`` codes and one int8 exponent ``e``, its scale ``2^e`` the smallest power of
two that puts the block's largest magnitude at or below 448 (E4M3's largest value): no
element is clipped, unlike MXFP8's "floor" scale. 1 + 1/32 bytes per element. Why powers of
two: a dequantized value ``code * 2^e`` is exact in fp32, and quantizing it again gives the same
value back, so a checkpoint that stores dequantized values resumes bitwise (:meth:`export` /
:meth:`import_`).

The second moment is kept as its square root (``sqrt_of=True``) and rounded *up* to the next
code: its range in a block halves (in octaves), and a nonzero second moment never decodes to
zero or to less than it was, so quantization can only shrink an Adam update, never blow one
up by dividing by a flushed denominator (the failure of plain 8-bit second moments).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["BLOCK", "MomentStore", "STATE_DTYPES", "make_store"]

BLOCK = 32
STATE_DTYPES = ("fp32", "bf16", "fp8")
_E4M3_MAX = 448.0


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


class BlockStore:
    """8-bit E4M3 codes in blocks of :data:`BLOCK`, one power-of-two scale per block."""

    def __init__(self, numel: int, device: torch.device, *, sqrt_of: bool) -> None:
        self.numel, self.sqrt_of = numel, sqrt_of
        blocks = -(-numel // BLOCK)
        self.codes = torch.zeros(blocks * BLOCK, dtype=torch.float8_e4m3fn, device=device)
        self.exponents = torch.zeros(blocks, dtype=torch.int8, device=device)
        self.nbytes = self.codes.nbytes + self.exponents.nbytes

    def load(self) -> torch.Tensor:
        values = self._decoded()[: self.numel]
        return values.square_() if self.sqrt_of else values

    def save(self, values: torch.Tensor) -> None:
        padded = torch.zeros(self.codes.numel(), dtype=torch.float32, device=values.device)
        padded[: self.numel] = values.reshape(-1)
        if self.sqrt_of:
            padded.sqrt_()
        blocks = padded.view(-1, BLOCK)
        mantissa, exponent = torch.frexp(blocks.abs().amax(dim=1) / _E4M3_MAX)
        exponent = exponent.sub_(mantissa.eq(0.5).to(exponent.dtype)).clamp_(-127, 127)  # ceil(log2(amax / 448))
        self.exponents.copy_(exponent)
        blocks.div_(torch.exp2(exponent.to(torch.float32)).unsqueeze(1)).clamp_(-_E4M3_MAX, _E4M3_MAX)
        self.codes.copy_(padded)
        if self.sqrt_of:  # round up: bump each code that decoded below its value to the next one
            below = self.codes.to(torch.float32).lt_(padded)
            self.codes.view(torch.uint8).add_(below.to(torch.uint8))

    def export(self) -> torch.Tensor:
        return self.load()

    def import_(self, values: torch.Tensor) -> None:
        self.save(values.to(torch.float32))

    def _decoded(self) -> torch.Tensor:
        scale = torch.exp2(self.exponents.to(torch.float32)).unsqueeze(1)
        return self.codes.to(torch.float32).view(-1, BLOCK).mul_(scale).view(-1)


def make_store(state_dtype: str, numel: int, device: torch.device, *, second: bool) -> MomentStore:
    """A store for ``numel`` elements of the first (``second=False``) or second moment."""
    if state_dtype == "fp8":
        return BlockStore(numel, device, sqrt_of=second)
    return PlainStore(numel, torch.float32 if state_dtype == "fp32" else torch.bfloat16, device)
