"""Distributed checkpoints that resume at any world size and bucket size (:mod:`.io`), in a
world-size-independent format (:mod:`.state`)."""

from .io import latest_checkpoint, load_checkpoint, save_checkpoint
from .state import CheckpointError

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
