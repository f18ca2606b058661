"""``p.grad`` between backward and ``step()``: a handle on a gradient sharded over ranks.

Under DDP, ``p.grad`` holds the averaged gradient after backward, and training loops
use it: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``, ``GradScaler``'s
unscale and inf check, ``model.zero_grad()`` to drop gradients, ``p.grad.norm()`` for
logging. Under ZeRO-1 no rank holds a whole averaged gradient: each holds its shards
(:mod:`fxzero.optim.gradients.reduced_grads`). So at the end of each backward that ran outside
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
rather than silently reading nothing; to read the whole gradient (``p.grad.abs()``,
``torch.histc``, TensorBoard histograms) the error points to
:meth:`~fxzero.DistributedOptimizer.full_grads`, which gathers it (:mod:`fxzero.optim.gradients.full_grads`). ``step()`` and ``zero_grad()`` take the views
back (``p.grad`` is ``None`` again), so a next backward never accumulates into one.
``model.zero_grad()`` before a next backward (DCGAN zeroes D after G's backward filled
D's gradients) does what ``opt.zero_grad()`` does: a gradient reaching a bucket that
already launched finds every view dropped or zeroed and starts the step over
(:meth:`GradViews.reset_if_cleared`); with ``set_to_none=False`` autograd adds the new
gradient into the zeroed view, which hands it on in place of itself.

A tensor assigned to ``p.grad`` instead (before or after a backward) is a gradient made
by hand: ``step()`` uses it as is, **not averaged over ranks**, as DDP does
(:mod:`fxzero.optim.gradients.hand_grads`; all-reduce it yourself if ranks compute different
ones). The ``_foreach`` and ``GradScaler`` ops above take lists mixing views with such
tensors: the tensors get the real op.
"""

from __future__ import annotations

import math
import operator
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from ..._torch_compat import gradient_ops, plain_torch_function, storageless_like, tensor_is_view
from .hand_grads import HandGrad, check_hand_grad
from ..layout.param_table import ParamTable
from ..params.param_watch import ParamWatch
from .reduced_grads import ReducedGrads

__all__ = ["GradViews", "ShardedGrad", "grad_scaler_state"]

_SUPPORTED = (
    "norms (torch.nn.utils.clip_grad_norm_, torch.linalg.vector_norm, Tensor.norm), mul_/div_ by a number, "
    "zero_(), p.grad = None, torch.amp.GradScaler; opt.clip_grad_norm_(max_norm) clips too"
)


class ShardedGrad(torch.Tensor):
    """A managed param's averaged gradient, living sharded in the optimizer's buffers."""

    _grads: "weakref.ref[ReducedGrads]"
    _views: "weakref.ref[GradViews]"
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
                f"Supported: {_SUPPORTED}. To read whole gradients (p.grad.abs(), torch.histc, TensorBoard "
                "histograms), call `optimizer.full_grads()` on every rank between backward and step(): it returns "
                "each param's averaged gradient by name."
            )
        return handler(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func is _ACCUMULATE and not kwargs and isinstance(args[0], ShardedGrad) and args[0]._handed_on(args[1]):
            return args[0]
        # reached from C++ (autograd accumulating a new gradient into p.grad: the previous
        # one was neither stepped on nor zeroed) or by a view property such as p.grad.T
        raise RuntimeError(
            f"fxzero: {_first_view(args)._label()}: {func} cannot run on it. If a backward accumulated into it, "
            "call optimizer.step() or zero_grad() (or model.zero_grad() over every param of the optimizer) between "
            f"backwards, or run every backward but the last of a step inside `optimizer.no_sync()`. Supported: {_SUPPORTED}."
        )

    def _label(self) -> str:
        return f"p.grad of param {self._name!r} is fxzero's view of a gradient sharded over ranks"

    def _handed_on(self, new: torch.Tensor) -> bool:
        """Autograd adds a new gradient into this view (``model.zero_grad(set_to_none=False)``
        zeroed it): if every view was dropped or zeroed, the step starts over and the param's
        ``.grad`` becomes ``new``, which its post-accumulate hook then moves into the buffer."""
        views = self._views()
        if views is None or not self._reduced().zeroed[self._slot] or not views.reset_if_cleared():
            return False
        views.params[self._slot].grad = new
        return True

    def _reduced(self) -> ReducedGrads:
        grads = self._grads()
        if grads is None:
            raise RuntimeError(f"fxzero: {self._label()}, and its optimizer no longer exists")
        return grads


_METADATA = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
        "element_size", "is_conj", "is_neg", "untyped_storage", "get_device", "__len__",
    )
) | {tensor_is_view}  # fmt: skip
_DATA = torch.Tensor.data.__get__
_ACCUMULATE = torch.ops.aten.add_.Tensor
"""What autograd's AccumulateGrad runs on a ``.grad`` it adds a new gradient into."""


def _first_view(items: Any) -> ShardedGrad:
    for item in items:
        if isinstance(item, ShardedGrad):
            return item
        if isinstance(item, (list, tuple)):
            return _first_view(item)
    raise TypeError("no ShardedGrad among the arguments")


def _reduced_and_slots(view: ShardedGrad) -> tuple[ReducedGrads, list[int]]:
    return view._reduced(), [view._slot]


def _by_reduced(tensors: Sequence[Any], positions: Sequence[int]) -> list[tuple[ReducedGrads, list[int], list[int]]]:
    """The views at ``positions`` grouped by the optimizer holding them: (its gradients, their
    positions, their slots) per optimizer. One model's params may belong to several optimizers
    (Muon over the matrices, AdamW over the rest), and torch's ``foreach`` paths
    (``clip_grad_norm_`` on CUDA) pass all of a device's gradients in one list."""
    groups: dict[int, tuple[ReducedGrads, list[int], list[int]]] = {}
    for i in positions:
        grads = tensors[i]._reduced()
        _, where, slots = groups.setdefault(id(grads), (grads, [], []))
        where.append(i)
        slots.append(tensors[i]._slot)
    return list(groups.values())


def _norm_tensor(view: ShardedGrad, value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=view.dtype, device=view.device)


def _order(p: Any) -> float:
    return 2.0 if p is None or p == "fro" else float(p)


def _whole(view: ShardedGrad, dim: Any) -> None:
    if dim is not None:
        raise RuntimeError(f"fxzero: {view._label()}: only norms over the whole gradient (dim=None) are supported")


def _vector_norm(view: ShardedGrad, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    _whole(view, dim)
    grads, slots = _reduced_and_slots(view)
    return _norm_tensor(view, grads.norms(slots, _order(ord))[0])


def _tensor_norm(view: ShardedGrad, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None, **_: Any) -> torch.Tensor:
    return _vector_norm(view, p, dim)


def _split(tensors: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Positions of the views and of the other tensors (gradients assigned by hand) in a list."""
    views: list[int] = []
    plain: list[int] = []
    for i, tensor in enumerate(tensors):
        (views if isinstance(tensor, ShardedGrad) else plain).append(i)
    return views, plain


def _foreach_norm(tensors: Sequence[Any], ord: Any = 2, dtype: Any = None) -> list[torch.Tensor]:
    views, plain = _split(tensors)
    out: list[Any] = [None] * len(tensors)
    for grads, where, slots in _by_reduced(tensors, views):
        for i, value in zip(where, grads.norms(slots, _order(ord))):
            out[i] = _norm_tensor(tensors[i], value)
    if plain:
        for i, norm in zip(plain, _OPS["foreach_norm"]([tensors[i] for i in plain], ord, dtype=dtype)):
            out[i] = norm
    return out


def _factor(view: ShardedGrad, other: Any) -> float:
    if isinstance(other, torch.Tensor) and other.numel() == 1 and not isinstance(other, ShardedGrad):
        return float(other)
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other)
    raise RuntimeError(f"fxzero: {view._label()}: it can only be multiplied or divided by a number")


def _mul_(view: ShardedGrad, other: Any) -> ShardedGrad:
    grads, slots = _reduced_and_slots(view)
    grads.scale(slots, _factor(view, other))
    return view


def _div_(view: ShardedGrad, other: Any) -> ShardedGrad:
    grads, slots = _reduced_and_slots(view)
    grads.scale(slots, 1.0 / _factor(view, other))
    return view


def _foreach_scaling(op: str, invert: bool) -> Callable[[Sequence[Any], Any], None]:
    """``_foreach_mul_`` / ``_foreach_div_``: views record the factor, other tensors get the real op."""

    def handler(tensors: Sequence[Any], other: Any) -> None:
        views, plain = _split(tensors)
        per_tensor = isinstance(other, (list, tuple))
        if plain:
            _OPS[op]([tensors[i] for i in plain], [other[i] for i in plain] if per_tensor else other)
        for grads, where, slots in _by_reduced(tensors, views):
            factors = [_factor(tensors[i], other[i] if per_tensor else other) for i in where]
            factors = [1.0 / f for f in factors] if invert else factors
            if per_tensor:
                for slot, factor in zip(slots, factors):
                    grads.scale([slot], factor)
            else:
                grads.scale(slots, factors[0])

    return handler


def _zero_(view: ShardedGrad) -> ShardedGrad:
    grads, slots = _reduced_and_slots(view)
    grads.zero(slots)
    return view


def _itself(view: ShardedGrad, *args: Any, **kwargs: Any) -> ShardedGrad:
    return view


def _unscale(tensors: Sequence[Any], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscale + inf check, over every rank's shards of the views (the real
    op on gradients assigned by hand)."""
    views, plain = _split(tensors)
    if plain:
        _OPS["amp_unscale"]([tensors[i] for i in plain], found_inf, inv_scale)
    for grads, _, slots in _by_reduced(tensors, views):
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
    _OPS["foreach_mul_"]: _foreach_scaling("foreach_mul_", invert=False),
    _OPS["foreach_div_"]: _foreach_scaling("foreach_div_", invert=True),
    torch.Tensor.zero_: _zero_,
    torch.Tensor.requires_grad_: _itself,
    torch.Tensor.detach_: _itself,
    _OPS["amp_unscale"]: _unscale,
}


class GradViews:
    """One :class:`ShardedGrad` per managed param, put into and taken out of ``p.grad``."""

    def __init__(
        self,
        table: ParamTable,
        grads: ReducedGrads,
        watch: ParamWatch,
        reset: Optional[Callable[[], None]] = None,
    ) -> None:
        self.params = table.params
        self.views = tuple(ShardedGrad(row.param, grads, row.slot, row.label) for row in table.rows)
        for view in self.views:
            view._views = weakref.ref(self)
        self._grads = grads
        self._reset = reset
        """What ``opt.zero_grad()`` does (held weakly by the caller: views must not keep the optimizer alive)."""
        self.installed = False
        self._nones: tuple[ShardedGrad | None, ...] = (None,) * len(self.params)
        self._expected: Sequence[Any] = self.views
        """The view :meth:`install` put into each ``.grad`` (``None`` for a frozen param: none)."""
        self._watch = watch
        """Raises the clear error when a view no longer fits its param (the model was cast)."""

    def install(self) -> None:
        """Backward finished: every managed param's ``.grad`` becomes its view, except a
        gradient assigned by hand before a backward that did not reach its param (kept for
        ``step()``, as torch.optim would use it)."""
        views = expected = self.views
        if not all(map(operator.is_, map(_GRAD, self.params), self._nones)) or not all(map(_REQUIRES_GRAD, self.params)):
            # a frozen param gets no view: its .grad stays None, as under torch.optim
            expected = tuple(view if p.requires_grad or p.grad is not None else None for p, view in zip(self.params, self.views))
            views = tuple(view if p.grad is None else p.grad for p, view in zip(self.params, expected))
        try:
            for param, view in zip(self.params, views):
                param.grad = view
        except RuntimeError:
            self._watch.check()
            raise
        self.installed, self._expected = True, expected

    def collect(self) -> tuple[list[int], list[HandGrad]]:
        """Empty every ``.grad`` (the step consumes it); return the params whose view the
        user set to ``None`` (their gradients are dropped) and the gradients assigned by
        hand (:mod:`fxzero.optim.gradients.hand_grads`), checked. One C-level scan when there are none."""
        expected = self._expected if self.installed else self._nones
        grads = list(map(_GRAD, self.params))
        if all(map(operator.is_, grads, expected)):
            if self.installed:
                self._empty()
            return [], []
        dropped, hand = [], []
        for slot, (param, grad, mine) in enumerate(zip(self.params, grads, expected)):
            if grad is None and mine is not None:
                dropped.append(slot)
            elif grad is not mine and grad is not None:
                check_hand_grad(param, grad, self.views[slot]._name, ShardedGrad)
                hand.append(HandGrad(slot, grad))
        self._empty()
        return dropped, hand

    def reset_if_cleared(self, arriving: int = -1) -> bool:
        """A gradient reached a bucket that launched this step (param ``arriving``'s, whose
        ``.grad`` autograd just set). If the last backward's views were all dropped or zeroed
        since (``model.zero_grad()``), start the step over as ``opt.zero_grad()`` does and
        return True; else False (the gradient is late)."""
        if not self.installed or self._reset is None:
            return False
        zeroed = self._grads.zeroed
        for slot, (grad, view) in enumerate(zip(map(_GRAD, self.params), self.views)):
            if grad is not None and not (grad is view and zeroed[slot]) and slot != arriving:
                return False
        self._reset()
        return True

    def clear(self) -> None:
        """Gradients were zeroed: every ``.grad`` -> ``None`` (views and gradients assigned by
        hand alike, as torch.optim's ``zero_grad`` does). One C-level scan when all are ``None``."""
        if self.installed or not all(map(operator.is_, map(_GRAD, self.params), self._nones)):
            self._empty()

    def _empty(self) -> None:
        for param in self.params:
            param.grad = None
        self.installed = False

    def remove(self) -> None:
        """The optimizer is gone: ``.grad`` -> ``None`` where it still holds a view, nothing else."""
        for param, view in zip(self.params, self.views):
            if param.grad is view:
                param.grad = None
        self.installed = False


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def grad_scaler_state(optimizer: object) -> tuple[float, bool]:
    """``(loss scale, found inf)`` for this step. An optimizer with
    ``_step_supports_amp_scaling`` gets ``grad_scale`` (the loss scale, ``None`` when
    ``GradScaler.unscale_`` ran already) and ``found_inf`` set by ``GradScaler.step``."""
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    return (1.0 if grad_scale is None else float(grad_scale)), (found_inf is not None and float(found_inf) != 0)
