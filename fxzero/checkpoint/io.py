"""Distributed checkpoints that load at any world size and bucket size.

    path = fxzero.save_checkpoint("ckpt", model, opt, step=step)     # every rank, collectively
    info = fxzero.load_checkpoint(fxzero.latest_checkpoint("ckpt"), model, opt)   # any world size

Each rank writes only the state it owns, through ``torch.distributed.checkpoint`` (DCP),
in a world-size-independent format (:mod:`fxzero.checkpoint.state`); loading on
another number of ranks, or with another bucket size, reads each rank's new fragments out
of whatever pieces were saved.

**Atomic.** A save writes ``ckpt_dir/step_XXXXXXX.tmp-<nonce>``; once every rank's data and
DCP's ``.metadata`` are written, rank 0 writes the manifest ``fxzero.json`` (step, extra,
optimizer class, param groups, and the size and SHA-256 of every file) and renames the
directory to ``step_XXXXXXX``. The rename is the commit: a job killed at any earlier point
leaves only a ``.tmp-`` directory, which :func:`latest_checkpoint` ignores.

**Checked before anything changes.** A load verifies every file against the manifest (the
ranks split the hashing), compares the checkpoint with the live model and optimizer (param
names, shapes, groups, optimizer class) and reads everything into fresh tensors; the live
model and optimizer are touched only after all of that succeeded on every rank. Each
problem raises :class:`CheckpointError` naming what differs, on every rank alike (no hang).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

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
from ..optim.comm import DataParallelGroup
from ..optim.optimizer import DistributedOptimizer

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "fxzero.checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_MANIFEST_KEYS = {"step", "extra", "optimizer_class", "saved_world_size", "param_groups", "state", "files"}

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """The optimizer's group, for the few small object collectives a checkpoint needs
    (none at world size 1, where ``torch.distributed`` may not even be initialized)."""

    dp: DataParallelGroup

    def all_gather(self, obj: Any) -> list[Any]:
        if self.dp.size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp.size
        dist.all_gather_object(out, obj, group=self.dp.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.dp.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.dp.group, group_src=0)
        return box[0]

    def dcp_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.dp.group, "no_dist": self.dp.size == 1}


def save_checkpoint(
    ckpt_dir: PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    *,
    step: int,
    extra: Optional[dict[str, Any]] = None,
) -> Path:
    """Save ``model`` and ``optimizer`` as ``ckpt_dir/step_XXXXXXX`` (called on every rank).

    ``extra`` is JSON-serializable user data (say, the data loader's position), returned by
    :func:`load_checkpoint`. Returns the checkpoint's path once it is committed.
    """
    _check_args(optimizer, step, extra)
    ranks = _Ranks(optimizer.dp)
    optimizer.finish_param_sync()
    names = slot_names(model, optimizer)
    state, spec = save_state(model, optimizer, names)
    manifest = {
        "format": FORMAT,
        "step": step,
        "extra": extra or {},
        "optimizer_class": f"{optimizer.optimizer_class.__module__}.{optimizer.optimizer_class.__qualname__}",
        "saved_world_size": optimizer.dp.size,
        "param_groups": group_records(optimizer, names),
        "state": _merge(ranks.all_gather(spec)),
    }
    final = Path(ckpt_dir) / f"step_{step:07d}"
    tmp = Path(ranks.broadcast(f"{final}.tmp-{uuid.uuid4().hex[:12]}"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=ChunkSavePlanner(), **ranks.dcp_kwargs())
    manifest["files"] = _merge(ranks.all_gather(_describe_files(_my_share(tmp, ranks))))
    failure = None
    if ranks.dp.rank == 0:
        try:
            _commit(tmp, final, manifest)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, or they would wait forever
            failure = f"committing {tmp} as {final} failed: {err!r}"
    if (failure := ranks.broadcast(failure)) is not None:
        raise CheckpointError(failure)
    log.info("saved checkpoint %s", final)
    return final


def load_checkpoint(path: PathLike, model: torch.nn.Module, optimizer: DistributedOptimizer) -> dict[str, Any]:
    """Load a checkpoint saved at any world size into ``model`` and ``optimizer`` (called
    on every rank). Returns ``{"step", "extra", "path"}``. On any mismatch or damage it
    raises :class:`CheckpointError` and leaves the model and optimizer as they were."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"optimizer must be a fxzero.DistributedOptimizer, got {type(optimizer).__name__}")
    path, ranks = Path(path), _Ranks(optimizer.dp)
    manifest = _read_manifest(path)
    _verify_files(path, manifest["files"], ranks)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing
        raise CheckpointError(f"checkpoint {path}: DCP metadata is unreadable: {err}") from err
    optimizer.finish_param_sync()
    names = slot_names(model, optimizer)
    check_compatible(manifest, metadata, model, optimizer, names)
    targets = load_targets(model, optimizer, names, manifest["state"], metadata)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path), planner=ChunkLoadPlanner(), **ranks.dcp_kwargs())
    except Exception as err:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        raise CheckpointError(f"checkpoint {path}: reading the data failed: {err}") from err
    apply_loaded(targets, model, optimizer, names, manifest["state"])
    apply_hyperparameters(optimizer, manifest["param_groups"])
    log.info("loaded checkpoint %s (step %d, saved on %d ranks)", path, manifest["step"], manifest["saved_world_size"])
    return {"step": manifest["step"], "extra": manifest["extra"], "path": path}


def latest_checkpoint(ckpt_dir: PathLike) -> Optional[Path]:
    """The committed checkpoint with the highest step under ``ckpt_dir`` (``None`` if there
    is none). Directories of saves that never committed (``.tmp-``) are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    steps = [
        (int(m.group(1)), entry)
        for entry in root.iterdir()
        if (m := _STEP_DIR.match(entry.name)) and (entry / MANIFEST).is_file()
    ]
    return max(steps)[1] if steps else None


# ---- helpers ------------------------------------------------------------------------------
def _check_args(optimizer: Any, step: Any, extra: Any) -> None:
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"optimizer must be a fxzero.DistributedOptimizer, got {type(optimizer).__name__}")
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


def _my_share(directory: Path, ranks: _Ranks) -> list[Path]:
    """This rank's share of the directory's files (the ranks split the hashing)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    return files[ranks.dp.rank :: ranks.dp.size]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _describe_files(files: Sequence[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}


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


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        hint = " (it is a directory of checkpoints: use fxzero.latest_checkpoint)" if any(path.glob("step_*")) else ""
        raise CheckpointError(f"{path} is not a committed fxzero checkpoint: no {MANIFEST}{hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest")
    if missing := sorted(_MANIFEST_KEYS - set(manifest)):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lacks {missing}")
    return manifest


def _verify_files(path: Path, expected: dict[str, dict[str, Any]], ranks: _Ranks) -> None:
    """Every file the manifest lists must be there with its size and SHA-256: DCP itself
    would load a flipped byte silently. Every rank learns every problem, so all raise."""
    names = sorted(expected)[ranks.dp.rank :: ranks.dp.size]
    problems = []
    for name in names:
        file, want = path / name, expected[name]
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif (size := file.stat().st_size) != want["bytes"]:
            problems.append(f"{name} has {size:,} bytes, the manifest says {want['bytes']:,} (truncated?)")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the manifest (corrupted)")
    problems = [p for part in ranks.all_gather(problems) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(sorted(problems)))
