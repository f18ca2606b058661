"""What a model's forward returned, turned into the tensor a tool backpropagates.

Why: ``fxzero explain`` and ``fxzero parity`` run a backward of their own, and models
return many things: a tensor, a tuple (``(logits, aux)``), a dict, or a Hugging Face
``ModelOutput`` (a dict subclass whose ``loss`` key is present only when labels were
given). A user should not have to wrap the model to run a tool on it, so the rule is
one, shared by both tools, and an optional ``loss_fn(output)`` replaces it:

* a tensor is the output;
* a mapping (``ModelOutput`` included) gives its ``"loss"``, else its ``"logits"``, else
  its first tensor value;
* a tuple or list gives its first tensor (recursively).

Nothing here imports ``transformers``: a ``ModelOutput`` is read as the mapping it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

__all__ = ["OutputError", "output_tensor", "scalar_loss"]

LossFn = Callable[[Any], torch.Tensor]


class OutputError(TypeError):
    """The model's output holds no tensor to backpropagate, or ``loss_fn`` returned none."""


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        for key in ("loss", "logits"):
            if isinstance(value.get(key), torch.Tensor):
                return value[key]
        items = list(value.values())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        return None
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def output_tensor(output: Any, loss_fn: Optional[LossFn], who: str) -> torch.Tensor:
    """``loss_fn(output)`` if given, else the tensor the rule above picks from ``output``."""
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor):
            raise OutputError(f"{who}: loss_fn(output) returned {type(loss).__name__}; it must return a tensor")
        return loss
    found = _first_tensor(output)
    if found is None:
        raise OutputError(
            f"{who}: the model returned {type(output).__name__}, which holds no tensor; pass loss_fn=, a function "
            "from the model's output to the tensor to backpropagate (the command line: return it from TARGET)"
        )
    return found


def scalar_loss(output: Any, loss_fn: Optional[LossFn], who: str) -> tuple[torch.Tensor, bool]:
    """The training loss, and whether it is a stand-in: a scalar the output holds (a
    ``ModelOutput``'s ``loss``) is used as is; otherwise the picked tensor's mean of
    squares, a mean over the batch as a real loss is, so slices of a batch average to it."""
    picked = output_tensor(output, loss_fn, who)
    if picked.dim() == 0:
        return picked, False
    if not picked.is_floating_point():
        raise OutputError(
            f"{who}: the model's output tensor has dtype {picked.dtype} and no loss; pass loss_fn= returning the "
            "scalar training loss (a mean over the batch)"
        )
    return picked.float().square().mean(), True
