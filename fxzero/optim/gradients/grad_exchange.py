"""The all-to-all gradient reduction (gloo's fastest), in chunks through a few receive slots.

Reducing a bucket by exchange: every rank sends rank q its copy of shard q and sums the
``dp - 1`` copies of its own shard it receives into that shard (gloo's reduce-scatter sets
up an algorithm and copies the whole bucket on every call; its all-reduce moves twice the
bytes). Received all at once, a bucket needs ``(dp - 1) / dp`` of its size as scratch, so
the exchange runs in **chunks** of at most ``chunk`` elements of each shard, received into
``slots`` receive buffers of ``(dp - 1) x chunk`` elements: a few MiB whatever the bucket or
model size. Each chunk is ``dp - 1`` all-to-alls with uneven splits (round ``s`` sends to
rank ``r + s`` and receives from rank ``r - s``), which move views of the grad buffer in
place: nothing is copied to be sent.

**Order.** Chunks are issued in one fixed sequence (bucket by bucket, chunk by chunk), and
every decision to issue or to wait depends on counts only, never on whether a transfer has
finished, so every rank issues the same collectives in the same order at the same points
of its program:

* :meth:`launch` queues a bucket's chunks and issues them while a slot is free;
* :meth:`progress`, called at each gradient hand-off during backward, retires the oldest
  chunk (waits for it and sums it) when every slot is busy and chunks are owed, then
  issues more: the exchange keeps up with backward without a thread of its own;
* :meth:`finish_launched` (the step) issues what is still owed and retires everything.

**Sums** are in rank order, as a single all-to-all's ``rows[0] + rows[1] + ...`` would be,
in place in this rank's shard (float addition commutes: ``own + acc == acc + own``). 16-bit
gradients (``Config.grad_dtype=torch.bfloat16`` or ``float16``) are summed in fp32 and
rounded once: a chain of 16-bit additions rounds at each of the ``dp - 1`` adds, an error that
grows with the number of ranks. gloo lets fxzero do the sum, so it does it right; NCCL's
reduce-scatter sums in its own kernels (``Config.grad_dtype=torch.float32``, the default,
reduces in fp32 on every transport).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..layout.buffers import Bucket
from ..communication.comm import DataParallelGroup, describe_params

__all__ = ["CHUNK_BYTES", "SLOTS", "GradExchange"]

CHUNK_BYTES = 1 << 20
"""Bytes of each shard one chunk moves (per peer): large enough that gloo's per-collective
cost is small against the transfer, small enough that ``SLOTS`` chunks are a few MiB."""
SLOTS = 4
"""Chunks in flight at once (each needs its receive slot)."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Chunk:
    """One chunk of one bucket, with every view its exchange needs, made once."""

    bucket: int
    own: torch.Tensor
    """This rank's shard of the bucket, this chunk's range: where the sum goes."""
    sends: tuple[tuple[torch.Tensor, list[int]], ...]
    """Per round: the view of the destination rank's shard to send, and the split sizes."""
    receives: tuple[tuple[tuple[torch.Tensor, list[int]], ...], ...]
    """Per slot, per round: the slot row receiving the source rank's copy, and the splits."""
    rows: tuple[tuple[torch.Tensor, ...], ...]
    """Per slot: the same rows, in the order of the ranks they come from."""
    before: int
    """How many of ``rows`` come from lower ranks than this one."""
    acc: Optional[torch.Tensor]
    """16-bit gradients: the fp32 accumulator the sum runs in (a view made once); else ``None``."""


class GradExchange:
    """Chunked all-to-all reductions of a fixed list of buckets (see the module docstring); a
    :class:`~fxzero.optim.gradients.reduction.Reduction`."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        dp: DataParallelGroup,
        *,
        chunk_bytes: Optional[int] = None,
        slots: Optional[int] = None,
        described: Optional[Sequence[str]] = None,
    ) -> None:
        """``chunk_bytes`` / ``slots`` default to the module's :data:`CHUNK_BYTES` / :data:`SLOTS`
        (read here, so a test can make chunks small enough to turn the ring many times);
        ``described[i]`` names bucket i's params in errors (shapes by default)."""
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        slots = SLOTS if slots is None else slots
        if dp.size < 2:
            raise ValueError(f"GradExchange needs at least 2 ranks, got {dp.size}")
        if slots < 1 or chunk_bytes < 8 or chunk_bytes % 8:
            raise ValueError(f"GradExchange: slots must be >= 1 and chunk_bytes a positive multiple of 8, got {slots} and {chunk_bytes}")
        self.dp, self.slots, self.chunk_bytes = dp, slots, chunk_bytes
        device = buckets[0].grad_data.device if buckets else None
        self._memory = [torch.empty((dp.size - 1) * chunk_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        narrow = any(b.grad_data.dtype in _NARROW for b in buckets)
        self._wide = torch.empty(chunk_bytes // 2 if narrow else 0, dtype=torch.float32, device=device)
        """The fp32 accumulator of a 16-bit chunk's sum (one chunk is summed at a time)."""
        self.chunks = tuple(tuple(self._chunks_of(b)) for b in buckets)
        """``chunks[i]``: bucket i's chunks, in issue order."""
        self._described = {b.index: described[i] if described else describe_params(b.params) for i, b in enumerate(buckets)}
        self._owed: collections.deque[_Chunk] = collections.deque()
        self._in_flight: collections.deque[tuple[_Chunk, list[dist.Work], int]] = collections.deque()
        self._issued = 0  # chunks issued so far: the next one takes slot issued % slots
        self.post_scale = 1.0 / dp.size
        """Each rank's copies are summed: the shard still needs 1/dp."""

    def _chunks_of(self, bucket: Bucket) -> Iterator[_Chunk]:
        rank, size = self.dp.rank, self.dp.size
        own = bucket.grad_shards[rank]
        step = max(1, self.chunk_bytes // own.element_size())
        destinations = [(rank + s) % size for s in range(1, size)]
        sources = [(rank - s) % size for s in range(1, size)]
        in_rank_order = sorted(range(size - 1), key=lambda i: sources[i])
        for start in range(0, own.numel(), step):
            n = min(step, own.numel() - start)
            receives = tuple(self._slot_rows(slot, own.dtype, n, sources) for slot in range(self.slots))
            yield _Chunk(
                bucket=bucket.index,
                own=own[start : start + n],
                sends=tuple((bucket.grad_shards[dst][start : start + n], _splits(size, dst, n)) for dst in destinations),
                receives=receives,
                rows=tuple(tuple(rows[i][0] for i in in_rank_order) for rows in receives),
                before=sum(src < rank for src in sources),
                acc=self._wide[:n] if own.dtype in _NARROW else None,
            )

    def _slot_rows(self, slot: int, dtype: torch.dtype, n: int, sources: list[int]) -> tuple[tuple[torch.Tensor, list[int]], ...]:
        rows = self._memory[slot].view(dtype)[: (self.dp.size - 1) * n].view(self.dp.size - 1, n)
        return tuple((rows[i], _splits(self.dp.size, src, n)) for i, src in enumerate(sources))

    # ---- issuing and retiring ------------------------------------------------------
    def launch(self, index: int) -> None:
        """Bucket ``index``'s gradients are all in: queue its chunks, issue what fits."""
        self._owed.extend(self.chunks[index])
        self._fill()

    def progress(self) -> None:
        """A point in backward: if chunks are owed and every slot is busy, retire the
        oldest (waiting for it: it was issued at an earlier point) and issue more."""
        if self._owed and len(self._in_flight) == self.slots:
            self._retire()
            self._fill()

    def finish_launched(self) -> None:
        """Finish every launched bucket's reduction (the step: issue what is owed, retire all)."""
        while self._in_flight or self._owed:
            self._fill()
            self._retire()

    def pending_works(self) -> list[dist.Work]:
        """The chunks' collectives in flight (what exit waits for, :func:`~fxzero.optim.communication.comm.settle`)."""
        return [work for _, works, _ in self._in_flight for work in works]

    def collectives_per_step(self) -> dict[str, int]:
        """``dp - 1`` all-to-alls per chunk."""
        return {"alltoall": sum(map(len, self.chunks)) * (self.dp.size - 1)}

    def _fill(self) -> None:
        while self._owed and len(self._in_flight) < self.slots:
            chunk = self._owed.popleft()
            slot = self._issued % self.slots
            self._issued += 1
            self._in_flight.append((chunk, self.dp.exchange_async(chunk.sends, chunk.receives[slot]), slot))

    def _retire(self) -> None:
        chunk, works, slot = self._in_flight.popleft()
        for work in works:
            self.dp.wait(work, "gradient reduction", chunk.bucket, self._described[chunk.bucket])
        _sum_in_rank_order(chunk.own, chunk.rows[slot], chunk.before, chunk.acc)

    @property
    def nbytes(self) -> int:
        """The receive slots and the fp32 accumulator: all the scratch the exchange needs."""
        return sum(m.nbytes for m in self._memory) + self._wide.nbytes


def _splits(size: int, peer: int, n: int) -> list[int]:
    splits = [0] * size
    splits[peer] = n
    return splits


_NARROW = (torch.bfloat16, torch.float16)


def _sum_in_rank_order(own: torch.Tensor, rows: Sequence[torch.Tensor], before: int, acc: Optional[torch.Tensor] = None) -> None:
    """``own`` (this rank's copy) becomes the sum of every rank's copy in rank order:
    ``rows`` are the other ranks' copies by rank, the first ``before`` from lower ranks.
    In place, no allocation; the loop is over ranks. With ``acc`` (an fp32 tensor of
    ``own``'s length) the sum runs in fp32 and is rounded into ``own`` once."""
    if acc is not None:
        _sum_wide(own, rows, before, acc)
        return
    if before:  # acc = row_0 + ... + row_{rank-1}, in the first received row's memory
        for i in range(1, before):
            rows[0].add_(rows[i])
        own.add_(rows[0])  # own + acc == acc + own
    for i in range(before, len(rows)):
        own.add_(rows[i])


def _sum_wide(own: torch.Tensor, rows: Sequence[torch.Tensor], before: int, acc: torch.Tensor) -> None:
    """:func:`_sum_in_rank_order` in the fp32 ``acc``, in the same order, rounded once."""
    if before:
        acc.copy_(rows[0])
        for i in range(1, before):
            acc.add_(rows[i])
        acc.add_(own)
    else:
        acc.copy_(own)
    for i in range(before, len(rows)):
        acc.add_(rows[i])
    own.copy_(acc)
