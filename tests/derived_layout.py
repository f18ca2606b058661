"""The flat-buffer layout derived from the rules as docs/design.md states them, independently of
``fxzero.optim.plan_buckets`` (as Megatron's ``test_bucket_sizes`` derives its expected sizes):
what tests compare printed or reported figures with, so no expected number comes from the code
under test.

The rules: params walked in reverse registration order; a param of 64 elements or more starts
on a multiple of 64 elements, a smaller one on the power of two covering it, and never below 16
bytes; a bucket closes once it spans ``bucket_size`` elements; each bucket's end is padded to a
multiple of ``lcm(dp, 128)``."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class DerivedLayout:
    buckets: tuple[int, ...]
    """Each bucket's padded size, in elements, in layout order."""
    param_elements: int

    @property
    def buffer_elements(self) -> int:
        return sum(self.buckets)

    @property
    def padding_percent(self) -> float:
        return 100.0 * (1 - self.param_elements / self.buffer_elements)

    def summary_line(self) -> str:
        """The head line of ``fxzero explain``'s bucket table, as the rules give its figures."""
        count = len(self.buckets)
        noun = "bucket" if count == 1 else "buckets"
        return (f"{count} {noun}: {self.param_elements:,} param elements in {self.buffer_elements:,} buffer elements "
                f"({self.padding_percent:.1f}% padding)")  # fmt: skip


def _start_alignment(numel: int, itemsize: int) -> int:
    align = 64 if numel >= 64 else 2 ** math.ceil(math.log2(max(numel, 1)))
    return max(align, 16 // itemsize)


def derive_layout(params: Sequence[torch.Tensor], dp: int, bucket_size: Optional[int]) -> DerivedLayout:
    """``params`` in registration order (their local tensors for DTensors), all of one dtype."""
    divisor = math.lcm(dp, 128)
    buckets: list[int] = []
    start = position = 0
    for param in reversed(params):
        align = _start_alignment(param.numel(), param.element_size())
        position = math.ceil(position / align) * align + param.numel()
        if bucket_size is not None and position - start >= bucket_size:
            buckets.append(math.ceil((position - start) / divisor) * divisor)
            start = position = start + buckets[-1]
    if position > start:
        buckets.append(math.ceil((position - start) / divisor) * divisor)
    return DerivedLayout(tuple(buckets), sum(p.numel() for p in params))
