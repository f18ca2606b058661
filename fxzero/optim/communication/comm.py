"""The process group a runtime talks over, resolved once.

Everything that communicates receives a :class:`DataParallelGroup` explicitly; there is
no module-level registry. World size 1 (including "torch.distributed not initialized")
is a first-class case in which no collective is ever issued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
from typing import Any, Iterator, Literal, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..._torch_compat import process_group_store

__all__ = ["AllOf", "CollectiveError", "DataParallelGroup", "describe_params", "settle"]

log = logging.getLogger(__name__)


_NOTES = "fxzero/notes"
"""Where ranks leave why they stopped (:meth:`DataParallelGroup.leave_note`) in the group's store."""


@contextlib.contextmanager
def _store_errors_ignored() -> Iterator[None]:
    """A store whose host died (the job's rank 0 hosts it outside torchrun) or timed out."""
    try:
        yield
    except Exception as error:  # DistStoreError, RuntimeError, ConnectionError
        log.debug("the process group's store could not be reached: %s", error)


class CollectiveError(RuntimeError):
    """A collective fxzero was waiting for failed or timed out: a peer rank died or
    stopped answering. The message names the collective, the bucket and this rank; the
    process group cannot be used afterwards, so the job should exit (and restart from its
    last checkpoint)."""


def describe_params(params: Sequence[torch.Tensor], limit: int = 4) -> str:
    """``shape (4, 8), shape (8,), … (12 params, 1,050,112 elements)``: what a failed
    collective names when no param table gave names (:meth:`ParamTable.describe` does)."""
    labels = [f"shape {tuple(p.shape)}" for p in params]
    shown = ", ".join(labels[:limit]) + (", …" if len(labels) > limit else "")
    return f"{shown} ({len(labels)} params, {sum(p.numel() for p in params):,} elements)"


class AllOf:
    """Several in-flight collectives waited as one (a bucket's per-rank broadcasts)."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def settle(works: Sequence[Any], timeout: float = 30.0) -> None:
    """Wait, at most ``timeout`` seconds each and ignoring their errors, for collectives still
    in flight (``dist.Work`` or :class:`AllOf`), so none is destroyed mid-flight: with gloo
    work left in flight (a backward that raised after launching reductions, gathers launched
    for a forward that never ran), processes exited with "terminate called without an active
    exception" (SIGABRT, 7 of 10 runs of ``tests/exit_script.py caught-backward-error 0``).
    Bounded, because a peer may be gone or blocked elsewhere: exit must still happen."""
    limit = datetime.timedelta(seconds=timeout)
    for work in works:
        for one in work.works if isinstance(work, AllOf) else (work,):
            try:
                one.wait(limit)
            except Exception as err:  # noqa: BLE001 - exiting: a failed or late collective changes nothing
                log.debug("a collective still in flight at exit did not finish: %s", err)
    if works:
        # A gloo worker thread marks its work complete, then drops its own reference to it. If
        # that is the last one (the caller's went in Python's final collection), the work's
        # tensors are released on that thread, which takes the GIL during finalization and
        # ends in std::terminate (a core dump showed ~AsyncAlltoallWork -> decref_pyobject ->
        # take_gil -> pthread_exit). The caller still holds ``works``: give the worker threads
        # a moment to let go first, so the last reference is dropped on the main thread.
        time.sleep(0.05)


INSTANCE_DIMS = ("replicate", "shard")
"""Dim names of a 2-D mesh that asks for hierarchical (multi-instance) sharding, as FSDP2's
HSDP names them: state sharded over "shard" (one instance: a node's fast links), replicated
over "replicate" (one copy of the optimizer state per instance)."""


def _mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """(shard group, replica group or None) of a 1-D mesh or a ("replicate", "shard") mesh;
    any other mesh of more dims is refused, naming the fix."""
    if mesh.ndim == 2 and tuple(mesh.mesh_dim_names or ()) == INSTANCE_DIMS:
        return mesh["shard"].get_group(), mesh["replicate"].get_group()
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        dp = "dp" if "dp" in names or not names else names[0]
        raise ValueError(
            f"process_group is a {mesh.ndim}-D DeviceMesh (dims {tuple(names)}); fxzero shards over one data-parallel "
            f"dimension and leaves the others to the DTensor params: pass that dimension, process_group=mesh[{dp!r}] "
            f"(or a 2-D mesh with dims {INSTANCE_DIMS} for hierarchical sharding: state sharded over 'shard', "
            "replicated over 'replicate')"
        )
    return mesh.get_group(), None


def _is_non_member(group: Any) -> bool:
    """``dist.new_group(ranks)`` returns this int-like sentinel (not a ProcessGroup) on every rank not in ``ranks``."""
    return isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER


def _not_a_member(what: str) -> str:
    """The error for a group that does not contain this rank. Raised here, on the ranks left out,
    before any collective. The group's own ranks issue collectives over that group only, so they
    never wait for these ranks (when these exit, a launcher such as torchrun stops the job)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"fxzero: {what}, so it does not contain this rank (global rank {rank}). Each rank must pass the data-parallel "
        "group it belongs to: e.g. `group, _ = dist.new_subgroups(group_size)` (every rank gets its own subgroup), "
        "a DeviceMesh dim such as `mesh['dp']`, or, with dist.new_group, call new_group on every rank for every "
        "group and pass the one whose ranks include this rank."
    )


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """A process group with its size, this process's rank and the reduce op to average."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    grad_collective: Literal["reduce_scatter", "all_reduce", "all_to_all"] = "reduce_scatter"
    """How a bucket's gradients are averaged into this rank's shard (the transports:
    :mod:`fxzero.optim.gradients.reduction`)."""
    backend: str = ""
    """The group's backend name (``""`` without a process group): it picks the default bucket
    size and how params are gathered."""
    replicas: Optional[dist.ProcessGroup] = None
    """Hierarchical sharding (Megatron-LM's multi-instance distributed optimizer): the ranks
    holding the same shard in the other instances. After each step's reductions inside the
    instance (``group``) this rank's shards are all-reduced over it; gathers never leave the
    instance, and each instance holds a whole copy of the optimizer state. None: one instance."""
    replica_count: int = 1
    replica_rank: int = 0

    @property
    def total(self) -> int:
        """Data-parallel ranks in all: the gradient is the mean over this many."""
        return self.size * self.replica_count

    def broadcast_from_first(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` with data-parallel rank 0's (instance 0's shard-group rank 0):
        inside each instance, then from instance 0 to the others."""
        if self.size > 1:
            dist.broadcast(tensor, group=self.group, group_src=0)
        if self.replica_count > 1:
            dist.broadcast(tensor, group=self.replicas, group_src=0)

    def sum_over_instances(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over the instances (in place), waiting for it; a no-op with one instance."""
        if self.replica_count > 1:
            self.wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.replicas, async_op=True), what)

    def sum_replicas_async(self, shards: Sequence[torch.Tensor]) -> list[dist.Work]:
        """Start summing this rank's reduced ``shards`` over the instances (in place)."""
        return [dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.replicas, async_op=True) for s in shards]

    @classmethod
    def resolve(
        cls,
        group: "Optional[dist.ProcessGroup | DeviceMesh]",
        grad_collective: Literal["auto", "reduce_scatter", "all_reduce", "all_to_all"] = "auto",
    ) -> "DataParallelGroup":
        """``group=None`` means the default (world) group, or world size 1 when
        ``torch.distributed`` is not initialized; a 1-D ``DeviceMesh`` (``mesh["dp"]``) means
        its group; a 2-D mesh with dims ``("replicate", "shard")`` means hierarchical sharding
        (:attr:`replicas`). ``"auto"`` picks ``"all_to_all"`` on
        gloo (whose reduce-scatter sets up a halving-doubling algorithm on every call; the
        "Gradients" paragraph of docs/design.md has the measurements) and ``"reduce_scatter"``
        everywhere else."""
        replicas = None
        if isinstance(group, DeviceMesh):
            if group.get_coordinate() is None:
                raise ValueError(_not_a_member(f"process_group is a DeviceMesh over ranks {group.mesh.flatten().tolist()}"))
            group, replicas = _mesh_groups(group)
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, 0)
        if _is_non_member(group):
            raise ValueError(_not_a_member("process_group is GroupMember.NON_GROUP_MEMBER, what dist.new_group(ranks) returns on the ranks not in ranks"))
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
            )
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(_not_a_member(f"process_group has ranks {dist.get_process_group_ranks(group)}"))
        backend = str(dist.get_backend(group))
        if grad_collective == "auto":
            grad_collective = "all_to_all" if backend == "gloo" else "reduce_scatter"
        if replicas is None:
            return cls(group, size, rank, grad_collective, backend=backend)
        count, replica_rank = dist.get_world_size(replicas), dist.get_rank(replicas)
        return cls(group, size, rank, grad_collective, backend=backend, replicas=replicas, replica_count=count, replica_rank=replica_rank)

    @property
    def gather_by_broadcast(self) -> bool:
        """All-gathers run as one in-place broadcast per rank (gloo, see :meth:`all_gather_async`)."""
        return self.backend == "gloo"

    def exchange_async(self, sends: Sequence[tuple[torch.Tensor, list[int]]], receives: Sequence[tuple[torch.Tensor, list[int]]]) -> list[dist.Work]:
        """One chunk of the all-to-all reduction, in place: round ``i`` sends ``sends[i]``'s
        tensor to one rank and receives ``receives[i]``'s from another (the split lists
        are zero but for that rank: an all-to-all with uneven splits moves one view, no copy)."""
        return [
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)
            for (send, send_splits), (recv, recv_splits) in zip(sends, receives)
        ]

    def all_gather_async(self, output: torch.Tensor, shards: Sequence[torch.Tensor]) -> "dist.Work | AllOf":
        """Gather every rank's shard into ``output`` in place: ``shards[r]`` is rank r's
        view of ``output`` (``shards[self.rank]`` holds this rank's values). One in-place
        all-gather (NCCL needs no scratch for it); on gloo one broadcast per rank from its
        own view, because gloo's all-gather copies through a temporary as large as
        ``output`` and the broadcasts copy nothing (the Memory section of docs/design.md measures it)."""
        if self.gather_by_broadcast:
            return AllOf([dist.broadcast(s, group_src=r, group=self.group, async_op=True) for r, s in enumerate(shards)])
        return dist.all_gather_single(output, shards[self.rank], group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str = "all-reduce of the grad norm and gradient flags") -> None:
        if self.size > 1:
            self.wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), what)

    def all_reduce_max(self, tensor: torch.Tensor, what: str = "all-reduce of the gradient max-norms") -> None:
        if self.size > 1:
            self.wait(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what)

    def wait(self, work: dist.Work, what: str, bucket: Optional[int] = None, params: str = "") -> None:
        """``work.wait()``, turning a failure (a dead peer's closed connection, or the
        process group's timeout for one that stopped answering) into a
        :class:`CollectiveError` that says what this rank was waiting for. Only the error
        path builds the message: this runs for every bucket of every step."""
        try:
            work.wait()
        except RuntimeError as err:  # DistBackendError and gloo's timeouts are RuntimeErrors
            where = f" of bucket {bucket}" if bucket is not None else ""
            where += f" (params: {params})" if params else ""
            cause = self._peer_note()
            if cause is not None:
                raise CollectiveError(f"fxzero: rank {self.rank} of {self.size} failed waiting for the {what}{where}: {cause}") from err
            raise CollectiveError(
                f"fxzero: rank {self.rank} of {self.size} failed waiting for the {what}{where}: {err}. "
                "A peer rank probably died or stopped answering; this process group cannot be used any more."
            ) from err

    def leave_note(self, message: str) -> None:
        """Record in the group's store why this rank is about to raise out of a call the others
        did not make (``opt.state_dict()`` on rank 0 alone): a peer whose next collective then
        fails on this rank's exit says so, with this rank's fix, instead of gloo's "Connection
        closed by peer". Best effort: a store that cannot be reached records nothing."""
        if self.size > 1:
            with _store_errors_ignored():
                process_group_store(self.group).set(f"{_NOTES}/{self.rank}", message)

    def forget_note(self) -> None:
        """This rank met the others again: its earlier note no longer explains anything."""
        if self.size > 1:
            with _store_errors_ignored():
                process_group_store(self.group).delete_key(f"{_NOTES}/{self.rank}")

    def _peer_note(self) -> Optional[str]:
        """The first note another rank left (:meth:`leave_note`), as this rank's error tells it."""
        with _store_errors_ignored():
            store = process_group_store(self.group)
            for rank in range(self.size):
                if rank != self.rank and store.check([f"{_NOTES}/{rank}"]):
                    note = store.get(f"{_NOTES}/{rank}").decode()
                    return f"rank {rank} stopped first, with this error: {note}"
        return None

    def agree(self, problem: Optional[str], what: str) -> None:
        """Raise on every rank if ``problem`` is set on any (collective, for rare paths such as
        loading state): a rank that found its input wrong raises with its own ``problem``, the
        others with an error naming it. Without this, the failing rank raised alone and its
        peers blocked in the next collective (a load's param gathers) until the timeout."""
        if self.size == 1:
            if problem is not None:
                raise ValueError(problem)
            return
        problems: list[Optional[str]] = [None] * self.size
        dist.all_gather_object(problems, problem, group=self.group)
        failed = [r for r, p in enumerate(problems) if p is not None]
        if problem is not None:
            raise ValueError(problem)
        if failed:
            raise ValueError(f"{what} failed on rank(s) {failed} (rank {failed[0]}: {problems[failed[0]]}); nothing was loaded")
