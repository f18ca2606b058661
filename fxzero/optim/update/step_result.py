"""What :meth:`fxzero.DistributedOptimizer.step` returns, and its warning when there was nothing to apply."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal, Optional

__all__ = ["StepResult", "warn_no_gradients"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What :meth:`DistributedOptimizer.step` did.

    Args:
        Every field below, by keyword (``step()`` makes it; users read it).
    """

    skipped: bool
    """True when no update was applied (``reason`` says why)."""
    grad_norm: Optional[float]
    """Global L2 norm of the averaged gradients as ``step()`` found them (after any
    ``clip_grad_norm_`` or unscaling by hand, before ``Config.clip_grad``); ``None`` under
    ``Config.measure_grad_norm=False``, which does not measure it."""
    loss: Any = None
    """The closure's return value, if a closure was given."""
    reason: Optional[Literal["non_finite", "found_inf", "no_gradients"]] = None
    """Why the update was skipped: the global norm was not finite (never under
    ``Config.measure_grad_norm=False``); ``GradScaler`` found
    inf/NaN; or no param got a gradient since the previous step (``step()`` consumes
    gradients, so a second ``step()`` after one backward applies nothing; it warns)."""


def warn_no_gradients(dropped: list[int]) -> None:
    if not dropped:
        warnings.warn(
            "fxzero: step() found no gradient since the previous step (step() consumes them, so a second "
            "step() after one backward applies nothing, where torch.optim would apply the same gradients again); "
            "the step was skipped (StepResult.reason == 'no_gradients')",
            stacklevel=3,
        )
