"""fxzero: ZeRO-1 distributed-optimizer training (Megatron-LM's distributed optimizer)
as a torch.compile backend.

    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
"""

from typing import Any

from . import mxfp8  # noqa: F401
from .compiled import ops  # noqa: F401  defines the fxzero:: custom ops that compiled graphs call
from ._torch_compat import register_torch_log
from .config import Config, default_bucket_size
from .explainer import explain
from .parity import ParityReport, parity
from .distributed_optimizer import DistributedOptimizer, StepResult
from .version import __version__
from .optim import CollectiveError


def _register_torch_logs() -> None:
    """``TORCH_LOGS="fxzero"`` shows what each compile inserted, for which bucket (INFO);
    ``"+fxzero"`` adds each pass's time and node count (DEBUG). Torch already resolves
    the name as a module path when it parses ``TORCH_LOGS``; registering it as well
    makes ``fxzero`` one of torch's registered logs, so ``torch._logging.set_logs()``
    and torch's later re-inits configure it like torch's own components."""
    register_torch_log("fxzero", "fxzero")


_register_torch_logs()

_CHECKPOINT = frozenset({"CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"})


def __getattr__(name: str) -> Any:
    """The checkpoint API, imported on first use: it stands on ``torch.distributed.checkpoint``
    (and through it ``torch.distributed.tensor``), whose import cost every ``import fxzero``
    ~0.7 s on this machine, also in the processes that never save."""
    if name in _CHECKPOINT:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fxzero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CHECKPOINT)


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
