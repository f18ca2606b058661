"""Every fragment's L2 norm in a few kernel calls, bit for bit what ``torch._foreach_norm`` gives.

``step()`` measures each gradient fragment's norm every step (the global norm it reports,
clips by and skips non-finite steps on). On CPU ``torch._foreach_norm`` is a loop of one
``torch.linalg.vector_norm`` call per tensor, and for the small tensors of a model that
graph-breaks per block the calls' fixed cost is the whole cost: 48 fragments took about
110 us of a 5 ms step. Yet the fragments sit in one flat buffer, and repeated blocks lay
same-size fragments out at a constant spacing. So fragments of equal length spaced evenly
in one storage form a **run**: one 2-D strided view whose rows are those fragments, normed
row by row in one call (``vector_norm(view, dim=1)``).

The bits are the same: a contiguous fp32 CPU reduction over the last dimension runs one
vectorised accumulation per row, whatever the row's neighbours or the thread count, and a
fragment normed on its own takes that same path (``tests/test_fragment_norms.py`` checks
rows against ``torch._foreach_norm`` over random lengths, spacings and thread counts). On
other devices ``torch._foreach_norm`` is one fused kernel whose summation order differs
from ``vector_norm``'s, and other dtypes take other CPU paths: there every fragment keeps
``torch._foreach_norm``.

:func:`plan_norm_runs` is pure (offsets in, runs out), tested without tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..._torch_compat import foreach_norm

__all__ = ["FragmentNorms", "NormRun", "plan_norm_runs"]


@dataclasses.dataclass(frozen=True)
class NormRun:
    """Fragments of ``numel`` elements each, ``stride`` elements apart in one storage."""

    fragments: tuple[int, ...]
    """Their indices in the fragment list, in row order (ascending offset)."""
    offset: int
    """Storage offset of the first row, in elements."""
    stride: int
    numel: int


def plan_norm_runs(places: Sequence[tuple[int, int, int]]) -> tuple[NormRun, ...]:
    """Runs covering every fragment once; ``places[i] = (storage, offset, numel)`` of
    fragment ``i`` (``storage`` any key equal for tensors sharing one storage). Among the
    fragments of one storage and length, the spacing most of them repeat at (a model's
    block, in the usual layout) chains them into runs; the rest are runs of one."""
    by_kind: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for index, (storage, offset, numel) in enumerate(places):
        by_kind.setdefault((storage, numel), []).append((offset, index))
    runs = []
    for (_, numel), members in by_kind.items():
        members.sort()
        runs.extend(_chains(members, numel, _common_spacing([o for o, _ in members])))
    return tuple(sorted(runs, key=lambda run: run.fragments[0]))


_NEIGHBOURS = 16
"""How many following fragments each one's spacings are counted to (enough for the
fragments of one length in a repeated block; bounds the planning cost)."""


def _common_spacing(offsets: Sequence[int]) -> int:
    """The spacing between fragments (of one length, sorted) that occurs most often, the
    smallest such on a tie; 0 when there is none."""
    counts: dict[int, int] = {}
    for i, offset in enumerate(offsets):
        for later in offsets[i + 1 : i + 1 + _NEIGHBOURS]:
            counts[later - offset] = counts.get(later - offset, 0) + 1
    return min(counts, key=lambda d: (-counts[d], d)) if counts else 0


def _chains(members: Sequence[tuple[int, int]], numel: int, spacing: int) -> list[NormRun]:
    """Runs of ``members`` (``(offset, index)`` in offset order) each ``spacing`` apart.
    Fragments of one storage never overlap, so ``spacing >= numel``: rows never overlap."""
    open_chains: dict[int, list[tuple[int, int]]] = {}  # next offset expected -> the chain's rows
    chains = []
    for offset, index in members:
        rows = open_chains.pop(offset, None) if spacing else None
        if rows is None:
            rows = []
            chains.append(rows)
        rows.append((offset, index))
        open_chains[offset + spacing] = rows
    return [NormRun(tuple(i for _, i in rows), rows[0][0], spacing if len(rows) > 1 else max(numel, 1), numel) for rows in chains]


class FragmentNorms:
    """L2 norms of a fixed list of gradient fragments, written into a vector made once, in
    :attr:`order` (on the runs' path the step makes no view and allocates nothing)."""

    def __init__(self, grads: Sequence[torch.Tensor]) -> None:
        self._grads = list(grads)
        self._out = torch.empty(len(grads), dtype=grads[0].dtype if grads else torch.float32, device=grads[0].device if grads else None)
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        runs = plan_norm_runs([_place(g) for g in grads]) if grads and all(map(_runs_apply, grads)) else ()
        start = 0
        for run in runs:
            view = grads[run.fragments[0]].as_strided((len(run.fragments), run.numel), (run.stride, 1), run.offset)
            self._views.append((view, self._out[start : start + len(run.fragments)]))
            start += len(run.fragments)
        self.order: tuple[int, ...] = tuple(i for run in runs for i in run.fragments) if runs else tuple(range(len(grads)))
        """Fragment index of each entry of the output vector."""

    @property
    def calls(self) -> int:
        """Norm calls per step on the runs' path (one per run); 0: one ``_foreach_norm`` instead."""
        return len(self._views)

    def compute(self) -> torch.Tensor:
        """Each fragment's L2 norm, in :attr:`order`."""
        if self._views:
            for view, out in self._views:
                torch.linalg.vector_norm(view, dim=1, out=out)
        elif self._grads:
            torch.stack(foreach_norm(self._grads, 2), out=self._out)
        return self._out


def _place(grad: torch.Tensor) -> tuple[int, int, int]:
    return grad.untyped_storage().data_ptr(), grad.storage_offset(), grad.numel()


def _runs_apply(grad: torch.Tensor) -> bool:
    """Where a row of a strided view is normed exactly as the tensor alone (see the module
    docstring); empty fragments too are left to ``torch._foreach_norm`` (their storages may
    share a null address, the key runs are grouped by)."""
    exact = grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.layout == torch.strided
    return exact and grad.is_contiguous() and grad.numel() > 0
