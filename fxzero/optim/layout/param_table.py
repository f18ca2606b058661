"""The one table of the optimizer's params: built once, asked by every other module.

Each managed param has a **slot**: its position in the optimizer's param groups, flattened
in group order. Everything fxzero keeps per param (readiness flags, norms, fragments,
grad views, checkpoint names) is indexed by slot, and the table says for each slot which
param it is, its name (module path, or the ``named_parameters()`` name it was given), the
label errors use, its param group and its bucket. Lookups by param go through
:meth:`ParamTable.find`, which confirms the whole identity (``id`` *and* ``is``), so a
tensor that merely shares an id with a dead param is never taken for it.

Nothing is written on the user's params for fxzero's bookkeeping except the manager
reference (``_fxzero_manager``) that compiled graphs' ops use to reach their optimizer (on a
DTensor param's local tensor too, what compiled graphs see of it). A DTensor param's local
tensor is found by this table's own map, not by a mark on the tensor, so nothing of a dead
optimizer's layout stays on the user's tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

import torch

from .mesh import local_of

__all__ = ["ParamRow", "ParamTable", "param_names"]


@dataclasses.dataclass(frozen=True, eq=False)
class ParamRow:
    """One managed param."""

    slot: int
    param: torch.nn.Parameter
    name: Optional[str]
    """Module path (``module=``) or ``named_parameters()`` name; ``None`` when not given."""
    group: int
    """Index of its param group."""
    bucket: int
    """Index of the bucket holding it (over all buffers)."""
    owner: Optional[int] = None
    """The rank that owns it whole (its optimizer state, its update) under whole-param
    ownership; ``None`` when every rank owns a fragment of it."""

    @property
    def label(self) -> str:
        """How messages name it: its name, else its slot."""
        return self.name if self.name else f"params[{self.slot}]"


class ParamTable:
    """Rows by slot, and the reverse lookup from a param to its slot."""

    def __init__(self, rows: Sequence[ParamRow], num_groups: Optional[int] = None) -> None:
        self.rows = tuple(rows)
        if any(row.slot != slot for slot, row in enumerate(self.rows)):
            raise ValueError("ParamTable rows must be given in slot order")
        self.params = tuple(row.param for row in self.rows)
        self.bucket_of_slot = tuple(row.bucket for row in self.rows)
        groups = num_groups if num_groups is not None else max((row.group for row in self.rows), default=-1) + 1
        self.group_slots = tuple(tuple(r.slot for r in self.rows if r.group == g) for g in range(groups))
        """``group_slots[g]``: the slots of param group ``g``, in order."""
        self._slot_of = {id(row.param): row.slot for row in self.rows}
        self._slot_of_local = {id(local): row.slot for row in self.rows if (local := local_of(row.param)) is not row.param}
        """DTensor params' local tensors (as they were at construction: a model cast since has new ones)."""
        self._aliases: dict[int, str] = {}
        """Module paths learned after construction for params built without a name (:meth:`call`)."""

    @classmethod
    def build(
        cls,
        groups: Sequence[dict[str, Any]],
        names: dict[int, str],
        bucket_of: dict[int, int],
        owner_of: Optional[dict[int, int]] = None,
    ) -> "ParamTable":
        """Rows for ``groups``' params in group order; ``names``, ``bucket_of`` and ``owner_of``
        (under whole-param ownership, the rank that owns each param) are keyed by ``id(param)``
        (of params held alive by ``groups``)."""
        pairs = [(g, p) for g, group in enumerate(groups) for p in group["params"]]
        owners = owner_of or {}
        rows = [ParamRow(slot, p, names.get(id(p)), g, bucket_of[id(p)], owners.get(id(p))) for slot, (g, p) in enumerate(pairs)]
        return cls(rows, num_groups=len(groups))

    def __len__(self) -> int:
        return len(self.rows)

    def find(self, value: Any) -> Optional[int]:
        """``value``'s slot if it is one of the table's params (the object itself), or the local
        tensor of a DTensor param (what compiled graphs see of it: :mod:`~fxzero.optim.layout.mesh`), else ``None``."""
        slot = self._slot_of.get(id(value))
        if slot is not None and self.params[slot] is value:
            return slot
        slot = self._slot_of_local.get(id(value))
        return slot if slot is not None and local_of(self.params[slot]) is value else None

    def slots(self, params: Iterable[Any]) -> list[int]:
        """The slots of ``params``, all of which must be in the table."""
        found = [self.find(p) for p in params]
        if None in found:
            raise KeyError("a param is not managed by this optimizer")
        return found  # type: ignore[return-value]

    def label(self, slot: int) -> str:
        return self.rows[slot].label

    def learn_alias(self, param: Any, path: str) -> None:
        """``param`` is known elsewhere as ``path``: a compiled graph's module path, or the
        module another optimizer was given. Only messages use it (:meth:`called`): names that
        key anything (checkpoints, ``full_grads``, layout agreement) never change after construction."""
        slot = self.find(param)
        if slot is not None and self.rows[slot].name is None:
            self._aliases.setdefault(slot, path)

    def called(self, slot: int) -> str:
        """How an error names the param: its name, else a module path learned since
        (:meth:`learn_alias`: two optimizers over one model, one given ``module=``), else its slot."""
        alias = self._aliases.get(slot)
        return alias if alias is not None and self.rows[slot].name is None else self.rows[slot].label

    def describe_optimizer(self) -> str:
        """Which optimizer this table is, for a message: ``the DistributedOptimizer over a.weight, a.bias, … (6 params)``."""
        shown = ", ".join(self.called(s) for s in range(min(2, len(self.rows))))
        more = ", …" if len(self.rows) > 2 else ""
        return f"the DistributedOptimizer over {shown}{more} ({len(self.rows)} params)"

    def describe(self, slots: Sequence[int], limit: int = 4) -> str:
        """``a.weight, b.bias, … (12 params, 1,050,112 elements)``: what a failed collective names."""
        labels = [self.rows[s].label for s in slots]
        shown = ", ".join(labels[:limit]) + (", …" if len(labels) > limit else "")
        return f"{shown} ({len(labels)} params, {sum(self.params[s].numel() for s in slots):,} elements)"


def param_names(
    groups: Sequence[dict[str, Any]], module: Optional[torch.nn.Module]
) -> dict[int, str]:
    """``id(param) -> name``: the module path when ``module`` is given (the first name of a
    tied weight), else the names of ``named_parameters()`` groups."""
    names = {id(p): n for group in groups for p, n in zip(group["params"], group.get("param_names") or ())}
    if module is not None:
        managed = {id(p) for group in groups for p in group["params"]}
        for name, param in module.named_parameters():
            if id(param) in managed:
                names[id(param)] = name
    return names
