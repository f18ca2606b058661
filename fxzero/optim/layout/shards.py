"""This rank's fp32 main shards and the per-fragment tensors the wrapped optimizer sees.

For each bucket, a rank owns one contiguous shard. :class:`BucketShard` holds:

* ``main`` - fp32 master values of the shard. For fp32 params it *is* the param
  buffer's shard view (no copy, no copy-back); for bf16/fp16 params, and for every
  param when the gather is lossy (MXFP8), it is a separate fp32 tensor that is
  published to the gather after every update.
* ``main_grad`` - fp32 gradients of the shard. For an fp32 grad buffer it *is* the grad
  buffer's shard view, the reduce-scatter's output; otherwise an fp32 copy.

The wrapped ``torch.optim`` optimizer gets one tensor per :class:`~fxzero.optim.layout.layout.Fragment`
(a view of ``main``) whose ``.grad`` is the matching view of ``main_grad``: its state
(moments, step counts) exists only for this rank's 1/dp of every param.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .buffers import Bucket, ParamAndGradBuffer
from .layout import Fragment, shard_fragments
from .param_table import ParamTable

__all__ = ["BucketShard", "FragmentTensor", "build_shards"]


@dataclasses.dataclass(frozen=True, eq=False)
class BucketShard:
    bucket: Bucket
    main: torch.Tensor
    main_grad: torch.Tensor
    main_is_param: bool
    """True when ``main`` aliases the param shard (fp32 params, or bf16 params whose masters are
    kept as remainders): nothing to copy back."""
    main_grad_is_grad: bool
    """True when ``main_grad`` aliases the reduce-scatter output (fp32 grads)."""


@dataclasses.dataclass(frozen=True, eq=False)
class FragmentTensor:
    """A fragment as the wrapped optimizer sees it: a leaf view and its grad view (1-D, or
    shaped like the param when the fragment is a whole param of a whole-param plan)."""

    slot: int
    """Index of the owning param among the optimizer's managed params."""
    param: torch.Tensor
    grad: torch.Tensor
    where: Fragment
    """Which part of the param it is (offsets in the param and in the shard)."""


def _bucket_shard(bucket: Bucket, rank: int, separate_mains: bool, remainders: bool) -> BucketShard:
    param_shard, grad_shard = bucket.param_shards[rank], bucket.grad_shards[rank]
    kept_in_params = param_shard.dtype == torch.float32 or (remainders and param_shard.dtype == torch.bfloat16)
    main_is_param = kept_in_params and not separate_mains
    main_grad_is_grad = grad_shard.dtype == torch.float32
    return BucketShard(
        bucket=bucket,
        main=param_shard if main_is_param else param_shard.detach().to(torch.float32, copy=True),
        main_grad=grad_shard if main_grad_is_grad else torch.zeros_like(grad_shard, dtype=torch.float32),
        main_is_param=main_is_param,
        main_grad_is_grad=main_grad_is_grad,
    )


def build_shards(
    buffers: Sequence[ParamAndGradBuffer], table: ParamTable, rank: int, *, separate_mains: bool = False, remainders: bool = False
) -> tuple[tuple[BucketShard, ...], tuple[FragmentTensor, ...]]:
    """Make this rank's bucket shards and fragment tensors, in bucket order.
    ``separate_mains`` keeps fp32 masters apart from fp32 params too (a lossy gather
    overwrites the param shard). In a whole-param plan every fragment is a whole param and
    its tensors are shaped like it: what a shape-aware optimizer (Muon, Adafactor) reads.
    ``remainders`` (``Config.param_remainders``): bf16 params keep no fp32 main shard; their
    fragments are views of the bf16 param shard, and fxzero's own Adam update keeps the
    remainders that rebuild the fp32 masters (:mod:`fxzero.optim.update.shard_adam`)."""
    shards: list[BucketShard] = []
    fragments: list[FragmentTensor] = []
    for buffer in buffers:
        local = [_bucket_shard(bucket, rank, separate_mains, remainders) for bucket in buffer.buckets]
        shards.extend(local)
        for frag in shard_fragments(buffer.plan, rank):
            shard = local[frag.bucket_id]
            lo, hi = frag.shard_offset, frag.shard_offset + frag.numel
            param = buffer.params[frag.param_index]
            slot = table.slots([param])[0]
            shape = param.shape if buffer.plan.owners is not None else (frag.numel,)
            view = shard.main[lo:hi].view(shape)
            if view.dtype != shard.main_grad.dtype:
                view.grad_dtype = None  # a bf16 master view (remainders) takes its fp32 gradient (torch >= 2.10)
            view.grad = shard.main_grad[lo:hi].view(shape)
            fragments.append(FragmentTensor(slot, view, view.grad, frag))
    return tuple(shards), tuple(fragments)
