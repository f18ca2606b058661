"""A committed checkpoint's manifest and files, checked before a load reads anything.

The manifest ``fxzero.json`` lists every file a save wrote (DCP's data and metadata, each
rank's generator states) with its size and SHA-256: DCP itself would load a flipped byte
silently, and a file the list misses would go unchecked. The ranks split the hashing, and
every rank learns every problem, so all of them raise the same :class:`CheckpointError`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .generators import is_generator_file, manifest_problems
from .ranks import CheckpointRanks
from .state import MANIFEST, CheckpointError

__all__ = ["FORMAT", "read_manifest", "sha256", "verify_files"]

FORMAT = "fxzero.checkpoint/1"
_MANIFEST_KEYS = {"step", "extra", "optimizer_class", "saved_world_size", "param_groups", "state", "files"}
_FILE_KEYS = {"bytes", "sha256"}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(_not_a_checkpoint(path))
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest")
    if missing := sorted(_MANIFEST_KEYS - set(manifest)):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lacks {missing}")
    files = manifest["files"]
    if not isinstance(files, dict) or not files:  # nothing to check would pass every check
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} lists no files (a save lists all it wrote)")
    if bad := sorted(name for name, entry in files.items() if not (isinstance(entry, dict) and _FILE_KEYS <= set(entry))):
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} has no size and SHA-256 for {bad}")
    if problems := manifest_problems(manifest):
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    return manifest


def _not_a_checkpoint(path: Path) -> str:
    if not path.exists():
        return f"checkpoint {path} does not exist"
    if any(path.glob("step_*")):
        return f"{path} is not a committed fxzero checkpoint: no {MANIFEST} (it is a directory of checkpoints: use fxzero.latest_checkpoint)"
    return f"{path} is not a committed fxzero checkpoint: no {MANIFEST}, and it holds no checkpoint either"


def verify_files(path: Path, expected: dict[str, dict[str, Any]], ranks: CheckpointRanks) -> None:
    """Every file the manifest lists must be there with its size and SHA-256 (DCP itself
    would load a flipped byte silently), and every DCP file there must be listed. Every
    rank learns every problem, so all raise."""
    problems = _unlisted(path, expected) if ranks.dp.rank == 0 else []
    for name in sorted(expected)[ranks.dp.rank :: ranks.dp.size]:
        try:
            problems += _file_problem(path / name, name, expected[name])
        except OSError as err:
            problems.append(f"{name} cannot be read: {err}")
    problems = [p for part in ranks.all_gather(problems) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(sorted(problems)))


def _unlisted(path: Path, expected: dict[str, Any]) -> list[str]:
    saved = sorted(p.name for p in path.iterdir() if p.name == ".metadata" or p.suffix == ".distcp" or is_generator_file(p.name))
    return [f"{name} is not in {MANIFEST}'s file list" for name in saved if name not in expected]


def _file_problem(file: Path, name: str, want: dict[str, Any]) -> list[str]:
    if not file.is_file():
        return [f"{name} is missing"]
    if (size := file.stat().st_size) != want["bytes"]:
        return [f"{name} has {size:,} bytes, the manifest says {want['bytes']:,} (truncated?)"]
    if sha256(file) != want["sha256"]:
        return [f"{name} does not match its SHA-256 in the manifest (corrupted)"]
    return []
