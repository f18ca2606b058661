"""``DistributedOptimizer.state_dict()`` / ``load_state_dict()``: this rank's state, for a
resume at the same world size and layout (``fxzero.save_checkpoint`` resumes at any), and
the import of a plain ``torch.optim`` state dict (a run that trained without fxzero)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..layout.buffers import ParamAndGradBuffer
from ..communication.comm import DataParallelGroup
from ..layout.param_table import ParamTable
from ..layout.shards import FragmentTensor

__all__ = [
    "MASTER_KEY",
    "NOT_HYPERPARAMETERS",
    "REMAINDER_KEY",
    "STATE_FORMAT",
    "check_state_dict",
    "copy_hyperparameters",
    "consolidated_state",
    "is_elementwise_state",
    "hyperparameters",
    "is_plain_state_dict",
    "layout_key",
    "plain_fragment_states",
]

STATE_FORMAT = "fxzero.DistributedOptimizer/1"
"""``rank_state_dict()``'s format: one rank's shard."""

MASTER_KEY = "fxzero_master"
"""A param's fp32 master values in a whole-state dict, where they are kept apart from the
params (bf16/fp16 params, the MXFP8 gather): without them a resume would restart the masters
from the rounded params. torch.optim keeps an unknown per-param key as it is and never reads it."""


def check_state_dict(state_dict: Any, dp: DataParallelGroup, layout: list[Any], num_groups: int) -> None:
    """Refuse, naming the difference, a state dict saved by another layout, rank or world size."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise ValueError(
            f"load_state_dict: not a {STATE_FORMAT} state dict, nor a plain torch.optim one "
            "(a dict with 'state' and 'param_groups')"
        )
    if state_dict["world_size"] != dp.size or state_dict["rank"] != dp.rank:
        raise ValueError(
            f"load_state_dict: saved on rank {state_dict['rank']} of {state_dict['world_size']}, "
            f"loading on rank {dp.rank} of {dp.size}: opt.state_dict() holds one rank's shard and resumes only at "
            "the same world size, on the same rank. To resume at another world size, save with "
            "fxzero.save_checkpoint(dir, model, opt, step=...) and load with fxzero.load_checkpoint."
        )
    if state_dict["layout"] != layout:
        raise ValueError(
            f"load_state_dict: bucket layout differs (saved {state_dict['layout']}, current {layout}); "
            "use the same params, bucket_size and padding as when saving"
        )
    if len(state_dict["param_groups"]) != num_groups:
        raise ValueError(
            f"load_state_dict: {len(state_dict['param_groups'])} saved param groups, optimizer has {num_groups}"
        )


def layout_key(buffers: Sequence[ParamAndGradBuffer]) -> list[tuple[str, int, list[tuple[int, int]]]]:
    """What a same-world-size resume must find unchanged: each buffer's dtype, size, bucket
    bounds and, under whole-param ownership, each param's owner."""
    return [(str(b.param_dtype), b.plan.numel, [(s.start, s.end) for s in b.plan.buckets], b.plan.owners) for b in buffers]


REMAINDER_KEY = "param_remainder"
"""A fragment's int16 remainders in fxzero's per-rank format under ``Config.param_remainders``
(:class:`~fxzero.optim.update.shard_adam.ShardAdamW`): the low bits of its fp32 master."""

NOT_HYPERPARAMETERS = frozenset(("params", "param_names"))
"""Param-group keys that are not hyperparameters (the wrapped optimizer's groups hold their own)."""


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its params (and their names)."""
    return {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS}


def copy_hyperparameters(source: dict[str, Any], target: dict[str, Any]) -> None:
    """Give ``target`` (a wrapped optimizer's param group) ``source``'s hyperparameters, as
    an LR scheduler left them. A value ``target`` holds as a tensor stays that tensor and
    takes a number by ``fill_``: torchao's low-bit optimizers keep ``lr`` as a tensor and
    refuse a step whose ``lr`` was replaced by a number ("lr was changed to a non-Tensor
    object"); a tensor ``source`` hands over itself replaces it, as torch.optim would."""
    for name, value in source.items():
        if name in NOT_HYPERPARAMETERS:
            continue
        held = target.get(name)
        if isinstance(held, torch.Tensor) and not isinstance(value, torch.Tensor):
            held.fill_(value)
        else:
            target[name] = value


def is_plain_state_dict(state_dict: Any) -> bool:
    """A ``torch.optim.Optimizer.state_dict()``: per-param state keyed by index, groups listing indices."""
    return isinstance(state_dict, dict) and "format" not in state_dict and {"state", "param_groups"} <= set(state_dict)


def plain_fragment_states(
    state_dict: dict[str, Any], table: ParamTable, fragments: Sequence[FragmentTensor]
) -> list[dict[str, Any]]:
    """This rank's share of a plain torch.optim state dict, one state per fragment: each
    elementwise tensor (as many elements as its param) sliced to the fragment, everything
    else (AdamW's ``step``) as it is. torch.optim numbers params in group order, which is
    the table's slot order; the groups hold as many params as this optimizer's (a given state
    dict's were checked first: :func:`~fxzero.optim.state.state_check.check_groups`)."""
    saved = state_dict["param_groups"]
    order = [index for group in saved for index in group["params"]]
    states = []
    for frag in fragments:
        state = state_dict["state"].get(order[frag.slot], {})
        numel, where = table.params[frag.slot].numel(), frag.where
        states.append({key: _fragment_of(value, numel, where.param_offset, frag.param.shape) for key, value in state.items()})
    return states


def _fragment_of(value: Any, numel: int, offset: int, shape: torch.Size) -> Any:
    """A copy of each tensor: torch.optim's loader keeps some (``step``) as given, and the
    optimizer updates them in place, so fragments must never share one. A tensor with as
    many elements as the param is cut to the fragment and shaped as the fragment is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and value.numel() == numel:
        return value.detach().reshape(-1)[offset : offset + shape.numel()].clone().view(shape)
    return value.detach().clone()


def is_elementwise_state(value: Any, fragment: FragmentTensor) -> bool:
    """A state tensor shaped like the fragment it belongs to (AdamW's moments, Muon's
    momentum): it holds one value per element and is cut, joined and resharded as the
    param is. Anything else (a step count, Adafactor's row and column statistics) is kept
    whole, by the rank(s) holding it."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == fragment.param.shape


def consolidated_state(
    table: ParamTable, fragments: Sequence[FragmentTensor], states: Sequence[dict[str, Any]], dp: DataParallelGroup
) -> dict[int, dict[str, Any]]:
    """Every param's whole wrapped-optimizer state, from each rank's fragments (collective).

    Ranks first exchange what they hold (which keys, elementwise or not, and the small
    non-elementwise values such as AdamW's ``step``, which every owner of a param holds
    alike); then one all-reduce per dtype sums the elementwise tensors, each rank having
    written only its own fragments into zeros (fragments never overlap)."""
    held: dict[int, dict[str, Any]] = {}
    for frag, state in zip(fragments, states):
        for key, value in state.items():
            elementwise = is_elementwise_state(value, frag)
            entry = ("elementwise", str(value.dtype).removeprefix("torch.")) if elementwise else ("value", _portable(value))
            held.setdefault(frag.slot, {})[key] = entry
    spec = _merge([held] if dp.size == 1 else _all_gather_objects(held, dp))
    full = {slot: {} for slot in sorted(spec)}
    flat: dict[torch.dtype, list[tuple[int, str, torch.Tensor]]] = {}
    for slot, entries in full.items():
        param = table.params[slot]
        for key, (kind, info) in sorted(spec[slot].items()):
            if kind == "elementwise":
                tensor = torch.zeros(param.numel(), dtype=getattr(torch, info), device=param.device)
                flat.setdefault(tensor.dtype, []).append((slot, key, tensor))
                entries[key] = tensor.view(param.shape)
            else:
                entries[key] = info
    for frag, state in zip(fragments, states):
        for key, value in state.items():
            if spec[frag.slot][key][0] == "elementwise":
                lo = frag.where.param_offset
                full[frag.slot][key].view(-1)[lo : lo + frag.where.numel].copy_(value.reshape(-1))
    if dp.size > 1:
        for dtype in sorted(flat, key=str):
            tensors = [t for _, _, t in flat[dtype]]
            joined = torch.cat(tensors)
            dp.all_reduce_sum(joined, "all-reduce of the consolidated optimizer state")
            offset = 0
            for tensor in tensors:
                tensor.copy_(joined[offset : offset + tensor.numel()])
                offset += tensor.numel()
    return full


def _portable(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _all_gather_objects(obj: Any, dp: DataParallelGroup) -> list[Any]:
    gathered: list[Any] = [None] * dp.size
    torch.distributed.all_gather_object(gathered, obj, group=dp.group)
    return gathered


def _merge(helds: Sequence[dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """The first rank's entry for each (param, key): non-elementwise values are the same on every owner."""
    merged: dict[int, dict[str, Any]] = {}
    for held in helds:
        for slot, entries in held.items():
            for key, entry in entries.items():
                merged.setdefault(slot, {}).setdefault(key, entry)
    return merged
