"""The ``fxzero`` torch log: ``TORCH_LOGS="fxzero"`` shows what each compile inserted, for
which bucket (INFO); ``"+fxzero"`` adds each pass's time and node count (DEBUG).

Torch already resolves the name as a module path when it parses ``TORCH_LOGS``, so the
setting works before anything is registered. Registering it as well makes ``fxzero`` one of
torch's registered logs, so ``torch._logging.set_logs()`` and torch's later re-inits
configure it like torch's own components. That registration is a change to torch's
process-wide state, so it happens when fxzero is first used (an optimizer built, a graph
compiled: :func:`register`), never on ``import fxzero``.
"""

from __future__ import annotations

from . import _torch_compat as compat

__all__ = ["NAME", "register"]

NAME = "fxzero"


def register() -> None:
    """Register the ``fxzero`` log with torch (once; later calls find it registered)."""
    compat.register_torch_log(NAME, "fxzero")
