"""Each rank's random number generators in a checkpoint, so a resume with dropout on
continues bitwise the uninterrupted run.

Dropout masks come from each rank's own generators (:mod:`fxzero.rng`), and they mean
something only for the rank that drew them: rank 3's state restored on rank 1 would give
rank 1 rank 3's masks. So every rank's states are saved in a file of their own,
``rng_state_<rank>.pt`` (``rank``: the global rank, as Hugging Face Trainer names its
``rng_state_<rank>.pth``), listed in the manifest's file list with its size and SHA-256 like
DCP's files, and the manifest's ``rng`` entry records the rank layout they were saved with
(world size, data-parallel size, instances). A load restores them only into the same
layout; at another one it restores none (there is no right answer for the new ranks) and
rank 0 warns once, naming both layouts. Under hierarchical sharding instance 0 writes the
checkpoint: each of its ranks gathers its counterparts' states and writes their files too.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import rng
from ..optim.communication.comm import DataParallelGroup
from .state import MANIFEST, CheckpointError

__all__ = [
    "RESTORED", "capture_states", "is_generator_file", "layout", "manifest_entry", "manifest_problems", "read_states", "report",
    "serialized",
]  # fmt: skip

RESTORED = "restored"
"""``load_checkpoint(...)["rng"]`` when this rank's generators were restored; otherwise a sentence saying why not."""

_FILE = re.compile(r"^rng_state_(\d+)\.pt$")

log = logging.getLogger(__name__)


def file_name(rank: int) -> str:
    return f"rng_state_{rank}.pt"


def is_generator_file(name: str) -> bool:
    return _FILE.match(name) is not None


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def layout(dp: DataParallelGroup) -> dict[str, int]:
    """What must be equal for a saved rank's generators to be the live rank's of the same number."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {"world_size": world, "data_parallel_size": dp.size, "instances": dp.replica_count}


def capture_states(dp: DataParallelGroup) -> dict[int, dict[str, Any]]:
    """The generator states this rank writes, by global rank: its own, and under hierarchical
    sharding its counterparts' in the other instances (collective over them)."""
    mine = (global_rank(), rng.capture())
    if dp.replica_count == 1:
        return dict([mine])
    gathered: list[Any] = [None] * dp.replica_count
    dist.all_gather_object(gathered, mine, group=dp.replicas)
    return dict(gathered)


def serialized(states: dict[int, dict[str, Any]]) -> dict[str, bytes]:
    """File name -> contents of each state (``torch.save``, read back with ``weights_only``)."""
    out = {}
    for rank, state in states.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        out[file_name(rank)] = buffer.getvalue()
    return out


def manifest_entry(dp: DataParallelGroup) -> dict[str, Any]:
    """The manifest's ``rng`` entry: the layout; the save adds the files its ranks wrote."""
    return {**layout(dp), "files": []}


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """An ``rng`` entry whose files are not all in the file list (so not all verified) is damaged."""
    entry = manifest.get("rng")
    if entry is None:
        return []
    if not (isinstance(entry, dict) and isinstance(entry.get("files"), list) and {"world_size", "data_parallel_size", "instances"} <= set(entry)):
        return [f"{MANIFEST}'s rng entry is not a layout with a file list"]
    return [f"{name} (generator states) is not in {MANIFEST}'s file list" for name in entry["files"] if name not in manifest["files"]]


def read_states(path: Path, manifest: dict[str, Any], dp: DataParallelGroup, wanted: bool) -> tuple[Optional[dict[str, Any]], str]:
    """This rank's saved generator states, checked whole (not yet restored), or ``None`` and
    why they will not be restored. A damaged file raises :class:`CheckpointError` naming it."""
    entry = manifest.get("rng")
    if not wanted:
        return None, "not restored: load_checkpoint(..., rng=False)"
    if entry is None:
        return None, "not restored: the checkpoint holds no generator states (saved with rng=False, or by fxzero 0.2.0 or older)"
    saved = {key: entry[key] for key in ("world_size", "data_parallel_size", "instances")}
    if saved != (live := layout(dp)):
        return None, f"not restored: saved at {_describe(saved)}, loaded at {_describe(live)}"
    name = file_name(global_rank())
    if name not in entry["files"]:
        return None, f"not restored: the checkpoint holds no generator states of rank {global_rank()}"
    state = _load(path / name, name)
    if found := rng.problems(state):
        raise CheckpointError(f"checkpoint {path} is damaged: {name} (generator states of rank {global_rank()}): " + "; ".join(found))
    if why := rng.device_mismatch(state):
        return None, f"not restored: {why}"
    return state, RESTORED


def report(path: Path, outcome: str) -> None:
    """Warn once (global rank 0) when saved generators were not restored at another layout (or
    CUDA device count); an info line when there were none to restore, or the caller opted out."""
    mismatch = outcome.startswith("not restored: saved ")
    if outcome == RESTORED:
        log.info("restored this rank's generator states from %s", path)
    elif mismatch and global_rank() == 0:
        log.warning("checkpoint %s: the generators were %s (each rank's states fit its own rank only; "
                    "dropout masks after the resume differ from the uninterrupted run's)", path, outcome)  # fmt: skip
    elif not mismatch:
        log.info("checkpoint %s: the generators were %s", path, outcome)


def _describe(shape: dict[str, int]) -> str:
    instances = f" in {shape['instances']} instances" if shape["instances"] > 1 else ""
    return f"world size {shape['world_size']} (data-parallel size {shape['data_parallel_size']}{instances})"


def _load(file: Path, name: str) -> Any:
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling errors come in many types
        raise CheckpointError(f"checkpoint {file.parent} is damaged: {name} (generator states) cannot be read: {err}") from err
