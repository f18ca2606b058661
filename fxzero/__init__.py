"""fxzero: ZeRO-1 distributed-optimizer training (Megatron-LM's distributed optimizer)
as a torch.compile backend.

    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
"""

from typing import Any

from . import _torch_compat  # noqa: F401  first: it refuses a torch outside the supported range
from . import mxfp8  # noqa: F401
from .config import Config, default_bucket_size
from .distributed_optimizer import DistributedOptimizer, StepResult
from .version import __version__
from .optim import CollectiveError

# Importing fxzero defines and registers nothing (no custom op, no torch log, no exit
# handler): the fxzero:: ops (fxzero/compiled/ops.py) and the fxzero torch log
# (fxzero/torch_log.py) come with the first optimizer or compile. The tools below stand on
# more than training needs and are imported on first use, each from its module.
_LAZY = {
    "CheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "explain": "explainer",
    "ParityReport": "parity_check",
    "parity": "parity_check",
}


def __getattr__(name: str) -> Any:
    """The checkpoint API, :func:`explain` and :func:`parity`, imported on first use: the
    checkpoint API stands on ``torch.distributed.checkpoint`` (and through it
    ``torch.distributed.tensor``), whose import cost every ``import fxzero`` ~0.7 s on this
    machine, also in the processes that never save; parity brings the multi-rank test
    harness (:mod:`fxzero.testing`), which a training process has no use for."""
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f".{module}", __name__), name)
    raise AttributeError(f"module 'fxzero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# The user API, what docs/api.md documents. The runtime's parts (layout plans, buffers,
# shards, the sharded grad) are fxzero.optim's: importable, but not a promise.
__all__ = [
    "__version__",
    "CheckpointError",
    "CollectiveError",
    "Config",
    "DistributedOptimizer",
    "ParityReport",
    "StepResult",
    "default_bucket_size",
    "explain",
    "latest_checkpoint",
    "load_checkpoint",
    "mxfp8",
    "parity",
    "save_checkpoint",
]
