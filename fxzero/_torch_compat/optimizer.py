"""``torch.optim.Optimizer``'s hooks, run around the optimizer fxzero wraps as torch runs them.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["unhooked_step", "with_load_state_dict_hooks", "with_state_dict_hooks"]


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """``optimizer.step`` without the wrapper ``torch.optim.Optimizer`` puts around every
    class's ``step`` (``Optimizer.profile_hook_step``: a profiler range and the global and
    per-instance step hooks), for the optimizer fxzero wraps. Under DDP a hook registered
    with ``register_optimizer_step_pre_hook`` runs once per step, with the user's
    optimizer; through the wrapper it would also run for the private wrapped one, a
    second time. When the wrapped optimizer has hooks of its own (its class registered
    some), or its class's ``step`` is not the wrapper, its plain ``step`` runs them.
    Reads ``step.hooked``, ``step.__wrapped__`` and ``_optimizer_step_{pre,post}_hooks``."""
    step = type(optimizer).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        return optimizer.step

    def run() -> Any:
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            return optimizer.step()
        return inner(optimizer)

    return run


def with_state_dict_hooks(optimizer: torch.optim.Optimizer, produce: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``produce()`` between ``optimizer``'s state-dict hooks (``register_state_dict_pre_hook``
    / ``_post_hook``), run as ``torch.optim.Optimizer.state_dict`` runs them: a post-hook may
    return a replacement. An optimizer that overrides ``state_dict`` gets none of this from
    torch. Reads ``_optimizer_state_dict_{pre,post}_hooks``."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = produce()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def with_load_state_dict_hooks(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]
) -> None:
    """``load(state_dict)`` between ``optimizer``'s load-state-dict hooks, as
    ``torch.optim.Optimizer.load_state_dict`` runs them: pre-hooks see a shallow copy and may
    return a replacement. Reads ``_optimizer_load_state_dict_{pre,post}_hooks``."""
    state_dict = state_dict.copy()
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)
