"""``add_param_group`` after construction: the state that crosses a new bucket layout.

torch.optim appends a group and keeps every other param's state; LoRA adapters added
after some steps, or a group for layers unfrozen later, rely on it. fxzero's flat buffers
hold every param at a fixed place and each rank holds the state of its shards only, so a
new group means a new layout: fragments move between ranks. What must survive is taken out
whole before the old layout goes (``consolidated_state_dict()``: the plain ``torch.optim``
state, plus the fp32 masters kept apart from bf16/fp16 or MXFP8 params) and cut into the
new fragments after (:func:`carried_over`); fp32 params' masters are the param values
themselves, which the new buffers copy. Old params keep their slots (the new
group comes last in group order), so the plain state's param indices still name them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..layout.param_table import ParamTable
from ..layout.shards import FragmentTensor
from .state_dict import plain_fragment_states

__all__ = ["carried_over", "pending_gradients"]


def pending_gradients(written: bool) -> Optional[str]:
    """Gradients in the old buffers would not survive the new layout: refused, naming when to call it."""
    if not written:
        return None
    return (
        "fxzero: add_param_group after a backward whose gradients are still in the optimizer's buffers: the new "
        "param group lays the buffers out anew, and those gradients would be lost. Call it between steps (after "
        "opt.step() or opt.zero_grad(), before the next backward), on every rank."
    )


def carried_over(whole: dict[str, Any], table: ParamTable, fragments: Sequence[FragmentTensor]) -> list[dict[str, Any]]:
    """This rank's new fragments' cut of ``whole``, the old layout's
    ``consolidated_state_dict()`` (its fp32 masters included, where they are apart): the
    params of the added group, after the carried ones in slot order, start with none, as
    under torch.optim."""
    groups = [{"params": list(slots)} for slots in table.group_slots]
    return plain_fragment_states({"state": whole["state"], "param_groups": groups}, table, fragments)
