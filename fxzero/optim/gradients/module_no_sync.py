"""``model.no_sync()``: the name frameworks look for when they accumulate gradients.

Accelerate's ``accelerator.accumulate(model)`` / ``accelerator.no_sync(model)`` and the
Hugging Face Trainer's ``gradient_accumulation_steps`` skip the gradient reduction of every
micro-batch but the last through ``getattr(model, "no_sync", nullcontext)()``: the method
DDP has. A model that fxzero manages is not wrapped, so without it they would reduce after
every micro-batch and the second one would raise ``LateGradient``. With ``module=``, the
optimizer gives the module a ``no_sync`` attribute that enters
:meth:`~fxzero.DistributedOptimizer.no_sync` (unless the module has one of its own).

A copy (``copy.deepcopy``, ``AveragedModel``) or pickle of the module is a plain module no
optimizer manages: it gets an inert ``no_sync``, as fxzero's module hooks do.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

__all__ = ["ModuleNoSync", "install_no_sync"]

log = logging.getLogger(__name__)


def _nothing() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class ModuleNoSync:
    """``module.no_sync()``: the optimizer's ``no_sync()`` context."""

    def __init__(self, no_sync: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._no_sync = no_sync

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return self._no_sync()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[[], contextlib.AbstractContextManager[None]]:
        return _nothing

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_inert, ())


def _inert() -> Callable[[], contextlib.AbstractContextManager[None]]:
    return _nothing


def install_no_sync(module: torch.nn.Module, no_sync: Callable[[], contextlib.AbstractContextManager[None]]) -> Callable[[], None]:
    """Give ``module`` a ``no_sync`` attribute entering ``no_sync()``; returns what removes it."""
    if hasattr(module, "no_sync"):
        log.info("%s has a no_sync of its own: fxzero leaves it; accumulate with opt.no_sync()", type(module).__name__)
        return lambda: None
    attribute = ModuleNoSync(no_sync)
    module.no_sync = attribute  # type: ignore[assignment]

    def remove() -> None:
        if module.__dict__.get("no_sync") is attribute:
            del module.no_sync

    return remove
