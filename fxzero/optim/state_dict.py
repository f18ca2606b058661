"""``DistributedOptimizer.state_dict()`` / ``load_state_dict()``: this rank's state, for a
resume at the same world size and layout (``fxzero.save_checkpoint`` resumes at any)."""

from __future__ import annotations

from typing import Any, Sequence

from .buffers import ParamAndGradBuffer
from .comm import DataParallelGroup

__all__ = ["STATE_FORMAT", "check_state_dict", "hyperparameters", "layout_key"]

STATE_FORMAT = "fxzero.DistributedOptimizer/1"


def check_state_dict(state_dict: Any, dp: DataParallelGroup, layout: list[Any], num_groups: int) -> None:
    """Refuse, naming the difference, a state dict saved by another layout, rank or world size."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise ValueError(f"load_state_dict: not a {STATE_FORMAT} state dict")
    if state_dict["world_size"] != dp.size or state_dict["rank"] != dp.rank:
        raise ValueError(
            f"load_state_dict: saved on rank {state_dict['rank']} of {state_dict['world_size']}, "
            f"loading on rank {dp.rank} of {dp.size}; same-world-size resume only"
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
    """What a same-world-size resume must find unchanged: each buffer's dtype, size and bucket bounds."""
    return [(str(b.param_dtype), b.plan.numel, [(s.start, s.end) for s in b.plan.buckets]) for b in buffers]


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its params (and their names)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
