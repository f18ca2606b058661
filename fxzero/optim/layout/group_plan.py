"""The param groups checked and ordered for a layout, before any buffer exists.

:class:`~fxzero.distributed_optimizer.DistributedOptimizer` plans at construction and again
when a param group is added later (``add_param_group``). Planning is local (no collective)
and touches no param, so a bad group is refused with the optimizer exactly as it was: the
caller then makes every rank agree before it lays anything out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from ..communication.comm import DataParallelGroup
from .mesh import MeshParams, check_mesh_params
from .param_table import param_names
from .validation import check_group_keys, check_managed_params, check_optimizer_kwargs, layout_order

__all__ = ["GroupPlan", "label", "plan_groups"]


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What the layout is built from."""

    params: tuple[torch.Tensor, ...]
    """Every managed param, in group order (slot order)."""
    layout: tuple[torch.Tensor, ...]
    """The same params in the order the buckets are laid out in."""
    names: dict[int, str]
    """``id(param) -> name`` (module path with ``module=``)."""
    mesh_params: MeshParams
    defaults: dict[str, Any]
    """The wrapped optimizer's full defaults (torch.optim's ``optimizer.defaults``)."""


def plan_groups(
    groups: Sequence[dict[str, Any]],
    module: Optional[torch.nn.Module],
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dp: DataParallelGroup,
    *,
    whole_params: bool,
    adding_to: object = None,
) -> GroupPlan:
    """Check ``groups`` and fill in each group's missing hyperparameters from the defaults
    (``adding_to``: the optimizer whose groups these are, when one is added later)."""
    names = param_names(groups, module)
    probed = [(label(names, g, i, p), p) for g, group in enumerate(groups) for i, p in enumerate(group["params"])]
    defaults = check_optimizer_kwargs(optimizer_class, kwargs, probed if whole_params else None)
    check_group_keys(groups, defaults, optimizer_class)
    for group in groups:
        for name, value in defaults.items():
            group.setdefault(name, value)
    params = check_managed_params(groups, names, adding_to)
    mesh_params = check_mesh_params(params, [where for where, _ in probed], dp, whole_params=whole_params)
    return GroupPlan(params, layout_order(params, module, len(groups)), names, mesh_params, defaults)


def label(names: dict[int, str], group: int, index: int, param: torch.Tensor) -> str:
    """A param as errors name it: its name, else its place in the param groups."""
    name = names.get(id(param))
    return repr(name) if name else f"param_groups[{group}]['params'][{index}]"
