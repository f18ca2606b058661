"""Param all-gathers after the step, waited right before each bucket's first use.

After :meth:`DistributedOptimizer.step` updates this rank's shards, every bucket's
``param_data`` must be all-gathered before the model reads it again. By default the step
does that itself and returns with every param current. With ``Config.overlap_param_gather``
(opt-in, as in Megatron-LM) the step launches every bucket's gather, in forward order, and
returns; the next forward waits for each bucket immediately before its first read:

* compiled graphs call ``fxzero::wait_params`` (inserted by
  :mod:`fxzero.passes.param_gather_wait`) before the first node that reads the bucket;
* eager regions wait in forward pre-hooks of the modules that own managed params
  (:mod:`.param_waits`);
* anything else (``state_dict()``, direct reads) calls :meth:`ParamSync.finish`;
  so does ``load_state_dict()``, so a gather still in flight never lands over values
  it just loaded.

**Writes while the gathers are in flight** (between ``step()`` and the first wait: WGAN's
``p.data.clamp_``, an EMA's ``copy_to``/``restore``) race with the gathers, which land
over them or send values from before them, so ranks end up holding different params. No
hook sees a write through ``p.data`` (its version counter is its own), so the first wait
after ``step()`` compares this rank's own shard of every bucket with a copy taken when the
gathers launched (one copy and one comparison of 1/dp of the params per step, with overlap
on only): a param write on every rank, as these loops do, changes each owner's shard. The
finding rides on the next step's all-reduce of gradient statistics
(:class:`~fxzero.optim.gradients.reduced_grads.ReducedGrads`), so every rank raises the same error,
naming the fix (``opt.finish_param_sync()`` before writing), before any update. No
collective at the wait itself: a read on one rank alone must complete (see below).

**Why launch them all in the step.** A read on one rank only (rank 0 saving
``model.state_dict()``, a rank-0 eval) waits for gathers; if some were still to be launched
by the next forward, rank 0 would wait for peers that are blocked in whatever collective
comes next (a barrier), until the process group's timeout. Launched on every rank inside
``step()``, every gather completes without its peers doing anything more. Gathers run in
place, so having them all in flight costs no memory.

**Order.** Buckets are laid out in reverse registration order, so the forward reads
them in *descending* index order, and gathers launch in that order. Waiting for a
bucket first launches every earlier one not launched yet (a step under ``torch.profiler``
or :meth:`finish` launches lazily), so the sequence of collectives is the same on every
rank whatever order the model happens to read buckets in.

**What a gather moves** is up to a gather object: :class:`PlainGather` gathers the param
shards themselves in place; :class:`~fxzero.mxfp8.gather.Mxfp8Gather` gathers
MXFP8 codes and *lands* each bucket (dequantizes it into the params) after its wait.
ParamSync only orders launches, waits and landings.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..._torch_compat import profiler_enabled, tensor_version
from ..layout.buffers import Bucket
from ..communication.comm import DataParallelGroup
from .bf16_rounding import Rounding
from .rounding_kernels import RoundingKernels

__all__ = ["Gather", "ParamSync", "PlainGather", "as_words", "written_in_flight"]

log = logging.getLogger(__name__)


class Gather(Protocol):
    """How one bucket's updated shard reaches every rank's params."""

    needs_landing: bool
    """True when params are only current after :meth:`land` (then even world size 1 runs it)."""

    def publish(self, index: int, main: torch.Tensor) -> None:
        """Put this rank's updated fp32 main shard of bucket ``index`` where the gather reads it."""

    def launch(self, index: int) -> Optional[dist.Work]: ...

    def land(self, index: int) -> None:
        """Bucket ``index``'s gather finished: make its params current."""

    def bytes_per_gather(self, index: int) -> int:
        """Bytes bucket ``index``'s all-gather outputs."""

    def own_values(self, index: int, main: torch.Tensor, out: torch.Tensor) -> None:
        """Write into ``out`` the values this rank's shard of bucket ``index``'s params
        holds after the last :meth:`publish` (``main`` itself before the first), as
        landed: what the shard still holds unless something wrote it since."""

    def still_holds(self, index: int, main: torch.Tensor, current: torch.Tensor) -> Optional[bool]:
        """Whether ``current`` (this rank's param shard of bucket ``index``) holds exactly what
        :meth:`own_values` would write, told in one pass that writes nothing; ``None`` where
        this gather has no such pass (the caller compares :meth:`own_values`' output)."""


class PlainGather:
    """Gather each bucket's param shards into ``param_data`` in place."""

    needs_landing = False

    def __init__(self, buckets: Sequence[Bucket], dp: DataParallelGroup, rounding: Rounding = "nearest_even",
                 compiled: Optional[bool] = False) -> None:  # fmt: skip
        """``rounding``: how fp32 masters become bf16 params (:mod:`.bf16_rounding`), by Inductor-compiled
        loops unless ``compiled`` is ``False`` (``Config.compiled_update``; the same bits either way)."""
        self.buckets, self.dp, self.kernels = tuple(buckets), dp, RoundingKernels(compiled)
        self._inputs = [b.param_shards[dp.rank] for b in self.buckets]
        self._rounding = [rounding if b.param_data.dtype == torch.bfloat16 else "nearest_even" for b in self.buckets]

    def publish(self, index: int, main: torch.Tensor) -> None:
        if main is not self._inputs[index]:  # fp32 params (or remainders): the main shard is the param shard
            self.kernels.round_into(main, self._inputs[index], self._rounding[index])

    def launch(self, index: int) -> Optional[dist.Work]:
        if self.dp.size == 1:
            return None
        bucket = self.buckets[index]
        return self.dp.all_gather_async(bucket.param_data, bucket.param_shards)

    def land(self, index: int) -> None:
        pass

    def bytes_per_gather(self, index: int) -> int:
        return self.buckets[index].param_data.nbytes

    def own_values(self, index: int, main: torch.Tensor, out: torch.Tensor) -> None:
        if main is out or out.dtype != torch.bfloat16:
            out.copy_(main)
        else:  # publish's own rounding
            self.kernels.round_into(main, out, self._rounding[index])

    def still_holds(self, index: int, main: torch.Tensor, current: torch.Tensor) -> Optional[bool]:
        if main is current or current.dtype != torch.bfloat16:
            return None
        return self.kernels.holds_rounding(main, current, self._rounding[index])

    nbytes = 0


class ParamSync:
    """All-gather state of a fixed list of buckets for one step."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        dp: DataParallelGroup,
        *,
        overlap: bool,
        gather: Optional[Gather] = None,
        described: Sequence[str] = (),
    ) -> None:
        self.buckets = tuple(buckets)
        self._described = tuple(described) or ("",) * len(self.buckets)
        """Per bucket, its params as failed collectives name them."""
        self.dp = dp
        self.overlap = overlap
        """Whether :meth:`start` leaves the gathers in flight for the forward: only then do
        compiled forwards carry ``fxzero::wait_params`` (off, the step finishes every gather)."""
        self.gather = gather if gather is not None else PlainGather(buckets, dp)
        n = len(self.buckets)
        self.order = tuple(reversed(range(n)))
        """Forward (first-use) order: descending bucket index."""
        self._position = [0] * n
        for position, index in enumerate(self.order):
            self._position[index] = position
        self._works: list[Optional[dist.Work]] = [None] * n
        self._stale = [False] * n  # gathered values not yet waited for this step
        self.stale = 0
        """How many buckets are stale: 0 (world size 1, or every gather landed) lets a
        compiled graph's wait return before looking its params up."""
        self._next_launch = n  # position in self.order of the next gather to launch
        self._params = tuple(p for b in self.buckets for p in b.params)
        self._launched_versions: Optional[list[int]] = None
        """The params' version counters right after step() launched the gathers (see _check_untouched)."""
        own = [b.param_shards[dp.rank] for b in self.buckets]
        self._launched_values = [torch.empty_like(o) for o in own] if overlap else []
        """Each bucket's own shard as the gathers launched (overlap on): what a write is found against."""
        self._words = [(as_words(c), as_words(o)) for c, o in zip(self._launched_values, own)]
        self._copying = False
        self._leave_in_flight = False
        """This step's gathers stay in flight when it returns (overlap on, no profiler running)."""
        self.written: list[int] = []
        """Buckets whose own shard was written while the gathers were in flight, until :meth:`take_written`."""
        self.generation = 0
        """How many steps have started gathers (:meth:`begin`): a copy of a param taken at an
        older generation's end may predate a gather (:class:`~fxzero.optim.params.param_watch.ParamWatch`)."""

    def start(self) -> None:
        """Every shard is updated: gather them all (launch all, or launch all and wait)."""
        self.begin()
        for index in self.order:
            self.launch(index)
        self.end()

    @property
    def active(self) -> bool:
        """Whether a step has gathers to run (or buckets to land)."""
        return self.dp.size > 1 or self.gather.needs_landing

    def begin(self) -> None:
        """A step starts updating shards: from now on every bucket is stale until its gather
        lands. :meth:`launch` follows for each bucket in :attr:`order`, then :meth:`end`."""
        if not self.active:
            return
        for index in range(len(self.buckets)):
            self._stale[index] = True
        self.stale = len(self.buckets)
        self.generation += 1
        self._next_launch = 0
        # Under torch.profiler the gathers finish inside the step: a profiler that stops
        # while gloo work started under it is in flight crashed the next wait (torch 2.13).
        self._leave_in_flight = self.overlap and not profiler_enabled()

    def launch(self, index: int) -> None:
        """Bucket ``index``'s shard is updated and published: launch its gather (buckets come
        in :attr:`order`, as every rank launches them: the same sequence of collectives)."""
        if not self.active:
            return
        if self.order[self._next_launch] != index:
            raise RuntimeError(f"fxzero: bucket {index}'s gather launched out of order (expected bucket {self.order[self._next_launch]})")
        if self._leave_in_flight:
            copy, own = self._words[index]
            copy.copy_(own)
        self._launch_next()

    def end(self) -> None:
        """Every bucket's gather is launched: with overlap, leave them to the next forward's
        waits (noting the params' versions, :meth:`_check_untouched`); else wait for them all."""
        if not self.active:
            return
        if self._leave_in_flight:
            self._copying = True
            self._launched_versions = list(map(tensor_version, self._params))
        else:
            self.finish()

    def _launch_through(self, position: int) -> None:
        """Launch, in forward order, every gather up to ``position`` not launched yet."""
        while self._next_launch <= min(position, len(self.order) - 1):
            self._launch_next()

    def _launch_next(self) -> None:
        index = self.order[self._next_launch]
        self._next_launch += 1
        self._works[index] = self.gather.launch(index)
        log.debug("launched all-gather of bucket %d", index)

    def wait(self, index: int) -> None:
        """Bucket ``index`` is about to be read: make it current (launching it and, to
        overlap the compute that reads it, the next one, if not launched yet)."""
        if not self._stale[index]:
            return
        if self._copying:
            self._find_writes()
        if self._launched_versions is not None:
            self._check_untouched()
        self._launch_through(self._position[index] + 1)
        work = self._works[index]
        if work is not None:
            self.dp.wait(work, "param all-gather", index, self._described[index])
            self._works[index] = None
        self.gather.land(index)
        self._stale[index] = False
        self.stale -= 1

    def _check_untouched(self) -> None:
        """The first wait after ``step()``: no managed param may have been written in place
        since the step launched the gathers (every bucket was pending then, and its gather or
        landing overwrites such a write). Later writes are not checked (a landed bucket may be
        written). One C-level pass over the params' version counters; writes through
        ``p.data`` (a counter of its own) are found by value instead (:meth:`_find_writes`)."""
        launched, self._launched_versions = self._launched_versions, None
        if launched != list(map(tensor_version, self._params)):
            raise RuntimeError(
                "fxzero: a managed param was written in place after step() while the all-gathers that step launched "
                "were in flight (Config.overlap_param_gather=True): the gather would overwrite the write. Call "
                "opt.finish_param_sync() after step() before writing params, or set overlap_param_gather=False."
            )

    def _find_writes(self) -> None:
        """The first wait after ``step()``: note the buckets whose own shard differs from the
        copy taken at launch (written, through ``p.data`` too, while the gathers were in flight)."""
        self._copying = False
        for index, (launched, own) in enumerate(self._words):
            if not torch.equal(launched, own) and index not in self.written:
                self.written.append(index)
                log.warning("bucket %d was written while its all-gather was in flight (params: %s)", index, self._described[index])

    def take_written(self) -> Optional[str]:
        """What this rank found written while the gathers were in flight since the last call
        (the error message's detail), or ``None``; forgets it."""
        if not self.written:
            return None
        found, self.written = self.written, []
        return "; ".join(f"bucket {index} ({self._described[index]})" for index in found)

    @property
    def nbytes(self) -> int:
        """The copy of this rank's shards kept to find writes while the gathers are in flight."""
        return sum(t.nbytes for t in self._launched_values)

    def wait_many(self, indices: Sequence[int]) -> None:
        for index in indices:
            self.wait(index)

    def finish(self) -> None:
        """Make every bucket current (launching what is left, in order)."""
        for index in self.order:
            self.wait(index)

    def pending_works(self) -> list[Any]:
        """The gathers in flight (what exit waits for, :func:`~fxzero.optim.communication.comm.settle`)."""
        return [w for w in self._works if w is not None]

    def collectives_per_step(self) -> dict[str, int]:
        """The gathers one step issues, by ``c10d`` op name (as ``torch.profiler`` names them)."""
        if self.dp.size == 1:
            return {}
        if self.dp.gather_by_broadcast:
            return {"broadcast": len(self.buckets) * self.dp.size}
        return {"allgather": len(self.buckets)}

    def is_pending(self, index: int) -> bool:
        """Whether bucket ``index`` still waits for (or has not landed) this step's gather."""
        return self._stale[index]

    @property
    def pending(self) -> tuple[bool, ...]:
        """Which buckets still hold values older than the last step."""
        return tuple(self._stale)


def written_in_flight(detail: Optional[str], ranks: int) -> RuntimeError:
    """The error every rank raises when ``ranks`` ranks found params written while the gathers
    were in flight (:meth:`ParamSync.take_written`; ``detail``: this rank's finding)."""
    where = f"this rank found it in {detail}" if detail else f"{ranks} other rank(s) found it"
    return RuntimeError(
        "fxzero: managed params were written after step() while the all-gathers that step launched were in flight "
        "(Config.overlap_param_gather=True), e.g. through `p.data` (a WGAN weight clamp, an EMA's copy_to/restore): "
        f"the gathers land over such writes or send values from before them, so ranks would train on different params "
        f"({where}). Call opt.finish_param_sync() after step() before writing params, or set overlap_param_gather=False."
    )


def as_words(values: torch.Tensor) -> torch.Tensor:
    """``values``' bytes as the widest integers its size and offset allow (a view): fewer,
    wider elements to compare, and bitwise (a NaN equals itself)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return values.view(dtype)
        except RuntimeError:
            continue
    return values.view(torch.uint8)
