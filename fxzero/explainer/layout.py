"""The bucket layout as rows of facts: what each bucket holds and what it moves.

Why apart from the text: the summary table, the JSON file and the picture show the same
numbers; they are computed here once, from the optimizer's own buckets.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..optim.layout.mesh import local_of

if TYPE_CHECKING:
    from .explained import Explained

__all__ = ["BucketFacts", "bucket_facts", "totals"]


@dataclasses.dataclass(frozen=True)
class BucketFacts:
    """One bucket, as this rank lays it out."""

    index: int
    params: tuple[str, ...]
    """Module paths in buffer order (the order gradients arrive in backward)."""
    elements: int
    """Param elements (a DTensor param's local ones: what the buffer holds)."""
    padded: int
    """Buffer elements: params, the alignment of each param's start, the bucket's padding to dp shards."""
    shard: int
    """Elements of each rank's shard (``padded / dp``)."""
    grad_bytes: int
    """Bytes the gradient reduction reads: the whole grad bucket."""
    gather_bytes: int
    """Bytes the param gather writes: the whole param bucket (MXFP8: codes + scales)."""
    param_dtype: str
    grad_dtype: str
    graphs: tuple[str, ...]
    """Ids of the compiled graphs that read a param of the bucket (empty: eager only)."""

    @property
    def padding(self) -> int:
        return self.padded - self.elements

    @property
    def padding_percent(self) -> float:
        return 100 * self.padding / self.padded if self.padded else 0.0


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _facts(bucket: Any, explained: "Explained") -> BucketFacts:
    opt = explained.optimizer
    padded = bucket.param_data.numel()
    return BucketFacts(
        index=bucket.index,
        params=tuple(explained.name(p) for p in bucket.params),
        elements=sum(local_of(p).numel() for p in bucket.params),
        padded=padded,
        shard=padded // opt.dp.size,
        grad_bytes=padded * bucket.grad_data.element_size(),
        gather_bytes=opt.runtime.gather.bytes_per_gather(bucket.index),
        param_dtype=_dtype(bucket.param_data),
        grad_dtype=_dtype(bucket.grad_data),
        graphs=tuple(explained.graphs_of_bucket(bucket.index)),
    )


def bucket_facts(explained: "Explained") -> list[BucketFacts]:
    """Every bucket of the optimizer, in index order."""
    return [_facts(b, explained) for b in explained.optimizer.runtime.buckets]


def totals(facts: list[BucketFacts]) -> tuple[int, int, float]:
    """``(param elements, buffer elements, padding %)`` over all buckets."""
    elements, padded = sum(f.elements for f in facts), sum(f.padded for f in facts)
    return elements, padded, (100 * (padded - elements) / padded if padded else 0.0)
