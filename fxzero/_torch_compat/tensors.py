"""Tensors: the subclass behind the ``p.grad`` views of sharded gradients, views, multi-tensor kernels.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch

__all__ = [
    "foreach_add_",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "gradient_ops",
    "plain_torch_function",
    "storageless_like",
    "tensor_is_view",
    "view_base",
]


def storageless_like(cls: type, like: torch.Tensor) -> torch.Tensor:
    """An instance of tensor subclass ``cls`` with ``like``'s shape, dtype and device and
    no storage.

    What for: ``p.grad`` views of gradients that live sharded over ranks
    (:mod:`fxzero.optim.gradients.grad_views`). Uses ``torch.Tensor._make_wrapper_subclass`` (what
    DTensor and FSDP2 build on); if torch renames it, the same under its new name.
    """
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)


def plain_torch_function() -> ContextManager[None]:
    """Inside the block, torch functions called on a tensor subclass run as on a plain
    tensor (no ``__torch_function__``).

    What for: metadata reads of the ``p.grad`` views (shape, strides: what torch.compile
    reads when it traces params). Uses ``torch._C.DisableTorchFunctionSubclass``; if torch
    moves it, ``torch.overrides``' equivalent context manager.
    """
    return torch._C.DisableTorchFunctionSubclass()


def gradient_ops() -> dict[str, Callable[..., Any]]:
    """The private ops that ``torch.nn.utils.clip_grad_norm_`` (``foreach`` path) and
    ``torch.amp.GradScaler`` call on gradients, by role.

    What for: the ``p.grad`` views recognize them in ``__torch_function__`` and run them
    over every rank's shards. If torch renames one, the new op goes here (the views
    then raise a clear "not supported" error for the old name until it does).
    """
    return {
        "foreach_norm": torch._foreach_norm,
        "foreach_mul_": torch._foreach_mul_,
        "foreach_div_": torch._foreach_div_,
        "amp_unscale": torch._amp_foreach_non_finite_check_and_unscale_,
    }

# ---- multi-tensor kernels -----------------------------------------------------------------
# torch.optim's own fast path: one kernel launch for a list of tensors instead of one each.
# If they move: a Python loop over the tensors (same numbers, more launches).
foreach_add_: Callable[..., Any] = torch._foreach_add_
foreach_copy_: Callable[..., Any] = torch._foreach_copy_
foreach_mul_: Callable[..., Any] = torch._foreach_mul_
foreach_norm: Callable[..., Any] = torch._foreach_norm


# ---- views -------------------------------------------------------------------------------
def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``tensor`` is a view of, or ``None`` when it is not a view.

    What for: a param rebound to a view of the flat buffer must not be a view in a DTensor's
    local tensor (:mod:`fxzero.optim.layout.mesh`). Reads ``Tensor._base``; if torch renames
    it: :data:`tensor_is_view` answers what the caller asks (whether it is a view)."""
    return tensor._base


tensor_is_view: Callable[[torch.Tensor], bool] = torch.Tensor._is_view
"""``Tensor._is_view`` itself: one of the metadata reads (what ``torch.compile`` asks of a
param) the ``p.grad`` views answer as a plain tensor would."""
