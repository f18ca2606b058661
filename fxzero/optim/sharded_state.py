"""The state half of :class:`~fxzero.distributed_optimizer.DistributedOptimizer`: ``opt.state``,
``state_dict()`` / ``load_state_dict()``, the consolidated export and the small fragment API
that checkpoints use.

Why a mixin: these methods only read the parts the optimizer assembles (listed below as
annotations) and never build any, so they live apart from construction and the step. The
formats themselves are :mod:`fxzero.optim.state_dict`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._torch_compat import called_from_torch_checkpoint, with_load_state_dict_hooks, with_state_dict_hooks
from .buffers import ParamAndGradBuffer
from .comm import DataParallelGroup
from .mesh import MeshParams
from .param_table import ParamTable
from .rank_state import RankState, held_on_any_rank
from .shards import BucketShard, FragmentTensor
from .state_dict import STATE_FORMAT, check_state_dict, consolidated_state, hyperparameters, is_plain_state_dict
from .state_dict import layout_key, plain_fragment_states

__all__ = ["ShardedState"]


class ShardedState:
    """State methods over the parts a DistributedOptimizer holds."""

    dp: DataParallelGroup
    buffers: Sequence[ParamAndGradBuffer]
    shards: Sequence[BucketShard]
    fragments: Sequence[FragmentTensor]
    param_table: ParamTable
    params: Sequence[torch.Tensor]
    param_groups: list[dict[str, Any]]
    local: torch.optim.Optimizer
    mesh_params: MeshParams
    _rank_state: RankState
    finish_param_sync: Callable[[], None]
    _publish_and_gather: Callable[[], None]

    @property
    def state(self) -> RankState:  # type: ignore[override]
        """Each managed param's state as this rank holds it (:mod:`fxzero.optim.rank_state`)."""
        return self._rank_state

    @state.setter
    def state(self, value: Any) -> None:
        if value:  # torch.optim.Optimizer.__init__ assigns an empty dict
            raise AttributeError("DistributedOptimizer.state is a read-only view; load state with load_state_dict")

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, for a resume at the same world size and layout; not a
        collective, so one rank alone may save it. Called from ``torch.distributed.checkpoint``
        (``get/set_optimizer_state_dict``, ``dcp.save``/``load``: collectives every rank calls;
        caller told apart by its module), it is :meth:`consolidated_state_dict`: the whole
        state in plain format, what they read and what DCP's dedup of plain tensors keeps right.
        State-dict hooks registered on the optimizer run around either, as in torch.optim."""
        # asked here, not inside the hooks' helper: it counts the frames above this method
        produce = self.consolidated_state_dict if called_from_torch_checkpoint() else self._rank_state_dict
        return with_state_dict_hooks(self, produce)  # type: ignore[arg-type]

    def _rank_state_dict(self) -> dict[str, Any]:
        self.finish_param_sync()
        return {
            "format": STATE_FORMAT,
            "world_size": self.dp.size,
            "rank": self.dp.rank,
            "layout": layout_key(self.buffers),
            "param_groups": [hyperparameters(g) for g in self.param_groups],
            "local": self.local.state_dict(),
            "main_shards": [s.main for s in self.shards if not s.main_is_param],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank, or a plain ``torch.optim`` state
        dict of the same optimizer class (a run without fxzero: each rank takes its shard).
        Collective (the params are gathered afterwards): every rank loads, or, if any rank's
        state dict is wrong, every rank raises, naming that rank's problem. Load-state-dict
        hooks registered on the optimizer run around it, as in torch.optim."""
        with_load_state_dict_hooks(self, state_dict, self._load_state_dict)  # type: ignore[arg-type]

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        plain = is_plain_state_dict(state_dict)
        if plain:
            self.refuse_param_shaped_state("load_state_dict of a plain torch.optim state dict")
        problem, states = None, []
        try:
            if plain:
                states = plain_fragment_states(state_dict, self.param_table, self.fragments)
            else:
                check_state_dict(state_dict, self.dp, layout_key(self.buffers), len(self.param_groups))
        except (ValueError, KeyError, TypeError) as err:
            problem = str(err)
        self.dp.agree(problem, "load_state_dict")
        with self.replacing_state():
            if plain:
                self.load_fragment_states(states)
            else:
                self.local.load_state_dict(state_dict["local"])
                separate = [s for s in self.shards if not s.main_is_param]
                for shard, saved in zip(separate, state_dict["main_shards"]):
                    shard.main.copy_(saved)
            for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                group.update(hyperparameters(saved))

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in plain ``torch.optim`` format, on every rank
        (collective: every rank of the group calls it). It loads into the wrapped
        optimizer class over the same param groups without fxzero, or back into a
        DistributedOptimizer at any world size (:meth:`load_state_dict`)."""
        self.refuse_param_shaped_state("consolidated_state_dict")
        states = [self.fragment_state(f) for f in self.fragments]
        state = consolidated_state(self.param_table, self.fragments, states, self.dp)
        groups = [
            hyperparameters(group) | {"params": list(self.param_table.group_slots[g])}
            for g, group in enumerate(self.param_groups)
        ]
        return {"state": state, "param_groups": groups}

    def refuse_param_shaped_state(self, what: str) -> None:
        """Param-shaped state in plain ``torch.optim`` format of a DTensor param would need its
        global shape, gathered over the other mesh dimensions too, which this format's export
        does not do yet: refused, rather than a state of the local shape saved under the global
        param's name. (fxzero's checkpoints store global shapes: they are not refused.)"""
        if self.mesh_params.any:
            slot = min(self.mesh_params.dtensor_slots)
            raise NotImplementedError(
                f"fxzero: {what} with DTensor params (e.g. {self.param_table.label(slot)!r}) is not supported yet; "
                "fxzero.save_checkpoint / load_checkpoint (any data-parallel size and tensor-parallel degree) and "
                "opt.state_dict() / opt.load_state_dict() of fxzero's own per-rank format (same mesh and layout) are."
            )

    # ---- the state API checkpoints use (load_state_dict uses it too) -------------
    @contextlib.contextmanager
    def replacing_state(self) -> Iterator[None]:
        """Replace this rank's fp32 masters (``fragments[i].param``) or the wrapped
        optimizer's state inside the block. Gathers in flight land first, so none lands
        over what is loaded; on exit the masters are published and gathered, so every
        param holds the loaded values."""
        self.finish_param_sync()
        yield
        self._publish_and_gather()
        self.finish_param_sync()
        self._rank_state.held = held_on_any_rank(self.local, self.dp, self.params[0].device)

    def fragment_state(self, fragment: FragmentTensor) -> dict[str, Any]:
        """The wrapped optimizer's state of one of this rank's :attr:`fragments` (AdamW's
        ``exp_avg``, ``exp_avg_sq``, ``step``); empty before its first update."""
        return self.local.state.get(fragment.param, {})

    def load_fragment_states(self, states: Sequence[dict[str, Any]]) -> None:
        """Give the wrapped optimizer ``states[i]`` for ``fragments[i]`` (inside
        :meth:`replacing_state`); torch.optim's loader casts and moves each tensor as its
        own policy wants."""
        if len(states) != len(self.fragments):
            raise ValueError(f"load_fragment_states: {len(states)} states for {len(self.fragments)} fragments")
        index_of = {id(p): i for i, p in enumerate(p for group in self.local.param_groups for p in group["params"])}
        loaded = {index_of[id(f.param)]: state for f, state in zip(self.fragments, states) if state}
        self.local.load_state_dict({"state": loaded, "param_groups": self.local.state_dict()["param_groups"]})

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: wrapped-optimizer state + separate fp32 mains."""
        total = sum(s.main.nbytes for s in self.shards if not s.main_is_param)
        for per_param in self.local.state.values():
            total += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
        return total

