"""``add_param_group`` after construction: the state that crosses a new bucket layout.

torch.optim appends a group and keeps every other param's state; LoRA adapters added
after some steps, or a group for layers unfrozen later, rely on it. fxzero's flat buffers
hold every param at a fixed place and each rank holds the state of its shards only, so a
new group means a new layout: fragments move between ranks. What must survive is taken out
whole before the old layout goes (:func:`carry`: the consolidated plain ``torch.optim``
state, plus the fp32 masters kept apart from bf16/fp16 or MXFP8 params) and cut into the
new fragments after (:func:`restore`). Both are collective; fp32 params' masters are the
param values themselves, which the new buffers copy. Old params keep their slots (the new
group comes last in group order), so the plain state's param indices still name them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from .comm import DataParallelGroup
from .param_table import ParamTable
from .shards import BucketShard, FragmentTensor
from .state_dict import consolidated_state, plain_fragment_states

__all__ = ["CarriedState", "carry", "pending_gradients", "restore"]

_MASTER = "fp32 master"


@dataclasses.dataclass(frozen=True)
class CarriedState:
    """The old layout's state, whole per param (every rank holds all of it for a moment)."""

    plain: dict[str, Any]
    """Every param's state in torch.optim's format, params numbered by slot."""
    masters: dict[int, torch.Tensor]
    """Slot -> the param's whole fp32 master, for params whose masters are kept apart."""


def pending_gradients(written: bool) -> Optional[str]:
    """Gradients in the old buffers would not survive the new layout: refused, naming when to call it."""
    if not written:
        return None
    return (
        "fxzero: add_param_group after a backward whose gradients are still in the optimizer's buffers: the new "
        "param group lays the buffers out anew, and those gradients would be lost. Call it between steps (after "
        "opt.step() or opt.zero_grad(), before the next backward), on every rank."
    )


def _separate(fragment: FragmentTensor, shards: Sequence[BucketShard]) -> bool:
    storage = fragment.param.untyped_storage().data_ptr()
    return any(not s.main_is_param and s.main.untyped_storage().data_ptr() == storage for s in shards)


def carry(
    states: Sequence[dict[str, Any]], table: ParamTable, fragments: Sequence[FragmentTensor], shards: Sequence[BucketShard], dp: DataParallelGroup
) -> CarriedState:
    """Join every param's wrapped-optimizer state (``states[i]`` of ``fragments[i]``) and,
    where a bucket keeps them apart, its fp32 master from every rank's fragments
    (collective: every rank calls it; whether masters are apart is the same on every rank)."""
    plain = {"state": consolidated_state(table, fragments, states, dp), "param_groups": [{"params": list(s)} for s in table.group_slots]}
    if all(s.main_is_param for s in shards):
        return CarriedState(plain, {})
    held = [{_MASTER: f.param} if _separate(f, shards) else {} for f in fragments]
    joined = consolidated_state(table, fragments, held, dp)
    return CarriedState(plain, {slot: state[_MASTER] for slot, state in joined.items() if _MASTER in state})


def restore(
    carried: CarriedState, table: ParamTable, fragments: Sequence[FragmentTensor], shards: Sequence[BucketShard]
) -> list[dict[str, Any]]:
    """Write the carried masters into this rank's new fragments; return each fragment's
    wrapped-optimizer state, for ``load_fragment_states`` (the params of the added group,
    after the carried ones in slot order, start with none, as under torch.optim)."""
    for frag in fragments:
        master = carried.masters.get(frag.slot)
        if master is not None and _separate(frag, shards):
            lo = frag.where.param_offset
            frag.param.view(-1).copy_(master.reshape(-1)[lo : lo + frag.where.numel])
    groups = list(carried.plain["param_groups"])
    for slots in table.group_slots[len(groups) :]:
        groups.append({"params": list(slots)})
    return plain_fragment_states({"state": carried.plain["state"], "param_groups": groups}, table, fragments)
