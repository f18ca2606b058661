"""Module hooks that make eager reads wait for the param all-gathers (:mod:`.param_sync`).

With ``Config.overlap_param_gather`` the step leaves gathers in flight. Compiled forwards
wait through ``fxzero::wait_params``; eager modules wait in forward pre-hooks installed
here, and the managed module's ``state_dict()`` / ``load_state_dict()`` land every gather
first. A copy or pickle of the module gets inert hooks: it is a plain module no optimizer
manages.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from ..._torch_compat import dynamo_runs_eagerly_at_top_level, own_params
from ..layout.buffers import Bucket
from ..layout.param_table import ParamTable
from .param_sync import ParamSync

__all__ = ["install_param_waits"]


class _Inert:
    """What a copy (``copy.deepcopy``, ``AveragedModel``) or a pickle (``torch.save(model)``)
    of a managed module holds in place of fxzero's hooks: the copy is a plain module that
    no optimizer manages, so it has nothing to wait for."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _SyncHook:
    """fxzero's module hooks act on one optimizer's :class:`ParamSync` (process group,
    gathers in flight): a copy of the module must not share it, and cannot copy it.
    Copying or pickling a hook first makes the params current (what
    ``state_dict()`` does), then gives an :class:`_Inert` hook."""

    sync: ParamSync

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        if any(self.sync.pending):
            self.sync.finish()
            _recopy(self.sync.buckets, memo)
        return _Inert()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # torch.save writes tensor bytes after pickling the whole object: they are current
        self.sync.finish()
        return (_Inert, ())


def _recopy(buckets: Sequence[Bucket], memo: dict[int, Any]) -> None:
    """Deepcopy copies a module's own params before its hooks (``_parameters`` comes first
    in its ``__dict__``): those copies were taken before the gathers landed; refresh them.
    ``memo`` maps the ``id`` of every object copied so far (kept alive by the copy) to its copy."""
    with torch.no_grad():
        for bucket in buckets:
            for param in bucket.params:
                copied = memo.get(id(param))
                if copied is not None:
                    copied.copy_(param)


class _FinishFirst(_SyncHook):
    """``state_dict`` / ``load_state_dict`` pre-hook: every gather lands first, so a state
    dict holds current values and a load is never overwritten by a gather in flight."""

    def __init__(self, sync: ParamSync) -> None:
        self.sync = sync

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.sync.finish()


class _WaitBeforeForward(_SyncHook):
    """The forward pre-hook of one module that owns managed params: it waits for the
    buckets of the module's own params. Traced by Dynamo it reads nothing of itself, so
    identical blocks' hooks, one object each, are guarded by their type alone and one
    compiled graph serves every block. (A hook whose traced path read its bucket indices
    made Dynamo recompile every block; one object shared by all modules made it check, on
    every call of a block's graph, that the block's modules still share it: a guard in
    Python, one per module after the first.)"""

    def __init__(self, sync: ParamSync, module: torch.nn.Module, buckets: tuple[int, ...]) -> None:
        self.sync, self.buckets = sync, buckets
        self.module = weakref.ref(module)
        """Confirms the module is the one hooked (a copy holding this hook is not)."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        # In a compiled region the graph's own fxzero::wait_params ops order the reads; the
        # marker puts a wait at the module's entry, for a forward that graph-breaks and runs
        # its rest eagerly (no pre-hook runs for that rest). See fxzero.compiled.ops.
        if torch.compiler.is_compiling():
            torch.ops.fxzero.module_entered(own_params(module))
            return
        if self.module() is not module:
            raise RuntimeError(
                f"fxzero: module {type(module).__name__} carries the param-gather hook of a "
                "DistributedOptimizer that does not manage its params (a copy of a managed module?)"
            )
        self.sync.wait_many(self.buckets)


# Run eagerly (a module called by eager code, after a graph break, inside a compiled
# region), the hook is plain Python: Dynamo would otherwise compile it into a graph of its
# own, once per module type it guards on, for a wait that needs no graph.
dynamo_runs_eagerly_at_top_level(_WaitBeforeForward.__call__)


def install_param_waits(module: torch.nn.Module, table: ParamTable, sync: ParamSync) -> list[Any]:
    """Forward pre-hooks on every submodule that owns managed params (waiting for their
    buckets) and ``state_dict`` / ``load_state_dict`` pre-hooks on ``module``; returns
    the hook handles. A copy or pickle of ``module`` gets inert hooks instead (:class:`_SyncHook`)."""
    owners = {}
    for sub in module.modules():
        slots = [table.find(p) for p in own_params(sub)]
        owned = {table.bucket_of_slot[s] for s in slots if s is not None}
        if owned:
            owners[id(sub)] = (sub, tuple(sorted(owned, reverse=True)))
    handles = [sub.register_forward_pre_hook(_WaitBeforeForward(sync, sub, buckets)) for sub, buckets in owners.values()]
    handles.append(module.register_state_dict_pre_hook(_FinishFirst(sync)))
    handles.append(module.register_load_state_dict_pre_hook(_FinishFirst(sync)))
    return handles
