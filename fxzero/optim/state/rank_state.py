"""``DistributedOptimizer.state``: the ``torch.optim`` ``opt.state`` mapping, as one rank holds it.

``torch.optim`` keeps ``state[param]`` with whole tensors. Under ZeRO-1 the wrapped optimizer
holds only this rank's fragment of each param, so ``state[param]`` is that fragment's state
(AdamW's ``exp_avg``/``exp_avg_sq`` as flat tensors of the fragment's length, its ``step``), or
``{}`` where this rank holds none of ``param``. The whole state is
``consolidated_state_dict()``'s.

Which params are keys must be the same on every rank: torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` look at ``bool(opt.state)`` on
each rank to decide whether to take a zero-gradient, zero-lr step first (a collective under
fxzero), and a rank holding no fragment (a tiny bucket's padding) would otherwise decide
alone. So the keys are every managed param once the optimizer holds state on any rank (it
updated params, or loaded state that some rank holds), and none before; no collective is
needed to answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..communication.comm import DataParallelGroup
from ..layout.param_table import ParamTable
from ..layout.shards import FragmentTensor

__all__ = ["RankState", "held_on_any_rank"]


class RankState(Mapping[torch.Tensor, dict[str, Any]]):
    """Each managed param -> this rank's state of it; read-only (load state with ``load_state_dict``)."""

    def __init__(self, table: ParamTable, fragments: Sequence[FragmentTensor], local: torch.optim.Optimizer) -> None:
        self._table, self._local = table, local
        self._fragment_of = {f.slot: f.param for f in fragments}
        self._held = False

    @property
    def held(self) -> bool:
        """Whether any rank's wrapped optimizer holds state: the same on every rank."""
        return self._held

    def hold(self, held: bool) -> None:
        """After an update (``True``) or a load (whether any rank holds state now)."""
        self._held = held

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        slot = self._table.find(param)
        if slot is None:
            raise KeyError("not a param of this DistributedOptimizer")
        fragment = self._fragment_of.get(slot)
        return self._local.state.get(fragment, {}) if fragment is not None else {}

    def __contains__(self, param: object) -> bool:
        return self._held and self._table.find(param) is not None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._table.params if self._held else ())

    def __len__(self) -> int:
        return len(self._table) if self._held else 0


def held_on_any_rank(local: torch.optim.Optimizer, dp: DataParallelGroup, device: torch.device) -> bool:
    """Whether any rank's wrapped optimizer holds state (collective: after a load, which is one)."""
    flag = torch.tensor([float(bool(local.state))], device=device)
    dp.all_reduce_sum(flag, "all-reduce of whether any rank holds optimizer state")
    return bool(flag.item() > 0)
