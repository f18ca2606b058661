"""The catalogues of ``torch.optim`` classes, and what they decide: which classes may be cut into fragments.

Why a module of its own: the same few lists decide the layout (fragments or whole-param
ownership, :func:`resolve_state_sharding`) and the update (the flat update of elementwise
classes, the bucket-at-a-time step), and a class added to one list must be seen by both.
They live in the layout's room because the layout is the first to ask, and the update's
room, above it, reads them from here.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "SHAPE_AWARE_OPTIMIZERS", "check_first_order", "require_optimizer_class", "resolve_state_sharding"]

log = logging.getLogger(__name__)


def require_optimizer_class(optimizer_class: Any) -> None:
    """Refuse anything but a ``torch.optim.Optimizer`` subclass (an instance, a function)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")


def check_first_order(optimizer_class: type) -> None:
    """Optimizers whose ``step`` requires a closure (``torch.optim.LBFGS``) re-evaluate
    the model between inner updates and take dot products over all params together; with
    the params split over ranks (fragments or whole params) neither can work, so they are
    refused up front. ``torch.optim.SparseAdam`` takes sparse gradients only, which never
    exist here (gradients are reduced into flat dense buffers)."""
    if optimizer_class is torch.optim.SparseAdam:
        raise ValueError(
            "SparseAdam takes sparse gradients only (nn.Embedding(sparse=True)); fxzero reduces every gradient into "
            "flat dense buffers, so SparseAdam would refuse each of them. Use Adam/AdamW (dense, same update on the "
            "rows that have gradients) with fxzero, or SparseAdam with the plain model."
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_class.__name__}.step(closure) needs a closure that it calls repeatedly, re-evaluating the "
            "model between its own inner updates and computing curvature over all params together; fxzero splits the "
            "params over ranks (each updates 1/dp of them), so it cannot run it. Use "
            f"{optimizer_class.__name__} with the plain model (or DDP), or a first-order optimizer (SGD, Adam, AdamW)."
        )


ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("Adadelta", "Adagrad", "Adam", "Adamax", "AdamW", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD")
)
"""The classes whose update of each element reads only that element's gradient and state
(plus per-param scalars that depend on the step count alone), so updating 1-D fragments of
a param gives bitwise the same values as updating the param (``tests/test_optim_db.py`` runs
torch's own table of their configurations)."""


SHAPE_AWARE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in ("Adafactor", "Muon") if hasattr(torch.optim, name))
"""torch.optim classes whose update reads a param's shape: never elementwise."""


def resolve_state_sharding(optimizer_class: type, setting: str) -> bool:
    """Whether ``optimizer_class`` gets whole-param ownership under ``Config.state_sharding``.

    ``"auto"`` gives fragments (1-D, each rank 1/dp of each param) only to the classes known
    to be elementwise. An update that reads a param's shape or combines its elements
    (Adafactor, Muon, Shampoo, LAMB's and LARS's trust ratios) would silently train another
    optimizer on fragments, so every other class, subclasses included (their ``step`` may
    differ), gets whole params: served exactly, at the cost of uneven shards."""
    require_optimizer_class(optimizer_class)
    check_first_order(optimizer_class)
    if setting == "elementwise" and optimizer_class in SHAPE_AWARE_OPTIMIZERS:
        raise ValueError(
            f"Config(state_sharding='elementwise') cannot serve {optimizer_class.__name__}: its update reads each "
            "param's shape (a 1-D fragment of a matrix is another optimizer's input). Use state_sharding='auto' or "
            "'whole_params'."
        )
    whole = setting == "whole_params" or (setting == "auto" and optimizer_class not in ELEMENTWISE_OPTIMIZERS)
    if whole and setting == "auto":
        log.info("fxzero: %s is not known to be elementwise: each param is owned whole by one rank", optimizer_class.__name__)
    return whole
