"""The state half of :class:`~fxzero.distributed_optimizer.DistributedOptimizer`: ``opt.state``,
``state_dict()`` / ``load_state_dict()``, the consolidated export and the small fragment API
that checkpoints use (:mod:`fxzero.checkpoint`; a user replacing state by hand would bypass every
check of ``load_state_dict``).

Why an object of its own: these methods only read the parts the runtime assembles (given to the
constructor, as plain parts and values, never the optimizer or its ``Config``) and never build
any, so they live apart from construction and the step; the optimizer delegates to it. The
formats themselves are :mod:`fxzero.optim.state.state_dict`'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Protocol

import torch

from ..communication.arrival import Absent, Mismatch, meet
from ..layout.buffers import ParamAndGradBuffer
from ..communication.comm import DataParallelGroup
from ..layout.mesh import MeshParams
from ..layout.param_table import ParamTable
from .fragment_store import FragmentStore
from .rank_state import RankState, held_on_any_rank
from ..layout.shards import BucketShard, FragmentTensor
from .state_dict import MASTER_KEY, REMAINDER_KEY, STATE_FORMAT, check_state_dict, consolidated_state, hyperparameters, is_plain_state_dict
from .state_dict import layout_key, plain_fragment_states
from .state_check import StateProbe, Target, check_groups, check_states

__all__ = ["STATE_DICT_WARNING", "ShardedState"]

STATE_DICT_KEYS = "fxzero/state_dict"
STATE_DICT_WARNING = 10.0
"""Seconds a rank waits in ``state_dict()`` for the others before it warns, naming them."""


class Republish(Protocol):
    """What a state load needs of the gathers (:class:`~fxzero.optim.update.publish.Publish`):
    a part handed over at construction, not two callbacks."""

    def finish(self) -> None:
        """Land every gather in flight."""

    def all(self) -> None:
        """Put every bucket's fp32 masters into what its gather sends, and launch every gather."""


class ShardedState:
    """State methods over the parts of one runtime (rebuilt with it by ``add_param_group``).
    ``param_groups`` is the optimizer's own list (hyperparameters are read and loaded there);
    ``republish`` lands the gathers in flight and puts the fp32 masters into the params."""

    def __init__(
        self, *, dp: DataParallelGroup, table: ParamTable, param_groups: list[dict[str, Any]], buffers: Sequence[ParamAndGradBuffer],
        shards: Sequence[BucketShard], fragments: Sequence[FragmentTensor], local: torch.optim.Optimizer, mesh_params: MeshParams,
        timeout: float, republish: Republish, store: FragmentStore,
        probe: StateProbe,
    ) -> None:  # fmt: skip
        self.dp, self.param_table, self.param_groups, self.buffers = dp, table, param_groups, buffers
        self.shards, self.fragments, self.local, self.mesh_params = shards, fragments, local, mesh_params
        self.timeout, self._republish = timeout, republish
        self.params = table.params
        self.store = store
        """Where the per-fragment state and fp32 masters are kept (:mod:`fxzero.optim.state.fragment_store`)."""
        self.probe = probe
        """The wrapped class, asked whether it can step from a state given to :meth:`load_state_dict`."""
        self._index = {id(f): i for i, f in enumerate(fragments)}
        self.rank_state = RankState(table, fragments, local)
        """Each managed param's state as this rank holds it (``opt.state``, :mod:`fxzero.optim.state.rank_state`)."""
        self.consolidated: Optional[dict[str, Any]] = None
        """The whole state :meth:`consolidate_state_dict` left on this rank; dropped at the next ``step()``."""

    def begin_step(self) -> None:
        """A step starts: what :meth:`consolidate_state_dict` held is stale from here."""
        self.consolidated = None

    def stepped(self) -> None:
        """The wrapped optimizer updated params: it holds state on every rank now."""
        self.rank_state.hold(True)

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Gather the whole state onto rank ``to`` of the group (``None``: every rank;
        collective: every rank calls it), where the next :meth:`state_dict` returns it without
        a collective, as ``torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict``
        does. Lightning calls it on every rank before saving a checkpoint on rank 0. What is
        held is dropped at the next ``step()``, so a later save never returns stale state."""
        if to is not None and not (isinstance(to, int) and 0 <= to < self.dp.size):
            raise ValueError(f"consolidate_state_dict(to={to!r}): the optimizer's group has ranks 0..{self.dp.size - 1}")
        whole = self._collective_state_dict("consolidate_state_dict")
        self.consolidated = whole if to is None or self.dp.rank == to else None

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (fxzero's own format, ``STATE_FORMAT``), for a
        resume at the same world size, layout and rank: no collective, and every rank must
        save its own (``load_state_dict`` refuses another rank's, naming it). What
        ``state_dict()`` returned before fxzero 0.2, and what DTensor params still need."""
        self._republish.finish()
        return {
            "format": STATE_FORMAT,
            "world_size": self.dp.size,
            "rank": self.dp.rank,
            "layout": layout_key(self.buffers),
            "param_groups": [hyperparameters(g) for g in self.param_groups],
            "local": self.local.state_dict(),
            "main_shards": [s.main for s in self.shards if not s.main_is_param],
        }

    def whole_state_dict(self) -> dict[str, Any]:
        """What ``opt.state_dict()`` returns inside the optimizer's state-dict hooks."""
        if self.consolidated is not None:  # the state as of the last step; hyperparameters as they are now
            return {"state": self.consolidated["state"], "param_groups": self._plain_groups()}
        return self._collective_state_dict("state_dict")

    def _collective_state_dict(self, call: str) -> dict[str, Any]:
        """Meet every rank first (:func:`~fxzero.optim.communication.arrival.meet`): a call made on some
        ranks only fails there in bounded time rather than blocking in the gather."""
        self.refuse_param_shaped_state(f"opt.{call}()")
        device = self.params[0].device
        try:
            meet(self.dp, STATE_DICT_KEYS, call, self.timeout, device,
                 warn_after=STATE_DICT_WARNING, late=functools.partial(_late, self.dp, call))  # fmt: skip
        except (Absent, Mismatch) as err:
            message = _not_collective(self.dp, call, err)
            self.dp.leave_note(message)  # the ranks that went on fail with it, not with "Connection closed by peer"
            raise RuntimeError(message) from None
        self._republish.finish()
        return self.consolidated_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What ``opt.load_state_dict()`` does inside the optimizer's load-state-dict hooks.
        Everything is checked before anything changes (:mod:`~fxzero.optim.state.state_check`),
        and the ranks agree on the verdict: a refusal raises on every rank and leaves the
        optimizer as it was."""
        plain = is_plain_state_dict(state_dict)
        if plain:
            self.refuse_param_shaped_state("load_state_dict of a plain torch.optim state dict")
        problem, states = None, []
        try:
            if plain:
                checked = state_dict | {"state": self._check_plain(state_dict)}
                states = plain_fragment_states(checked, self.param_table, self.fragments)
            else:
                check_state_dict(state_dict, self.dp, layout_key(self.buffers), len(self.param_groups))
                local = state_dict["local"] | {"state": self._check_rank_state(state_dict)}
        except (ValueError, KeyError, TypeError) as err:
            problem = str(err)
        self.dp.agree(problem, "load_state_dict")
        self.consolidated = None
        with self.replacing():
            if plain:
                self.load_whole_states(states)
            else:
                self.local.load_state_dict(local)
                separate = [s for s in self.shards if not s.main_is_param]
                for shard, saved in zip(separate, state_dict["main_shards"]):
                    shard.main.copy_(saved)
            for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                group.update(hyperparameters(saved))

    def _check_plain(self, state_dict: dict[str, Any]) -> dict[Any, dict[str, Any]]:
        """A whole torch.optim state dict: its groups, then each param's state against the param;
        returns the per-param states to load (:func:`~fxzero.optim.state.state_check.check_states`)."""
        saved = state_dict["param_groups"]
        check_groups(saved, self.param_groups, [len(slots) for slots in self.param_table.group_slots])
        if not isinstance(state_dict["state"], dict):
            raise ValueError(f"load_state_dict: 'state' must be a dict keyed by param index, got {type(state_dict['state']).__name__}")
        order = [index for group in saved for index in group["params"]]
        table = self.param_table
        targets = {
            index: Target(f"param {table.label(slot)!r}", table.params[slot].shape, table.params[slot].dtype,
                          table.params[slot].device, table.rows[slot].group)  # fmt: skip
            for slot, index in enumerate(order)
        }
        return check_states(state_dict["state"], targets, self.probe, self.param_groups, saved, own_keys=(MASTER_KEY,))

    def _check_rank_state(self, state_dict: dict[str, Any]) -> dict[Any, dict[str, Any]]:
        """One rank's shard (fxzero's format): the wrapped optimizer's state against this rank's
        fragments, and the separate fp32 main shards against theirs; returns the states to load."""
        local = state_dict.get("local")
        if not isinstance(local, dict) or not isinstance(local.get("state"), dict):
            raise ValueError("load_state_dict: the state dict's 'local' entry is not an optimizer state dict")
        check_groups(local.get("param_groups"), self.param_groups)
        position = {id(p): n for n, p in enumerate(p for group in self.local.param_groups for p in group["params"])}
        table = self.param_table
        targets = {
            position[id(f.param)]: Target(f"param {table.label(f.slot)!r} (this rank's fragment)", f.param.shape, f.param.dtype,
                                          f.param.device, table.rows[f.slot].group)  # fmt: skip
            for f in self.fragments
        }
        states = check_states(local["state"], targets, self.probe, self.param_groups, local["param_groups"])
        for index, entry in local["state"].items():
            remainder = entry.get(REMAINDER_KEY) if isinstance(entry, dict) else None
            target = targets.get(index)
            if remainder is None or target is None:
                continue
            if not isinstance(remainder, torch.Tensor) or remainder.numel() != target.shape.numel():
                raise ValueError(f"load_state_dict: {target.label}: state {REMAINDER_KEY!r} does not have the fragment's {target.shape.numel()} elements")
            states[index] = states[index] | {REMAINDER_KEY: remainder}
        separate = [s.main for s in self.shards if not s.main_is_param]
        given = state_dict.get("main_shards")
        if not isinstance(given, list) or len(given) != len(separate):
            raise ValueError(f"load_state_dict: the state dict holds {len(given) if isinstance(given, list) else 'no'} fp32 main shards, this rank keeps {len(separate)}")
        for n, (main, saved) in enumerate(zip(separate, given)):
            if not isinstance(saved, torch.Tensor) or saved.shape != main.shape:
                shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise ValueError(f"load_state_dict: fp32 main shard {n} is {shape}, this rank's is {tuple(main.shape)}")
        return states

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in plain ``torch.optim`` format, on every rank
        (collective: every rank of the group calls it). It loads into the wrapped
        optimizer class over the same param groups without fxzero, or back into a
        DistributedOptimizer at any world size (:meth:`load_state_dict`). What
        :meth:`state_dict` returns, without its check that every rank called it."""
        self.refuse_param_shaped_state("consolidated_state_dict")
        separate = {s.bucket.index for s in self.shards if not s.main_is_param}
        bucket_of = self.param_table.bucket_of_slot
        states = [
            self.fragment_state(f) | ({MASTER_KEY: self.master_of(f)} if bucket_of[f.slot] in separate or self.remainders else {})
            for f in self.fragments
        ]
        state = consolidated_state(self.param_table, self.fragments, states, self.dp)
        return {"state": state, "param_groups": self._plain_groups()}

    def _plain_groups(self) -> list[dict[str, Any]]:
        """The laid-out groups as torch.optim lists them, with today's hyperparameters
        (``add_param_group`` consolidates with the new group appended already)."""
        return [hyperparameters(self.param_groups[g]) | {"params": list(slots)} for g, slots in enumerate(self.param_table.group_slots)]

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
                "opt.rank_state_dict() / opt.load_state_dict() of fxzero's own per-rank format (same mesh and layout, "
                "every rank saving its own) are."
            )

    # ---- the state API checkpoints use (load_state_dict uses it too) -------------
    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Replace this rank's fp32 masters (``fragments[i].param``) or the wrapped
        optimizer's state inside the block. Gathers in flight land first, so none lands
        over what is loaded; on exit the masters are published and gathered, so every
        param holds the loaded values."""
        self._republish.finish()
        yield
        self._republish.all()
        self._republish.finish()
        self.rank_state.hold(held_on_any_rank(self.local, self.dp, self.params[0].device))

    def fragment_state(self, fragment: FragmentTensor) -> dict[str, Any]:
        """The wrapped optimizer's state of one of this rank's :attr:`fragments` (AdamW's
        ``exp_avg``, ``exp_avg_sq``, ``step``); empty before its first update."""
        return self.store.fragment_state(self._index[id(fragment)])

    def master_of(self, fragment: FragmentTensor) -> torch.Tensor:
        """The fp32 master values of one of this rank's :attr:`fragments` (a view, or a copy
        rebuilt from the bf16 param and its remainder under ``Config.param_remainders``)."""
        return self.store.master_of(self._index[id(fragment)])

    def load_master(self, fragment: FragmentTensor, values: torch.Tensor) -> None:
        """Make ``values`` the fp32 master of ``fragment`` (inside :meth:`replacing`)."""
        self.store.load_master(self._index[id(fragment)], values)

    @property
    def remainders(self) -> bool:
        """Whether some masters are kept as remainders (not in a separate fp32 main shard)."""
        return self.store.remainders

    def load_fragment_states(self, states: Sequence[dict[str, Any]]) -> None:
        """Give the keeper ``states[i]`` for ``fragments[i]`` (inside :meth:`replacing`)."""
        if len(states) != len(self.fragments):
            raise ValueError(f"load_fragment_states: {len(states)} states for {len(self.fragments)} fragments")
        self.store.load_fragment_states(states)

    def load_whole_states(self, states: Sequence[dict[str, Any]]) -> None:
        """:meth:`load_fragment_states` of this rank's cut of a whole state
        (:func:`~fxzero.optim.state.state_dict.plain_fragment_states`), whose fp32 masters
        (``MASTER_KEY``), where it holds them, go into the fragments (inside :meth:`replacing`)."""
        masters = [state.pop(MASTER_KEY, None) for state in states]
        self.load_fragment_states(states)
        for frag, master in zip(self.fragments, masters):
            if master is not None:
                self.load_master(frag, master)

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state on this rank: wrapped-optimizer state + separate fp32 mains."""
        return sum(s.main.nbytes for s in self.shards if not s.main_is_param) + self.store.nbytes


def _late(dp: DataParallelGroup, call: str, missing: list[int], timeout: float) -> str:
    return (
        f"fxzero: opt.{call}() on rank {dp.rank} has waited {STATE_DICT_WARNING:g} s for rank(s) {missing} of "
        f"{dp.size}; it is collective at world size > 1 (every rank calls it). It fails after {timeout:g} s "
        "(Config.state_dict_timeout)"
    )


def _not_collective(dp: DataParallelGroup, call: str, err: Exception) -> str:
    if isinstance(err, Mismatch):
        return f"fxzero: the ranks made different state calls at the same point: rank 0 called opt.{err.first}(){err.others}"
    return (
        f"fxzero: opt.{call}() on rank {dp.rank}: rank(s) {err.missing} of {dp.size} did not call it within "  # type: ignore[attr-defined]
        f"{err.timeout:g} s (Config.state_dict_timeout). At world size > 1 it is collective: every rank calls it "  # type: ignore[attr-defined]
        "and gets the whole state, then one rank saves it (`state = opt.state_dict()` before "
        "`if rank == 0: torch.save(state, ...)`), as with FSDP. Or call opt.consolidate_state_dict() on every rank "
        "first, after which rank 0 alone may call opt.state_dict(); with the Hugging Face Trainer pass "
        "callbacks=[fxzero.hugging_face.CheckpointCallback()]. fxzero.save_checkpoint saves sharded state for any world size."
    )
