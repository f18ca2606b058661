"""Distributed checkpoints that load at any world size and bucket size.

    path = fxzero.save_checkpoint("ckpt", model, opt, step=step)     # every rank, collectively
    info = fxzero.load_checkpoint(fxzero.latest_checkpoint("ckpt"), model, opt)   # any world size

Each rank writes only the state it owns, through ``torch.distributed.checkpoint`` (DCP),
in a world-size-independent format (:mod:`fxzero.checkpoint.state`), and its generator
states in a file of its own (:mod:`fxzero.checkpoint.generators`); loading on
another number of ranks, or with another bucket size, reads each rank's new fragments out
of whatever pieces were saved.

**Atomic.** A save writes ``ckpt_dir/step_XXXXXXX.tmp-<nonce>``; once every rank's data and
DCP's ``.metadata`` are written, rank 0 writes the manifest ``fxzero.json`` (step, extra,
optimizer class, param groups, and the size and SHA-256 of every file) and renames the
directory to ``step_XXXXXXX``. The rename is the commit: a job killed at any earlier point
leaves only a ``.tmp-`` directory, which :func:`latest_checkpoint` ignores. A save that
fails (a full disk, a path that is a file) raises :class:`CheckpointError` on every rank
and removes its ``.tmp-`` directory.

**Collective.** Every rank calls save and load, at the same point and with the same step or
checkpoint: a rank missing for ``arrival_timeout`` seconds, or calling something else, is an
error on every rank that came (:mod:`fxzero.checkpoint.ranks`), not a hang.

**Checked before anything changes.** A load verifies every file against the manifest (the
ranks split the hashing), compares the checkpoint with the live model and optimizer (param
names, shapes, groups, optimizer class) and reads everything into fresh tensors; the live
model and optimizer are touched only after all of that succeeded on every rank. Each
problem raises :class:`CheckpointError` naming what differs, on every rank alike (no hang).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .state import (
    MANIFEST,
    CheckpointError,
    ChunkLoadPlanner,
    ChunkSavePlanner,
    apply_hyperparameters,
    apply_loaded,
    check_compatible,
    group_records,
    load_targets,
    save_state,
    slot_names,
)
from .. import rng as generators_of_this_process
from ..distributed_optimizer import DistributedOptimizer
from ..optim.communication.comm import DataParallelGroup
from . import generators
from .manifest import FORMAT, read_manifest, sha256, verify_files
from .ranks import CheckpointRanks

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


ARRIVAL_TIMEOUT: Optional[float] = None
"""Seconds save_checkpoint/load_checkpoint wait for every rank to call them (:mod:`.ranks`);
``None``: as long as a collective of the optimizer's process group would."""


def save_checkpoint(
    ckpt_dir: PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    *,
    step: int,
    extra: Optional[dict[str, Any]] = None,
    arrival_timeout: Optional[float] = ARRIVAL_TIMEOUT,
    rng: bool = True,
) -> Path:
    """Save ``model`` and ``optimizer`` as ``ckpt_dir/step_XXXXXXX`` (called on every rank).

    ``extra`` is JSON-serializable user data (say, the data loader's position), returned by
    :func:`load_checkpoint`. ``rng``: also save each rank's generator states (Python,
    NumPy, torch CPU and CUDA: :mod:`.generators`), which :func:`load_checkpoint` restores
    at the same rank layout, so dropout continues bitwise. Returns the checkpoint's path
    once it is committed. Every rank must call it within ``arrival_timeout`` seconds of the others (``None``: the process
    group's timeout, with a warning naming the late ranks after 30 s), with the same ``step``.
    A failure on any rank (disk full, a path that is a file) raises :class:`CheckpointError`
    on every rank and removes the partial ``.tmp-`` directory.

    Args:
        ckpt_dir: the directory the checkpoint's ``step_XXXXXXX`` directory goes in.
        model: the module trained (its params and buffers).
        optimizer: the :class:`~fxzero.DistributedOptimizer` training it (its sharded state).
        step: the training step, an int >= 0: the checkpoint's name.
        extra: JSON-serializable user data, or ``None``.
        arrival_timeout: seconds the ranks may arrive apart (``None``: the process group's).
        rng: also save each rank's generator states.

    Returns:
        The committed checkpoint's path.

    Raises:
        CheckpointError: the save failed on some rank (every rank raises), or ``extra`` is not
            JSON-serializable.
        TypeError: ``optimizer`` is not a DistributedOptimizer, or ``extra`` not a dict.
        ValueError: ``step`` below 0 or not an int, or a bad ``arrival_timeout``.

    Example::

        fxzero.save_checkpoint("ckpt", model, opt, step=100, extra={"epoch": 2})
    """
    _check_args(optimizer, step, extra, arrival_timeout)
    dp = optimizer.dp
    states = generators.capture_states(dp) if rng else {}  # first: nothing below may draw before it
    if dp.replica_count > 1:
        return _save_from_instance_0(dp, lambda: _save(ckpt_dir, model, optimizer, step, extra, arrival_timeout, states))
    return _save(ckpt_dir, model, optimizer, step, extra, arrival_timeout, states)


def _save_from_instance_0(dp: DataParallelGroup, save: Any) -> Path:
    """Hierarchical sharding: every instance holds the whole state, so instance 0 alone
    writes it (the others' files would collide with its own); each rank of another instance
    waits for its counterpart in instance 0 and returns the committed path, or raises its error."""
    outcome: list[Any] = [None]
    if dp.replica_rank == 0:
        try:
            outcome = [str(save())]
        except Exception as err:
            outcome = [f"failed: {err}"]
            dist.broadcast_object_list(outcome, group=dp.replicas, group_src=0)
            raise
    dist.broadcast_object_list(outcome, group=dp.replicas, group_src=0)
    if outcome[0].startswith("failed: "):
        raise CheckpointError(f"save_checkpoint on instance 0 {outcome[0]}")
    return Path(outcome[0])


def _save(
    ckpt_dir: PathLike, model: torch.nn.Module, optimizer: DistributedOptimizer, step: int,
    extra: Optional[dict[str, Any]], arrival_timeout: Optional[float], states: dict[int, dict[str, Any]],
) -> Path:  # fmt: skip
    ranks = _ranks(optimizer)
    ranks.handshake(f"save_checkpoint(step={step})", arrival_timeout, optimizer.param_table.params[0].device)
    optimizer.finish_param_sync()
    names, state, spec, groups = ranks.together("collecting the state to save", lambda: _collect(model, optimizer))
    manifest = {
        "format": FORMAT,
        "step": step,
        "extra": extra or {},
        "optimizer_class": f"{optimizer.optimizer_class.__module__}.{optimizer.optimizer_class.__qualname__}",
        "saved_world_size": optimizer.dp.size,
        "param_groups": groups,
        "state": _merge(ranks.all_gather(spec)),
        "rng": generators.manifest_entry(optimizer.dp) if states else None,
    }
    final = Path(ckpt_dir) / f"step_{step:07d}"
    tmp = Path(ranks.broadcast(f"{final}.tmp-{uuid.uuid4().hex[:12]}"))
    try:
        _write(tmp, final, state, manifest, ranks, generators.serialized(states))
    except CheckpointError as err:
        shutil.rmtree(tmp, ignore_errors=True)  # on every rank: one may not see the others' disk
        raise CheckpointError(f"saving checkpoint {final} failed (nothing committed; {tmp.name} removed): {err}") from err
    log.info("saved checkpoint %s", final)
    return final


def load_checkpoint(
    path: Optional[PathLike],
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    *,
    arrival_timeout: Optional[float] = ARRIVAL_TIMEOUT,
    rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved at any world size into ``model`` and ``optimizer`` (called
    on every rank, within ``arrival_timeout`` seconds of each other, with the same
    checkpoint). Returns ``{"step", "extra", "path", "rng"}``; ``rng`` is ``"restored"``
    when this rank's generators were set to its saved states (``rng=True``, the default,
    and the rank layout they were saved with), else a sentence saying why not. On any
    mismatch or damage (a generator file's included) it raises :class:`CheckpointError`
    and leaves the model, optimizer and generators as they were;
    ``path=None`` (what :func:`latest_checkpoint` returns when there is no checkpoint)
    raises it too, saying there is nothing to load.

    Args:
        path: a checkpoint directory (``step_XXXXXXX``), as :func:`latest_checkpoint` returns it.
        model: the module to load the params and buffers into.
        optimizer: the :class:`~fxzero.DistributedOptimizer` to load the state into, at any world size.
        arrival_timeout: seconds the ranks may arrive apart (``None``: the process group's).
        rng: restore this rank's generator states when the rank layout is the saved one.

    Returns:
        ``{"step": int, "extra": dict or None, "path": Path, "rng": "restored" or why not}``.

    Raises:
        CheckpointError: ``path`` is ``None``, or the checkpoint does not match the model or
            optimizer, or a file is damaged; nothing was changed.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
        ValueError: a bad ``arrival_timeout``.

    Example::

        resumed = fxzero.load_checkpoint(fxzero.latest_checkpoint("ckpt"), model, opt)
    """
    _check_optimizer(optimizer)
    _check_timeout(arrival_timeout)
    ranks = _ranks(optimizer)
    ranks.handshake(f"load_checkpoint({None if path is None else Path(path).name!r})", arrival_timeout, optimizer.param_table.params[0].device)
    if path is None:
        raise CheckpointError(
            "load_checkpoint: path is None, so there is no checkpoint to load. fxzero.latest_checkpoint(ckpt_dir) "
            "returns None when ckpt_dir holds no committed checkpoint: test for None and start from scratch"
        )
    path = Path(path)
    manifest = ranks.together(f"reading {path / MANIFEST}", lambda: read_manifest(path))
    verify_files(path, manifest["files"], ranks)
    metadata = ranks.together(f"checkpoint {path}: reading DCP's metadata", dcp.FileSystemReader(path).read_metadata)
    optimizer.finish_param_sync()
    names = slot_names(model, optimizer)
    ranks.together(f"checkpoint {path}", lambda: check_compatible(manifest, metadata, model, optimizer, names))
    saved_rng, outcome = ranks.together(
        f"checkpoint {path}: reading the generator states", lambda: generators.read_states(path, manifest, optimizer.dp, rng)
    )
    targets = load_targets(model, optimizer, names, manifest["state"], metadata)
    ranks.together(f"checkpoint {path}: reading the data", lambda: _dcp_load(path, targets, ranks))
    apply_loaded(targets, model, optimizer, names, manifest["state"])
    apply_hyperparameters(optimizer, manifest["param_groups"])
    if saved_rng is not None:
        generators_of_this_process.restore(saved_rng)
    generators.report(path, outcome)
    log.info("loaded checkpoint %s (step %d, saved at data-parallel size %d)", path, manifest["step"], manifest["saved_world_size"])
    return {"step": manifest["step"], "extra": manifest["extra"], "path": path, "rng": outcome}


def latest_checkpoint(ckpt_dir: PathLike) -> Optional[Path]:
    """The committed checkpoint with the highest step under ``ckpt_dir``, or ``None`` if
    there is none (or no ``ckpt_dir``): test for ``None`` to start from scratch. Directories
    of saves that never committed (``.tmp-``) are ignored.

    Args:
        ckpt_dir: the directory :func:`save_checkpoint` saved into.

    Returns:
        The ``step_XXXXXXX`` directory, or ``None``.

    Example::

        path = fxzero.latest_checkpoint("ckpt")  # None: start from scratch
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    steps = [
        (int(m.group(1)), entry)
        for entry in root.iterdir()
        if (m := _STEP_DIR.match(entry.name)) and (entry / MANIFEST).is_file()
    ]
    return max(steps)[1] if steps else None


# ---- the phases of a save and a load -------------------------------------------------------
def _collect(model: torch.nn.Module, optimizer: DistributedOptimizer) -> tuple[list[str], dict, dict, list]:
    """What this rank saves: its DCP state dict, the kinds of its state entries, the groups."""
    names = slot_names(model, optimizer)
    state, spec = save_state(model, optimizer, names)
    return names, state, spec, group_records(optimizer, names)


def _write(
    tmp: Path, final: Path, state: dict[str, Any], manifest: dict[str, Any], ranks: CheckpointRanks, files: dict[str, bytes]
) -> None:
    """Every rank writes its data and ``files`` (its generator states) into ``tmp``, hashes
    its share of the files; rank 0 commits. Each step is agreed on, so a failure anywhere
    raises on every rank."""

    def save() -> None:
        with _quiet_at_world_one():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=ChunkSavePlanner(), **ranks.dcp_kwargs())
        for name, data in files.items():
            _write_durably(tmp / name, data)

    ranks.together("writing the data", save)
    if manifest["rng"] is not None:  # the files written, whichever ranks wrote them
        manifest["rng"]["files"] = sorted(name for names in ranks.all_gather(sorted(files)) for name in names)
    files = ranks.together("hashing the files", lambda: _describe_files(_my_share(tmp, ranks)))
    manifest["files"] = _merge(ranks.all_gather(files))
    ranks.together(f"renaming it to {final.name}", lambda: _commit(tmp, final, manifest) if ranks.dp.rank == 0 else None)


def _dcp_load(path: Path, targets: dict[str, Any], ranks: CheckpointRanks) -> None:
    with _quiet_at_world_one():
        dcp.load(targets, storage_reader=dcp.FileSystemReader(path), planner=ChunkLoadPlanner(), **ranks.dcp_kwargs())


@contextlib.contextmanager
def _quiet_at_world_one() -> Iterator[None]:
    """DCP warns that torch.distributed is disabled when it runs without a process group (world 1)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---- helpers ------------------------------------------------------------------------------
def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"optimizer must be a fxzero.DistributedOptimizer, got {type(optimizer).__name__}")


def _ranks(optimizer: DistributedOptimizer) -> CheckpointRanks:
    """The ranks that save and load together: the optimizer's group, or with DTensor params
    placed over other mesh dimensions (tensor parallelism) the whole world, which must then
    be that mesh (the data-parallel group times those dimensions): each TP rank holds other
    pieces of the params, and one DCP call over all of them writes one checkpoint."""
    dims = optimizer.runtime.mesh_params.dims
    if not dims:
        return CheckpointRanks(optimizer.dp)
    world = DataParallelGroup.resolve(dist.group.WORLD)
    spanned = optimizer.dp.size * math.prod(len(d.ranks) for d in dims)
    if spanned != world.size:
        sizes = ", ".join(f"{d.name} {len(d.ranks)}" for d in dims)
        raise CheckpointError(
            f"checkpoints of DTensor params run over the whole world, which must be the mesh the params live on: "
            f"data-parallel size {optimizer.dp.size} x ({sizes}) is {spanned} ranks, the world has {world.size}"
        )
    return CheckpointRanks(world)


def _check_timeout(arrival_timeout: Any) -> None:
    if arrival_timeout is None:
        return
    number = isinstance(arrival_timeout, (int, float)) and not isinstance(arrival_timeout, bool)
    if not (number and math.isfinite(arrival_timeout) and arrival_timeout > 0):
        raise ValueError(f"arrival_timeout must be None or a finite number of seconds > 0, got {arrival_timeout!r}")


def _check_args(optimizer: Any, step: Any, extra: Any, arrival_timeout: Any) -> None:
    _check_optimizer(optimizer)
    _check_timeout(arrival_timeout)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    try:
        json.dumps(extra or {}, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"save_checkpoint: extra must be JSON-serializable: {err}") from err
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict or None, got {type(extra).__name__}")


def _merge(per_rank: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Union of per-rank dicts of dicts (each rank knows the params it owns part of)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in per_rank:
        for key, value in part.items():
            merged.setdefault(key, {}).update(value)
    return merged


def _my_share(directory: Path, ranks: CheckpointRanks) -> list[Path]:
    """This rank's share of the directory's files (the ranks split the hashing)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    return files[ranks.dp.rank :: ranks.dp.size]


def _describe_files(files: Sequence[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}


def _commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, then rename ``tmp`` to ``final``: the one step that makes the
    checkpoint exist. A checkpoint already at ``final`` (a re-run step) is replaced."""
    _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync(tmp)
    old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:12]}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
