"""What ``load_state_dict`` checks before it changes anything: the state it is given, against
the params it will go to and the wrapped ``torch.optim`` class.

torch.optim's own loader checks the group sizes and nothing else: a moment saved transposed
(same number of elements) or for another class is taken in, and fails, if at all, at the next
``step()`` with a message that names no param. fxzero cuts each tensor to this rank's
fragment, so a wrong shape with the right number of elements would not even fail: its memory
would be reinterpreted. So everything is checked first, and a refusal names the param, the key
and both shapes:

* a tensor the wrapped class keeps per element (AdamW's ``exp_avg``) must have the param's
  shape exactly, a real dtype, and its state entry a ``step`` that is a finite count >= 0;
* whether the class can step from the given state at all (its keys, its flags, its groups)
  is asked of the class itself: a **probe**, one instance of the class over a tiny param of
  the same dimensionality, dtype and device, is loaded with the given groups and a stand-in of
  the given state (same keys, types and dtypes) and stepped once with a zero gradient. Where
  the probe fails, torch.optim would have failed at the next step, so the load is refused with
  the class's own error; where it steps, the state is accepted as torch.optim accepts it (an
  AdamW state loaded into SGD keeps SGD's fresh momentum, as torch.optim's does). Probes are
  cached per distinct shape of input (a few per model), and their steps run outside the
  optimizer step hooks (``fxzero._torch_compat.unhooked_step``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import torch

from ..._torch_compat import unhooked_step
from .state_dict import hyperparameters

__all__ = ["StateProbe", "Target", "check_states", "check_groups"]

_PROBE_SIZE = 3
"""Each dimension of a probe param: small, and unlike any size 1 a broadcast would hide."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A tensor a state entry will belong to: a param, or a fragment of one."""

    label: str
    """How the refusal names it: ``param 'fc.weight'`` (``(fragment)`` where only a piece is meant)."""
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    group: int


@dataclasses.dataclass(frozen=True)
class StateProbe:
    """The wrapped class and the keyword arguments it is built with, to probe."""

    optimizer_class: type[torch.optim.Optimizer]
    kwargs: Mapping[str, Any]

    def fresh_state(self, target: Target, hyper: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """The state one step of the class makes from nothing, under the loaded groups."""
        return self._step(target, hyper, saved, None)

    def step_from(self, target: Target, hyper: dict[str, Any], saved: dict[str, Any], state: dict[str, Any]) -> None:
        """Step the class once from ``state`` (a stand-in, probe-shaped); raises as the class would."""
        self._step(target, hyper, saved, state)

    def _step(self, target: Target, hyper: dict[str, Any], saved: dict[str, Any], state: Optional[dict[str, Any]]) -> dict[str, Any]:
        param = torch.zeros(probe_shape(target), dtype=target.dtype, device=target.device, requires_grad=True)
        probe = self.optimizer_class([hyper | {"params": [param]}], **self.kwargs)
        probe.load_state_dict({"state": {0: state} if state else {}, "param_groups": [saved | {"params": [0]}]})
        param.grad = torch.zeros_like(param)
        unhooked_step(probe)()
        return dict(probe.state.get(param, {}))


def probe_shape(target: Target) -> tuple[int, ...]:
    return (_PROBE_SIZE,) * len(target.shape)


def check_groups(saved: Any, live: Sequence[dict[str, Any]], sizes: Optional[Sequence[int]] = None) -> None:
    """The saved param groups: a list of dicts, as many as this optimizer has, each listing its
    params (``sizes``: as many as each of this optimizer's groups holds, where that must hold)."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved):
        raise ValueError("load_state_dict: 'param_groups' must be a list of dicts, each with a 'params' list")
    given = [len(g["params"]) for g in saved]
    if len(saved) != len(live) or (sizes is not None and given != list(sizes)):
        raise ValueError(
            f"load_state_dict: the state dict has param groups of {given} params, this optimizer "
            f"{list(sizes) if sizes is not None else len(live)}; build the DistributedOptimizer with the same param "
            "groups, in the same order"
        )


def check_states(
    states: Mapping[Any, Any],
    targets: Mapping[Any, Target],
    probe: StateProbe,
    live_groups: Sequence[dict[str, Any]],
    saved_groups: Sequence[dict[str, Any]],
    own_keys: Sequence[str] = (),
) -> dict[Any, dict[str, Any]]:
    """Raise ``ValueError`` naming the first entry of ``states`` (keyed as ``targets`` is) that
    the wrapped class could not step from, or whose tensors do not fit their target. Returns
    the entries to load: each without the keys the class does not keep (torch.optim carries
    them and never reads them; fxzero's flat update would find them in its way), ``own_keys``
    (fxzero's own per-element keys, the fp32 master: checked for shape alone) kept."""
    fresh: dict[tuple, Optional[dict[str, Any]]] = {}
    stepped: set[tuple] = set()
    loaded: dict[Any, dict[str, Any]] = {}
    for index, state in states.items():
        target = targets.get(index)
        if target is None:
            continue  # torch.optim keeps state of an unknown index and never reads it
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict: {target.label}: its state must be a dict, got {type(state).__name__}")
        loaded[index] = state
        if not state:
            continue  # no state yet: the class starts it at the next step
        for own in own_keys:
            if own in state:
                _per_element(own, state[own], target)
        hyper, saved = hyperparameters(live_groups[target.group]), hyperparameters(saved_groups[target.group])
        where = (target.group, len(target.shape), target.dtype, target.device)
        if where not in fresh:
            fresh[where] = _fresh(probe, target, hyper, saved)
        known = fresh[where]
        if known is None:  # the class cannot be probed on a small param: check the shapes alone
            _shapes_only(state, target)
            continue
        stand_in, signature = _stand_in(state, known, target)
        if (where, signature) not in stepped:
            _step_or_refuse(probe, target, hyper, saved, stand_in, state, known)
            stepped.add((where, signature))
        loaded[index] = {k: v for k, v in state.items() if k in known or k in own_keys}
    return loaded


def _fresh(probe: StateProbe, target: Target, hyper: dict[str, Any], saved: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The class's fresh state under the saved groups; ``None`` where the class cannot step a
    probe even with this optimizer's own groups (it wants shapes a probe does not have)."""
    try:
        return probe.fresh_state(target, hyper, saved)
    except Exception as error:  # the groups alone break the class: torch.optim would fail at the next step
        try:
            probe.fresh_state(target, hyper, hyper)
        except Exception:
            return None
        name = probe.optimizer_class.__name__
        lacks, extra = sorted(set(hyper) - set(saved)), sorted(set(saved) - set(hyper))
        raise ValueError(
            f"load_state_dict: {name} cannot step with the saved param group {target.group}'s hyperparameters "
            f"({_brief(error)}): they lack {lacks} and have {extra}, which {name} does not use: the state dict was "
            "saved by another optimizer class or version; nothing was loaded"
        ) from None


def _stand_in(state: dict[str, Any], fresh: dict[str, Any], target: Target) -> tuple[dict[str, Any], tuple]:
    """A probe-shaped copy of ``state`` for the keys the class keeps (others are never read),
    after checking each per-element tensor has ``target``'s shape; and what the probe's
    verdict depends on (keys, types, dtypes, scalar values), to step each kind once."""
    probe_like = torch.Size(probe_shape(target))
    stand_in: dict[str, Any] = {}
    signature = []
    for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
        known = fresh.get(key)
        if isinstance(known, torch.Tensor) and known.dim() > 0 and known.shape == probe_like:
            stand_in[key] = _per_element(key, value, target)
        elif isinstance(known, torch.Tensor) and known.dim() > 0:
            stand_in[key] = _per_param(key, value, known, target)
        elif key in fresh:
            stand_in[key] = _count(key, value, target) if key == "step" else _copied(value)
        else:  # a key the class does not keep: never read, but it keeps the entry from looking empty
            stand_in[key] = _placeholder(value, target)
        signature.append((key, _kind(value)))
    return stand_in, tuple(signature)


def _shapes_only(state: dict[str, Any], target: Target) -> None:
    """Without a probe: a tensor with as many elements as the param must have its shape."""
    numel = math.prod(target.shape)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
            _per_element(key, value, target)


def _placeholder(value: Any, target: Target) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone() if value.numel() <= 1 else torch.zeros(probe_shape(target), dtype=value.dtype, device=target.device)


def _per_element(key: str, value: Any, target: Target) -> Optional[torch.Tensor]:
    """A tensor with one value per element of the param: its shape must be the param's
    (``None`` stays ``None``: SGD's ``momentum_buffer`` before its first momentum step)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"load_state_dict: {target.label}: state {key!r} must be a tensor of shape {_shape(target.shape)}, got {type(value).__name__}")
    if value.shape != target.shape:
        hint = " (the same number of elements: saved transposed, or for another param?)" if value.numel() == math.prod(target.shape) else ""
        raise ValueError(
            f"load_state_dict: {target.label}: state {key!r} has shape {_shape(value.shape)}, the param "
            f"{_shape(target.shape)}{hint}; nothing was loaded"
        )
    _real(key, value, target)
    return torch.zeros(probe_shape(target), dtype=value.dtype, device=target.device)


def _per_param(key: str, value: Any, known: torch.Tensor, target: Target) -> torch.Tensor:
    """A tensor of the param's statistics (Adafactor's row and column variances): as many dimensions as the class makes."""
    if not isinstance(value, torch.Tensor) or value.dim() != known.dim():
        given = _shape(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"load_state_dict: {target.label}: state {key!r} is {given}; the class keeps a {known.dim()}-d tensor there")
    _real(key, value, target)
    return torch.zeros_like(known, dtype=value.dtype)


def _count(key: str, value: Any, target: Target) -> Any:
    """A step count: a finite number >= 0 (a tensor of one element, or a Python number)."""
    number = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"load_state_dict: {target.label}: state {key!r} has shape {_shape(value.shape)}, a step count has one element")
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
        raise ValueError(f"load_state_dict: {target.label}: state {key!r} is {number!r}, not a step count (a finite number >= 0)")
    return _copied(value)


def _real(key: str, value: torch.Tensor, target: Target) -> None:
    if value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"load_state_dict: {target.label}: state {key!r} is {value.dtype}, which does not convert to the param's {target.dtype}")


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _kind(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim(), value.item() if value.numel() == 1 else None)
    return (type(value).__name__, value if isinstance(value, (int, float, bool, str, type(None))) else None)


def _step_or_refuse(probe: StateProbe, target: Target, hyper: dict, saved: dict, stand_in: dict, state: dict, fresh: dict) -> None:
    try:
        probe.step_from(target, hyper, saved, stand_in)
    except Exception as error:
        name = probe.optimizer_class.__name__
        raise ValueError(
            f"load_state_dict: {target.label}: {name} cannot step from the given state ({_brief(error)}): it has "
            f"keys {sorted(map(str, state))}, {name} keeps {sorted(map(str, fresh))}. The state dict was saved by another "
            "optimizer class or with other flags (amsgrad, momentum...), or is damaged; nothing was loaded"
        ) from None


def _brief(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
