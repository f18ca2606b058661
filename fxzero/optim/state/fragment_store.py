"""Where this rank's per-fragment optimizer state and fp32 masters are read and written.

Two keepers exist: the wrapped ``torch.optim`` optimizer (its ``state[fragment]`` dicts; the
masters are the fragments themselves) and fxzero's own Adam update
(:class:`~fxzero.optim.update.shard_adam.ShardAdamW`: narrow moments, masters rebuilt from
remainders). :class:`~fxzero.optim.state.sharded_state.ShardedState` and checkpoints go through
this one surface, so every format reads and loads either keeper the same way.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from ..layout.shards import FragmentTensor

__all__ = ["FragmentStore", "TorchOptimStore"]


class FragmentStore(Protocol):
    """State and masters of ``fragments[i]``, by index."""

    remainders: bool
    """Whether some masters are rebuilt from bf16 params and remainders, not kept in fp32 main shards."""

    def fragment_state(self, index: int) -> dict[str, Any]:
        """torch.optim's per-param form (``{}`` before its first update)."""

    def load_fragment_states(self, states: Sequence[dict[str, Any]]) -> None:
        """``states[i]`` becomes ``fragments[i]``'s state."""

    def master_of(self, index: int) -> torch.Tensor:
        """The fp32 master values, shaped like the fragment."""

    def load_master(self, index: int, values: torch.Tensor) -> None:
        """Make ``values`` the fp32 master."""

    @property
    def nbytes(self) -> int:
        """Bytes of state kept (separate fp32 main shards not included)."""


class TorchOptimStore:
    """The wrapped ``torch.optim`` optimizer ``local`` over ``fragments``."""

    remainders = False

    def __init__(self, local: torch.optim.Optimizer, fragments: Sequence[FragmentTensor]) -> None:
        self.local, self.fragments = local, tuple(fragments)

    def fragment_state(self, index: int) -> dict[str, Any]:
        return self.local.state.get(self.fragments[index].param, {})

    def load_fragment_states(self, states: Sequence[dict[str, Any]]) -> None:
        """torch.optim's loader casts and moves each tensor as its own policy wants."""
        index_of = {id(p): i for i, p in enumerate(p for group in self.local.param_groups for p in group["params"])}
        loaded = {index_of[id(f.param)]: state for f, state in zip(self.fragments, states) if state}
        self.local.load_state_dict({"state": loaded, "param_groups": self.local.state_dict()["param_groups"]})

    def master_of(self, index: int) -> torch.Tensor:
        return self.fragments[index].param

    def load_master(self, index: int, values: torch.Tensor) -> None:
        self.fragments[index].param.view(-1).copy_(values.reshape(-1))

    @property
    def nbytes(self) -> int:
        total = 0
        for per_param in self.local.state.values():
            total += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
        return total
