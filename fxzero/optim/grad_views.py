"""``p.grad`` between backward and ``step()``: a handle on a gradient sharded over ranks.

Under DDP, ``p.grad`` holds the averaged gradient after backward, and training loops
use it: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``, ``GradScaler``'s
unscale and inf check, ``model.zero_grad()`` to drop gradients, ``p.grad.norm()`` for
logging. Under ZeRO-1 no rank holds a whole averaged gradient: each holds its shards
(:mod:`fxzero.optim.reduced_grads`). So at the end of each backward that ran outside
``no_sync()``, every managed param's ``.grad`` becomes a :class:`ShardedGrad`: a tensor
of the param's shape, dtype and device without storage, whose operations act on the
shards of every rank:

* norms (``torch.linalg.vector_norm``, ``Tensor.norm``, ``torch._foreach_norm``) return
  the global norm of the param's averaged gradient (one all-reduce per step, shared
  by every param and by ``step()``);
* ``mul_`` / ``div_`` by a number (and their ``_foreach`` forms) scale it;
* ``zero_()`` zeroes it; setting ``p.grad = None`` drops it (``step()`` then leaves
  the param alone, as torch.optim does);
* ``torch._amp_foreach_non_finite_check_and_unscale_`` (``GradScaler``) unscales and
  reports inf/NaN found on any rank.

Anything else raises an error that names the param and says what is supported,
rather than silently reading nothing. ``step()`` and ``zero_grad()`` take the views
back (``p.grad`` is ``None`` again), so a next backward never accumulates into one.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Sequence

import torch

from .._torch_compat import gradient_ops, plain_torch_function, storageless_like
from .param_table import ParamTable
from .reduced_grads import ReducedGrads

__all__ = ["GradViews", "ShardedGrad", "grad_scaler_state"]

_SUPPORTED = (
    "norms (torch.nn.utils.clip_grad_norm_, torch.linalg.vector_norm, Tensor.norm), mul_/div_ by a number, "
    "zero_(), p.grad = None, torch.amp.GradScaler; opt.clip_grad_norm_(max_norm) clips too"
)


class ShardedGrad(torch.Tensor):
    """A managed param's averaged gradient, living sharded in the optimizer's buffers."""

    _grads: "weakref.ref[ReducedGrads]"
    _slot: int
    _name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, grads: ReducedGrads, slot: int, name: str) -> "ShardedGrad":
        view = storageless_like(cls, param)
        view._grads, view._slot, view._name = weakref.ref(grads), slot, name
        return view

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedGrad(param {self._name!r}: its averaged gradient, sharded over the optimizer's ranks)"

    def __format__(self, spec: str) -> str:
        return repr(self)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func == _DATA:  # p.grad.data.norm(), p.grad.data.mul_(c): the same view
            return args[0]
        if func in _METADATA or getattr(func, "__name__", None) == "__get__":  # what torch.compile reads too
            with plain_torch_function():
                return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is None:
            raise RuntimeError(
                f"fxzero: {_first_view(args)._label()}: {getattr(func, '__name__', func)} is not supported on it. "
                f"Supported: {_SUPPORTED}."
            )
        return handler(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        # reached from C++ (autograd accumulating a new gradient into p.grad: the previous
        # one was neither stepped on nor zeroed) or by a view property such as p.grad.T
        raise RuntimeError(
            f"fxzero: {_first_view(args)._label()}: {func} cannot run on it. If a backward accumulated into it, "
            "call optimizer.step() or zero_grad() between backwards, or run every backward but the last of a "
            f"step inside `optimizer.no_sync()`. Supported: {_SUPPORTED}."
        )

    def _label(self) -> str:
        return f"p.grad of param {self._name!r} is fxzero's view of a gradient sharded over ranks"

    def _owner(self) -> ReducedGrads:
        grads = self._grads()
        if grads is None:
            raise RuntimeError(f"fxzero: {self._label()}, and its optimizer no longer exists")
        return grads


_METADATA = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
        "element_size", "_is_view", "is_conj", "is_neg", "untyped_storage", "get_device", "__len__",
    )
)  # fmt: skip
_DATA = torch.Tensor.data.__get__


def _first_view(items: Any) -> ShardedGrad:
    for item in items:
        if isinstance(item, ShardedGrad):
            return item
        if isinstance(item, (list, tuple)):
            return _first_view(item)
    raise TypeError("no ShardedGrad among the arguments")


def _owner_and_slots(views: Sequence[Any]) -> tuple[ReducedGrads, list[int]]:
    if not all(isinstance(v, ShardedGrad) for v in views):
        raise RuntimeError(f"fxzero: {_first_view(views)._label()}: it cannot be mixed with ordinary tensors in one call")
    owners = {id(v._owner()) for v in views}
    if len(owners) > 1:
        raise RuntimeError("fxzero: gradients of params of different DistributedOptimizers in one call")
    return views[0]._owner(), [v._slot for v in views]


def _norm_tensor(view: ShardedGrad, value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=view.dtype, device=view.device)


def _order(p: Any) -> float:
    return 2.0 if p is None or p == "fro" else float(p)


def _whole(view: ShardedGrad, dim: Any) -> None:
    if dim is not None:
        raise RuntimeError(f"fxzero: {view._label()}: only norms over the whole gradient (dim=None) are supported")


def _vector_norm(view: ShardedGrad, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    _whole(view, dim)
    grads, slots = _owner_and_slots([view])
    return _norm_tensor(view, grads.norms(slots, _order(ord))[0])


def _tensor_norm(view: ShardedGrad, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None, **_: Any) -> torch.Tensor:
    return _vector_norm(view, p, dim)


def _foreach_norm(views: Sequence[Any], ord: Any = 2, dtype: Any = None) -> list[torch.Tensor]:
    grads, slots = _owner_and_slots(views)
    return [_norm_tensor(v, value) for v, value in zip(views, grads.norms(slots, _order(ord)))]


def _factor(view: ShardedGrad, other: Any) -> float:
    if isinstance(other, torch.Tensor) and other.numel() == 1 and not isinstance(other, ShardedGrad):
        return float(other)
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other)
    raise RuntimeError(f"fxzero: {view._label()}: it can only be multiplied or divided by a number")


def _mul_(view: ShardedGrad, other: Any) -> ShardedGrad:
    grads, slots = _owner_and_slots([view])
    grads.scale(slots, _factor(view, other))
    return view


def _div_(view: ShardedGrad, other: Any) -> ShardedGrad:
    grads, slots = _owner_and_slots([view])
    grads.scale(slots, 1.0 / _factor(view, other))
    return view


def _foreach_mul_(views: Sequence[Any], other: Any) -> None:
    grads, slots = _owner_and_slots(views)
    if isinstance(other, (list, tuple)):
        for slot, view, factor in zip(slots, views, other):
            grads.scale([slot], _factor(view, factor))
    else:
        grads.scale(slots, _factor(views[0], other))


def _foreach_div_(views: Sequence[Any], other: Any) -> None:
    factors = [1.0 / _factor(v, o) for v, o in zip(views, other)] if isinstance(other, (list, tuple)) else None
    _foreach_mul_(views, factors if factors is not None else 1.0 / _factor(views[0], other))


def _zero_(view: ShardedGrad) -> ShardedGrad:
    grads, slots = _owner_and_slots([view])
    grads.zero(slots)
    return view


def _itself(view: ShardedGrad, *args: Any, **kwargs: Any) -> ShardedGrad:
    return view


def _unscale(views: Sequence[Any], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale + inf check, over every rank's shards of ``views``."""
    grads, slots = _owner_and_slots(views)
    if not all(math.isfinite(n) for n in grads.norms(slots)):
        found_inf.fill_(1.0)
    grads.scale(slots, float(inv_scale))


_OPS = gradient_ops()
_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _vector_norm,
    torch.Tensor.norm: _tensor_norm,
    torch.norm: _tensor_norm,
    _OPS["foreach_norm"]: _foreach_norm,
    torch.Tensor.mul_: _mul_,
    torch.Tensor.div_: _div_,
    _OPS["foreach_mul_"]: _foreach_mul_,
    _OPS["foreach_div_"]: _foreach_div_,
    torch.Tensor.zero_: _zero_,
    torch.Tensor.requires_grad_: _itself,
    torch.Tensor.detach_: _itself,
    _OPS["amp_unscale"]: _unscale,
}


class GradViews:
    """One :class:`ShardedGrad` per managed param, put into and taken out of ``p.grad``."""

    def __init__(
        self, table: ParamTable, grads: ReducedGrads, explain_failure: Callable[[], None]
    ) -> None:
        self.params = table.params
        self.views = tuple(ShardedGrad(row.param, grads, row.slot, row.label) for row in table.rows)
        self.installed = False
        self._explain_failure = explain_failure
        """Raises the clear error when a view no longer fits its param (the model was cast)."""

    def install(self) -> None:
        """Backward finished: every managed param's ``.grad`` becomes its view."""
        try:
            for param, view in zip(self.params, self.views):
                param.grad = view
        except RuntimeError:
            self._explain_failure()
            raise
        self.installed = True

    def collect(self) -> list[int]:
        """Take the views back (``.grad`` -> ``None``); return the params whose ``.grad``
        the user set to ``None`` (their gradients are dropped)."""
        if not self.installed:
            return []
        dropped, replaced = [], []
        for slot, (param, view) in enumerate(zip(self.params, self.views)):
            grad = param.grad
            if grad is not view:
                (dropped if grad is None else replaced).append(slot)
            param.grad = None
        self.installed = False
        if replaced:
            raise RuntimeError(
                f"fxzero: param {self.views[replaced[0]]._name!r}'s .grad was replaced by a tensor after backward. "
                "Its gradient lives sharded in the optimizer: scale it in place (p.grad.mul_), drop it "
                "(p.grad = None), or compute the loss so that backward produces the gradient you want."
            )
        return dropped

    def clear(self) -> None:
        """Gradients were zeroed: ``.grad`` -> ``None`` where it still holds a view."""
        if self.installed:
            for param, view in zip(self.params, self.views):
                if param.grad is view:
                    param.grad = None
            self.installed = False


def grad_scaler_state(optimizer: object) -> tuple[float, bool]:
    """``(loss scale, found inf)`` for this step. An optimizer with
    ``_step_supports_amp_scaling`` gets ``grad_scale`` (the loss scale, ``None`` when
    ``GradScaler.unscale_`` ran already) and ``found_inf`` set by ``GradScaler.step``."""
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    return (1.0 if grad_scale is None else float(grad_scale)), (found_inf is not None and float(found_inf) != 0)
