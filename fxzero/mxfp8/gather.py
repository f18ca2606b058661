"""The MXFP8 param all-gather: quantized shards in, dequantized params out.

With ``Config.mxfp8_param_gather`` a bucket's gather moves MXFP8 codes and scales
(33 bytes per 32 elements, 0.26x of fp32) instead of param values:

1. **publish** (in ``step()``): this rank quantizes its updated fp32 main shard straight
   into its own row of the gather destination, ``[codes (S bytes) | scales (S/32 bytes)]``
   for a shard of ``S`` elements, so the row is the all-gather's input, in place;
2. **launch**: one in-place all-gather of the rows (uint8; on gloo a broadcast per row);
3. **land** (when the bucket is waited, right before its first read): every rank's row
   is dequantized into the bucket's ``param_data`` with two copies and a multiply on
   views made at construction.

Where the destination lives is the point of ``reuse_grad_buf_for_mxfp8_param_ag``:
with it, the rows are the first ``33/32 * numel`` bytes of the bucket's own
``grad_data`` (fp32 or 16-bit: always big enough), viewed as bytes, and landing zeroes
that bucket's grad region afterwards, so no gradient is ever added onto gather bytes.
Gradients and gathered params are not live at once: a bucket is landed before its
first read in the forward, and the runtime lands any bucket still pending before a
gradient is written to it or it is reduced (see :class:`~fxzero.optim.gradients.grad_sync.GradSync`).
Without reuse the rows live in one separate byte buffer.

Only :meth:`publish` allocates (the quantizer's float32 temporary of one shard); the
block scale factors are decoded into one preallocated scratch shared by all buckets,
which is safe because buckets land one at a time on the thread that runs the model.

This rank's own row outlives the landing (:meth:`own_values` rebuilds from it what the
rank's shard of the params should hold, to notice values written outside the
optimizer): without reuse it stays in the gather buffer; with reuse the grad region
it lands in is zeroed, so publish keeps a copy, 1/dp of the payload.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..optim.layout.buffers import Bucket
from ..optim.communication.comm import DataParallelGroup
from ..optim.params.param_sync import Gather
from . import cast as mxfp8

__all__ = ["Mxfp8Gather", "payload_bytes"]

_BLOCK = mxfp8.BLOCK_SIZE


def payload_bytes(numel: int) -> int:
    """Bytes one MXFP8 gather of ``numel`` elements moves: a code byte per element and
    a scale byte per 32."""
    return numel + numel // _BLOCK


@dataclasses.dataclass(frozen=True, eq=False)
class _BucketViews:
    """Views of one bucket's gather, made once."""

    send: torch.Tensor
    """uint8, this rank's row: the all-gather's input (a view of ``dest``)."""
    dest: torch.Tensor
    """uint8, every rank's row: the all-gather's output."""
    rows: tuple[torch.Tensor, ...]
    """``rows[r]``: rank r's row of ``dest`` (what an all-gather by broadcasts sends from)."""
    own_codes: torch.Tensor
    own_scales: torch.Tensor
    codes: torch.Tensor
    """float8_e4m3fn ``[dp, S/32, 32]`` views of every row's codes."""
    scales: torch.Tensor
    """float8_e8m0fnu ``[dp, S/32, 1]`` views of every row's scales."""
    factors: torch.Tensor
    """float32 ``[dp, S/32, 1]`` scratch the scales are decoded into."""
    params: torch.Tensor
    """The bucket's ``param_data`` as ``[dp, S/32, 32]``."""
    grads: Optional[torch.Tensor]
    """The bucket's ``grad_data`` when the rows live in it (zeroed after landing)."""
    kept: torch.Tensor
    """uint8, where this rank's row is kept until the next publish (``send``, or a copy)."""
    kept_codes: torch.Tensor
    """float8_e4m3fn ``[S/32, 32]`` view of the kept row's codes."""
    kept_scales: torch.Tensor
    """float8_e8m0fnu ``[S/32, 1]`` view of the kept row's scales."""
    own_factors: torch.Tensor
    """float32 ``[S/32, 1]`` scratch for the kept row's decoded scales."""


class Mxfp8Gather(Gather):
    """Per-bucket MXFP8 gathers for one optimizer (see the module docstring)."""

    needs_landing = True

    def __init__(self, buckets: Sequence[Bucket], dp: DataParallelGroup, *, reuse_grad_buffer: bool) -> None:
        self.dp = dp
        self.reuse_grad_buffer = reuse_grad_buffer
        sizes = [payload_bytes(b.param_data.numel()) for b in buckets]
        device = buckets[0].param_data.device if buckets else None
        self.buffer: Optional[torch.Tensor] = None
        if not reuse_grad_buffer:
            self.buffer = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        self.kept: Optional[torch.Tensor] = None
        if reuse_grad_buffer:
            self.kept = torch.zeros(sum(sizes) // dp.size, dtype=torch.uint8, device=device)
        scratch_numel = max((b.param_data.numel() // _BLOCK for b in buckets), default=0)
        self.scratch = torch.empty(scratch_numel, dtype=torch.float32, device=device)
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        self.views = tuple(self._views(b, offset, size) for b, offset, size in zip(buckets, offsets, sizes))
        self._published = [False] * len(self.views)

    def _views(self, bucket: Bucket, offset: int, size: int) -> _BucketViews:
        dp, numel = self.dp.size, bucket.param_data.numel()
        shard, blocks = numel // dp, numel // dp // _BLOCK
        if self.buffer is None:
            dest = bucket.grad_data.view(torch.uint8)[:size]
        else:
            dest = self.buffer[offset : offset + size]
        rows = dest.view(dp, size // dp)
        send = rows[self.dp.rank]
        kept = send if self.kept is None else self.kept[offset // dp : (offset + size) // dp]
        return _BucketViews(
            send=send,
            dest=dest,
            rows=rows.unbind(0),
            own_codes=send[:shard].view(torch.float8_e4m3fn),
            own_scales=send[shard:].view(torch.float8_e8m0fnu),
            codes=rows[:, :shard].view(torch.float8_e4m3fn).view(dp, blocks, _BLOCK),
            scales=rows[:, shard:].view(torch.float8_e8m0fnu).unsqueeze(-1),
            factors=self.scratch[: dp * blocks].view(dp, blocks, 1),
            params=bucket.param_data.view(dp, blocks, _BLOCK),
            grads=bucket.grad_data if self.buffer is None else None,
            kept=kept,
            kept_codes=kept[:shard].view(torch.float8_e4m3fn).view(blocks, _BLOCK),
            kept_scales=kept[shard:].view(torch.float8_e8m0fnu).unsqueeze(-1),
            own_factors=self.scratch[:blocks].view(blocks, 1),
        )

    def publish(self, index: int, main: torch.Tensor) -> None:
        """Quantize this rank's updated fp32 main shard into its row of bucket ``index``."""
        views = self.views[index]
        mxfp8.quantize(main, out=(views.own_codes, views.own_scales))
        if views.kept is not views.send:
            views.kept.copy_(views.send)
        self._published[index] = True

    def launch(self, index: int) -> Optional[dist.Work]:
        if self.dp.size == 1:
            return None
        views = self.views[index]
        return self.dp.all_gather_async(views.dest, views.rows)

    def land(self, index: int) -> None:
        """Dequantize every rank's row into the params; free the grad region for gradients."""
        views = self.views[index]
        views.factors.copy_(views.scales)  # E8M0 -> 2^(e-127), NaN for the NaN scale
        views.params.copy_(views.codes)  # exact: E4M3 values fit fp32, bf16 and fp16
        views.params.mul_(views.factors)
        if views.grads is not None:
            views.grads.zero_()

    def still_holds(self, index: int, main: torch.Tensor, current: torch.Tensor) -> Optional[bool]:
        """No one-pass check of dequantized rows: the caller compares :meth:`own_values`' output."""
        return None

    def own_values(self, index: int, main: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's row dequantized into ``out``, as landing writes it (``main`` before
        the first publish)."""
        if not self._published[index]:
            out.copy_(main)
            return
        views = self.views[index]
        values = out.view(views.kept_codes.shape)
        views.own_factors.copy_(views.kept_scales)
        values.copy_(views.kept_codes)
        values.mul_(views.own_factors)

    @property
    def nbytes(self) -> int:
        """Memory this gather adds to the runtime: the separate rows (unless reused; then
        the kept copy of this rank's row) and the scratch."""
        rows = self.buffer if self.buffer is not None else self.kept
        return (rows.nbytes if rows is not None else 0) + self.scratch.nbytes

    def bytes_per_gather(self, index: int) -> int:
        return self.views[index].dest.nbytes
