"""Which update steps this rank's shard, decided once, in one place: predicates -> a plan -> the parts.

Three updates can step the shard (each a module of this room):

* **the wrapped class**, fragment by fragment: any ``torch.optim`` class, bitwise as the user built it;
* **its flat runs** (:mod:`.flat_update`): the same class over one tensor per run of adjacent
  fragments, where that gives every element the same bits (elementwise classes on the CPU, checked
  again before each step, since it depends on the state's homing);
* **fxzero's own Adam** (:mod:`.shard_adam`): for the precision options torch.optim cannot keep
  (narrow moments, remainders), optionally compiled (:mod:`.fused_run`).

And, independently, whether the step goes **bucket by bucket** (:mod:`.bucketed_update`): when there
are gathers to overlap and the class updates each param from its own state alone.

:func:`plan_update` takes plain values (the options as the user set them, the class, the groups'
flags and the params' dtypes), refuses what cannot go together, naming the option, and returns an
:class:`UpdatePlan`; :func:`build_update` makes the parts from it. Nothing else in the package
decides which update runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..layout.shards import FragmentTensor
from ..state.state_dict import hyperparameters
from .bucketed_update import ByBucket, updates_param_by_param
from .flat_update import FlatUpdate, Place
from .shard_adam import ADAM_CLASSES, UNSUPPORTED_FLAGS, ShardAdamW

__all__ = ["UpdatePlan", "build_update", "by_bucket", "plan_update"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How the shard is updated (see the module docstring)."""

    own: bool
    """fxzero's own Adam (:class:`~.shard_adam.ShardAdamW`) instead of the wrapped class."""
    state_dtypes: tuple[str, str]
    """Each Adam moment's dtype (``"fp32"``, ``"bf16"`` or ``"fp8"``)."""
    remainders: bool
    """bf16 params keep int16 remainders instead of fp32 masters."""
    compiled: Optional[bool]
    """fxzero's own per-run work compiled by Inductor (``Config.compiled_update``)."""
    decoupled: bool
    """AdamW's decoupled weight decay (the class is ``torch.optim.AdamW``)."""
    by_bucket: bool
    """The step updates one bucket at a time, each bucket's gather launched as soon as its shard is done."""


def plan_update(
    optimizer_class: type, groups: Sequence[dict[str, Any]], param_dtypes: Sequence[torch.dtype], label: Callable[[int], str], *,
    state_dtypes: tuple[str, str], remainders: bool, compiled: Optional[bool], rounding: str, stepwise: bool, option: str,
) -> UpdatePlan:  # fmt: skip
    """The plan for ``optimizer_class`` over ``groups`` (their flags) and params of ``param_dtypes``
    (``label(i)``: param ``i``'s name, for refusals).

    ``state_dtypes``, ``remainders``, ``compiled``, ``rounding``: the precision options as set;
    ``stepwise``: there are gathers the update may overlap; ``option``: how a refusal names the
    option that asked for fxzero's own update (``"Config.optimizer_state_dtype='bf16'"``).

    Raises:
        ValueError: a precision option this class, a group's flags or these params cannot have.
    """
    own = state_dtypes != ("fp32", "fp32") or remainders
    if own:  # fused=True: torch's fused kernel over fp32 moments (remainders), :mod:`.torch_fused`
        _check_own_update(optimizer_class, groups, option, allowed=("fused",) if state_dtypes == ("fp32", "fp32") else ())
    if (remainders or rounding != "auto") and torch.bfloat16 not in param_dtypes:
        flag = "param_remainders=True" if remainders else f"param_rounding={rounding!r}"
        raise ValueError(f"fxzero: Config.{flag} applies to bf16 params, and every managed param is {sorted(map(str, set(param_dtypes)))}")
    if remainders and torch.float16 in param_dtypes:
        slot = list(param_dtypes).index(torch.float16)
        raise ValueError(f"fxzero: Config.param_remainders=True keeps remainders of bf16 params; param {label(slot)!r} is float16")
    by_bucket = stepwise and updates_param_by_param(optimizer_class)
    if stepwise and not by_bucket:
        log.info("fxzero: %s may couple params in its step: every shard is updated before the gathers start", optimizer_class.__name__)
    return UpdatePlan(own, state_dtypes, remainders, compiled, optimizer_class is torch.optim.AdamW, by_bucket)


def _check_own_update(optimizer_class: type, groups: Sequence[dict[str, Any]], option: str, allowed: tuple[str, ...] = ()) -> None:
    if optimizer_class not in ADAM_CLASSES:
        raise ValueError(
            f"fxzero: {option} steps with fxzero's own Adam update, which only torch.optim.Adam and torch.optim.AdamW have; "
            f"{optimizer_class.__name__} keeps its state as it defines it (leave {option.split('=')[0]} at its default, or use torch.optim.AdamW)"
        )
    for index, group in enumerate(groups):
        for flag in UNSUPPORTED_FLAGS:
            if group.get(flag) and flag not in allowed:
                raise ValueError(f"fxzero: {option}: fxzero's own Adam update does not implement {flag}=True (param_groups[{index}])")


def build_update(
    plan: UpdatePlan, optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any], groups: Sequence[dict[str, Any]],
    fragments: Sequence[FragmentTensor], group_of: Sequence[int], bucket_of: Sequence[int], places: Callable[[], list[Place]],
    *, bucket_count: int,
) -> tuple[torch.optim.Optimizer, FlatUpdate]:  # fmt: skip
    """The optimizer over this rank's fragments (``group_of[i]``, ``bucket_of[i]``: fragment ``i``'s
    param group and bucket; ``places()``: where each lies, asked only for fxzero's own update) and the
    flat update that steps it."""
    local_groups = [hyperparameters(group) | {"params": []} for group in groups]
    for frag, group in zip(fragments, group_of):
        local_groups[group]["params"].append(frag.param)
    if plan.own:
        local: torch.optim.Optimizer = ShardAdamW(local_groups, fragments, places(), state_dtypes=plan.state_dtypes,
                                                  remainders=plan.remainders, decoupled=plan.decoupled, compiled=plan.compiled)  # fmt: skip
    else:
        local = optimizer_class(local_groups, **kwargs)
    return local, FlatUpdate(local, fragments, group_of, bucket_of, kwargs, bucket_count=bucket_count)


def by_bucket(plan: UpdatePlan, order: Sequence[int], after: Callable[[int], None]) -> Optional[ByBucket]:
    """The bucket-by-bucket step of ``plan`` (``order``: the buckets' order; ``after``: what follows each bucket's update)."""
    return ByBucket(tuple(order), after) if plan.by_bucket else None
