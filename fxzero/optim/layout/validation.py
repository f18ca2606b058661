"""Checks on what users hand to :class:`~fxzero.distributed_optimizer.DistributedOptimizer`.

All of them run before any param is touched, and each error names the param, group
or keyword at fault, so a bad call leaves the model exactly as it was.
"""

from __future__ import annotations

import difflib
import warnings

import logging
import operator
from typing import Any, Optional, Sequence

import torch

# the class catalogues and what they decide live in their own module; imported from here too
from .optimizer_classes import (
    ELEMENTWISE_OPTIMIZERS,
    SHAPE_AWARE_OPTIMIZERS,
    check_first_order,
    require_optimizer_class,
    resolve_state_sharding,
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "SHAPE_AWARE_OPTIMIZERS",
    "resolve_state_sharding",
    "check_first_order",
    "check_group_keys",
    "check_leaves",
    "check_managed_params",
    "check_optimizer_kwargs",
    "check_param_groups_kept",
    "layout_order",
]

log = logging.getLogger(__name__)

_GROUP_KEYS = ("params", "param_names")


def check_optimizer_kwargs(
    optimizer_class: type, kwargs: dict[str, Any], params: Optional[Sequence[tuple[str, torch.Tensor]]] = None
) -> dict[str, Any]:
    """Build ``optimizer_class`` on a tiny probe tensor: unknown or invalid keyword arguments
    fail here, with the optimizer's own message, and its full defaults come back.

    ``params`` (label, param) are the tensors it will get whole (whole-param ownership); the
    probe then takes each of their numbers of dimensions, so an optimizer that refuses some
    params (Muon: 2-D only) is reported naming such a param, not blaming the keywords."""
    require_optimizer_class(optimizer_class)
    ndims = sorted({max(p.dim(), 1) for _, p in params}) if params else [1]
    probes = {ndim: _probe(optimizer_class, kwargs, ndim) for ndim in ndims}
    working = [p for p in probes.values() if isinstance(p, torch.optim.Optimizer)]
    if not working:
        error = probes[ndims[0]]
        kind = TypeError if isinstance(error, TypeError) else ValueError
        shown = sorted(kwargs) if kind is TypeError else kwargs
        raise kind(f"{optimizer_class.__name__} rejected keyword arguments {shown}: {error}") from error
    for label, param in params or ():
        error = probes[max(param.dim(), 1)]
        if isinstance(error, Exception):
            raise type(error)(
                f"{optimizer_class.__name__} does not take param {label} (shape {tuple(param.shape)}): {error} Give it "
                "only the params it takes (e.g. one DistributedOptimizer with Muon over the 2-D matrices and one with "
                "AdamW over the rest)."
            ) from error
    return dict(working[0].defaults)


def _probe(optimizer_class: type, kwargs: dict[str, Any], ndim: int) -> Any:
    try:
        return optimizer_class([torch.zeros((1,) * ndim)], **kwargs)
    except (TypeError, ValueError) as error:
        return error


def check_group_keys(groups: Sequence[dict[str, Any]], defaults: dict[str, Any], optimizer_class: type) -> None:
    """torch.optim keeps group keys its optimizer does not read (timm's ``lr_scale``, a
    ``name``, a scheduler's ``initial_lr``), and so does fxzero. One that looks like a typo
    of a real option (``weight_decy``) would silently do nothing: that gets a warning."""
    for index, group in enumerate(groups):
        for key in sorted(set(group) - set(defaults) - set(_GROUP_KEYS)):
            close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.8)
            if close:
                warnings.warn(
                    f"fxzero: param_groups[{index}] has option {key!r}, which {optimizer_class.__name__} does not "
                    f"read; did you mean {close[0]!r}? (kept as torch.optim keeps it, with no effect)",
                    stacklevel=4,
                )


def describe_param(group_index: int, index: int, group: dict[str, Any], names: Optional[dict[int, str]] = None) -> str:
    """How an error names a param: its module path (``module=``) or ``named_parameters()`` name, else its position."""
    param = group["params"][index]
    name = (names or {}).get(id(param))
    if not name and group.get("param_names"):
        name = group["param_names"][index]
    if name:
        return f"param {name!r} (shape {tuple(param.shape)})"
    return f"param_groups[{group_index}]['params'][{index}] (shape {tuple(param.shape)})"


def _check_param(param: torch.Tensor, where: str, device: torch.device, adding_to: object = None) -> None:
    if not param.is_leaf:
        raise ValueError(f"{where} is not a leaf tensor; an optimizer can only own leaf params")
    if not param.is_floating_point():
        raise ValueError(f"{where} has dtype {param.dtype}; only floating-point params can be optimized")
    if param.is_sparse or param.layout != torch.strided:
        raise ValueError(f"{where} has layout {param.layout}; only dense (strided) params are supported")
    if param.is_meta:
        raise ValueError(
            f"{where} is on the meta device (it has a shape but no data); materialize the model first, "
            "e.g. model.to_empty(device=...) and then initialize its weights (reset_parameters() or your "
            "init), and build the DistributedOptimizer after that"
        )
    if param.device != device:
        raise ValueError(f"{where} is on {param.device} but other params are on {device}; use one device")
    manager = getattr(param, "_fxzero_manager", None)
    if manager is not None and manager() is not None and manager() is not adding_to:
        raise ValueError(f"{where} is already managed by another fxzero.DistributedOptimizer")


def check_managed_params(
    groups: Sequence[dict[str, Any]], names: Optional[dict[int, str]] = None, adding_to: object = None
) -> tuple[torch.Tensor, ...]:
    """Validate every param and return them flat, in group order; errors name a param by
    ``names`` (``id(param) -> module path``) where it has one. Frozen params
    (``requires_grad=False``) are managed like the others: they get no gradient, so the
    step leaves them alone (no state, no weight decay) as torch.optim does, until unfrozen.
    ``adding_to``: the optimizer a group is added to (its own params are not another's)."""
    params: list[torch.Tensor] = []
    for g, group in enumerate(groups):
        for i, param in enumerate(group["params"]):
            device = params[0].device if params else param.device
            _check_param(param, describe_param(g, i, group, names), device, adding_to)
            params.append(param)
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a param appears more than once in the optimizer's param groups")
    if not params:
        raise ValueError("DistributedOptimizer got an empty parameter list")
    return tuple(params)


def layout_order(
    params: Sequence[torch.Tensor], module: Optional[torch.nn.Module], num_groups: int
) -> tuple[torch.Tensor, ...]:
    """The order buckets are laid out in: ``module``'s registration order if given
    (params it does not hold follow, in group order), else group order."""
    if module is None:
        if num_groups > 1:
            log.warning(
                "fxzero.DistributedOptimizer: %d param groups and no module=...; buckets follow group order, "
                "which mixes layers and delays reduce-scatters to the end of backward. Pass module=model.",
                num_groups,
            )
        return tuple(params)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    rank = {id(p): i for i, p in enumerate(module.parameters())}
    inside = sorted((p for p in params if id(p) in rank), key=lambda p: rank[id(p)])
    if not inside:
        raise ValueError("module holds none of the optimizer's params; pass the model they belong to")
    return tuple(inside) + tuple(p for p in params if id(p) not in rank)


def check_leaves(group: dict[str, Any], group_index: int) -> None:
    """Run before torch.optim's own check so the error names the param."""
    if not isinstance(group, dict) or "params" not in group:
        return
    params = group["params"]
    if isinstance(params, (torch.Tensor, tuple)):
        params = [params]
    group["params"] = params = list(params) if not isinstance(params, set) else params
    for index, item in enumerate(params):
        name, param = item if isinstance(item, tuple) else (None, item)
        where = f"param {name!r}" if name else f"param_groups[{group_index}]['params'][{index}]"
        if isinstance(param, torch.Tensor) and not param.is_leaf:
            raise ValueError(f"{where} (shape {tuple(param.shape)}) is not a leaf tensor; an optimizer can only own leaf params")


def check_param_groups_kept(groups: Sequence[dict[str, Any]], built: Sequence[Sequence[torch.Tensor]]) -> None:
    """The params of ``groups`` are still those the optimizer was built with (``built``), group
    by group, in order. torch.optim steps whatever ``param_groups`` holds, so a param appended
    to it (or a group appended) trains there; the flat buffers are laid out once, so here it
    would silently not train. One C-level comparison per group."""
    if len(groups) == len(built) and all(map(_same_params, groups, built)):
        return
    if len(groups) != len(built):
        change = f"it has {len(groups)} param groups; it was built with {len(built)}"
    else:
        index = next(i for i, (group, params) in enumerate(zip(groups, built)) if not _same_params(group, params))
        now, then = len(groups[index]["params"]), len(built[index])
        held = f"{now} params, not the {then}" if now != then else "other params than those"
        change = f"param_groups[{index}]['params'] holds {held} it was built with"
    raise RuntimeError(
        f"fxzero: the optimizer's param_groups changed after construction ({change}). A DistributedOptimizer "
        "lays out its flat buffers once, so a param added to (or removed from) param_groups would not train (or "
        "would keep training) as under torch.optim. Build a new DistributedOptimizer with every param group; "
        "edit hyperparameters (lr, weight_decay, ...) in place, as schedulers do."
    )


def _same_params(group: dict[str, Any], params: Sequence[torch.Tensor]) -> bool:
    current = group["params"]
    return len(current) == len(params) and all(map(operator.is_, current, params))
