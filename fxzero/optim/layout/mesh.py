"""DTensor params on a ``DeviceMesh``: ZeRO-1 over the data-parallel dimension, the other
dimensions (tensor parallelism) left to the model.

A model parallelized with ``torch.distributed.tensor.parallel.parallelize_module`` holds
DTensor params: on each rank a *local tensor* (its slice of a ``Shard``-ed param, or the
whole of a ``Replicate``-d one) plus where it sits on the mesh. fxzero treats the local
tensor as the param: its flat buffers hold it (the DTensor's local tensor becomes an alias of
its range of ``param_data``, as FSDP2 makes it a view of its own sharded storage; not a view
object, and the DTensor rebuilt around it when its offset changes: see
``_torch_compat.set_dtensor_local`` and :func:`_alias` for what ``torch.compile`` needs), the eager hooks add
the local tensor of its gradient into ``main_grad``, and the reduce-scatters, the wrapped
optimizer (on fragments of local tensors: exact for elementwise optimizers) and the
all-gathers run over the data-parallel group only. The model keeps computing on DTensors.

What that needs, and what this module gives:

* **placements fxzero can serve** (:func:`check_mesh_params`, before any param is touched):
  ``Shard``/``Replicate`` over the other mesh dimensions. A param sharded over the
  data-parallel dimension itself (FSDP's layout: fxzero would average different slices) or
  ``Partial`` anywhere (its local tensor is not a value of the param) is refused naming the
  param and placement, and so is a ``process_group`` that spans a dimension the params are
  placed over (the world group with a TP model: it would average different TP slices);
  under whole-param ownership a param sharded over a mesh dimension is refused too (its
  "whole" is spread over ranks; Muon on a slice is another optimizer);
* **gradients in the param's placement** (:meth:`MeshParams.local_grad`): a gradient autograd
  leaves ``Partial`` (a ``SequenceParallel`` norm's weight: each TP rank summed over its
  sequence slice) is all-reduced over that dimension first, as FSDP2 redistributes it;
* **one global gradient norm** (:class:`MeshNorms`): each rank's squared norms (over DP
  already summed by the caller's all-reduce) are all-reduced over each other mesh
  dimension, with a param *replicated* over a dimension counted only on that dimension's
  coordinate 0 (multiplied by 0 elsewhere, so a NaN or inf still reaches every rank and the
  skip is agreed over the whole mesh). Plain (non-DTensor) params are taken to be replicated
  over every such dimension. One small all-reduce per dimension, on the groups the params'
  own meshes hold, rather than one over the whole mesh: that would need a group spanning the
  mesh, made by a collective ``new_group`` call on every rank of the world at construction.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from ..._torch_compat import dtensor_local, is_dtensor, set_dtensor_local, view_base
from ..communication.comm import DataParallelGroup

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["MeshNorms", "MeshParams", "check_mesh_params", "local_of", "planned", "rebind"]


def local_of(param: torch.Tensor) -> torch.Tensor:
    """What fxzero's buffers hold of ``param``: its local tensor if it is a DTensor, else itself."""
    return dtensor_local(param) if is_dtensor(param) else param


def planned(param: torch.Tensor) -> torch.Tensor:
    """What the bucket planner sees of ``param``: itself, or for a DTensor a meta tensor of its
    local shape and dtype (carrying ``shared_embedding``), since the buffers hold local tensors."""
    if not is_dtensor(param):
        return param
    local = dtensor_local(param)
    stand_in = torch.empty(local.shape, dtype=local.dtype, device="meta")
    if getattr(param, "shared_embedding", False):
        stand_in.shared_embedding = True  # type: ignore[attr-defined]
    return stand_in


def rebind(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``param`` (its local tensor, for a DTensor) the buffer ``view``, same Parameter object."""
    if is_dtensor(param):
        set_dtensor_local(param, _alias(view))
    else:
        param.data = view


def _alias(view: torch.Tensor) -> torch.Tensor:
    """The memory of ``view`` as a tensor that is not a view (no ``_base``), as ``param.data =
    view`` leaves a plain param. A compiled graph's params reach its backward through the
    tensors AOTAutograd saves, and it saves a *view* detached (a new object each step), where
    fxzero finds the param by identity; a non-view input is saved as itself."""
    if view_base(view) is None:
        return view
    with torch.no_grad():
        alias = torch.empty(0, dtype=view.dtype, device=view.device)
        return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


@dataclasses.dataclass(frozen=True)
class ModelDim:
    """A mesh dimension other than data parallelism that some param is placed over."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    """Global ranks of the dimension's group (this rank's row of the mesh along it)."""
    coordinate: int
    """This rank's index along the dimension."""
    name: str


@dataclasses.dataclass(frozen=True)
class MeshParams:
    """The managed DTensor params (by slot) and the other mesh dimensions they are placed over."""

    dtensor_slots: frozenset[int]
    dims: tuple[ModelDim, ...]
    """Dimensions of size > 1 (one of size 1 needs no collective, and Shard over it is the whole param)."""
    sharded: tuple[frozenset[int], ...]
    """``sharded[i]``: slots of the params sharded over ``dims[i]``."""

    @property
    def any(self) -> bool:
        return bool(self.dtensor_slots)

    def norms(self, num_params: int, device: torch.device) -> Optional["MeshNorms"]:
        """How ``ReducedGrads`` finishes its norms over the other dimensions (None: nothing to do)."""
        if not self.dims:
            return None
        mask = torch.tensor([float(self.counted_here(s)) for s in range(num_params)], dtype=torch.float64, device=device)
        return MeshNorms(self.dims, mask)

    def counted_here(self, slot: int) -> bool:
        """Whether this rank holds the one copy of param ``slot``'s local tensor that counts
        (in the norm, in a checkpoint): over every other dimension the param is sharded over,
        or this rank is that dimension's coordinate 0 (a replicated param's copies are equal)."""
        return all(d.coordinate == 0 or slot in sharded for d, sharded in zip(self.dims, self.sharded))

    @staticmethod
    def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a DTensor param's gradient, in the param's own placement
        (a ``Partial`` gradient is reduced over its dimension first)."""
        if not is_dtensor(grad):
            return grad
        if grad.placements != param.placements:  # type: ignore[attr-defined]
            with torch.no_grad():
                grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
        return dtensor_local(grad)


class MeshNorms:
    """Finishes per-param gradient statistics over the mesh dimensions other than DP."""

    def __init__(self, dims: Sequence[ModelDim], mask: torch.Tensor) -> None:
        self.dims, self.mask = tuple(dims), mask

    def sum_once(self, values: torch.Tensor) -> None:
        """``values`` (one per slot, summed over DP): sum over every other dimension, each
        param counted once (replicated ones on coordinate 0 only), in place."""
        values.mul_(self.mask)
        for dim in self.dims:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=dim.group)

    def max_over(self, values: torch.Tensor) -> None:
        """``values`` (one per slot, maxed over DP): max over every other dimension, in place."""
        for dim in self.dims:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=dim.group)

    def collectives_per_step(self) -> dict[str, int]:
        return {"allreduce": len(self.dims)}


def check_mesh_params(
    params: Sequence[torch.Tensor], labels: Sequence[str], dp: DataParallelGroup, *, whole_params: bool
) -> MeshParams:
    """Check every DTensor param's placements (errors name the param and placement) and find
    the mesh dimensions other than ``dp`` the params are placed over. ``params`` in slot order."""
    dtensors = [(slot, p) for slot, p in enumerate(params) if is_dtensor(p)]
    if not dtensors:
        return MeshParams(frozenset(), (), ())
    from torch.distributed.tensor import Shard  # loaded: the params are DTensors
    if dp.replica_count > 1:
        slot, param = dtensors[0]
        raise NotImplementedError(
            f"fxzero: param {labels[slot]} is a DTensor, and hierarchical sharding (a ('replicate', 'shard') "
            "process_group mesh) is not implemented with DTensor (tensor-parallel) params; pass the data-parallel "
            f"ranks as one group: {_dp_fix(param, [p for _, p in dtensors])}"
        )
    dp_ranks = tuple(dist.get_process_group_ranks(dp.group if dp.group is not None else dist.group.WORLD))
    dims: dict[tuple[int, ...], ModelDim] = {}
    sharded: dict[tuple[int, ...], set[int]] = {}
    placed = [p for _, p in dtensors]
    for slot, param in dtensors:
        _check_spans(param, labels[slot], dp, dp_ranks, placed)
        for dim, placement in _param_dims(param, labels[slot], dp, dp_ranks, whole_params):
            dims.setdefault(dim.ranks, dim)
            sharded.setdefault(dim.ranks, set())
            if isinstance(placement, Shard):
                sharded[dim.ranks].add(slot)
    keys = sorted(dims)  # the same order on every rank of a dimension: the order collectives are issued in
    return MeshParams(frozenset(s for s, _ in dtensors), tuple(dims[k] for k in keys), tuple(frozenset(sharded[k]) for k in keys))


def _param_dims(
    param: DTensor, label: str, dp: DataParallelGroup, dp_ranks: tuple[int, ...], whole_params: bool
) -> list[tuple[ModelDim, object]]:
    """``param``'s mesh dimensions other than DP, each with the param's placement over it."""
    from torch.distributed.tensor import Partial, Shard  # loaded: param is a DTensor

    mesh, found = param.device_mesh, []
    names = _dim_names(mesh)
    for d, placement in enumerate(param.placements):
        group = mesh.get_group(d)
        ranks = tuple(dist.get_process_group_ranks(group))
        where = f"param {label} ({_placed(param)})"
        if isinstance(placement, Partial):
            raise ValueError(
                f"fxzero: {where} is {placement!r} over mesh dim {names[d]!r}: its local tensor is a partial sum, not "
                "a value of the param. Give the optimizer params that are Shard or Replicate over each mesh dim."
            )
        if len(ranks) == 1:  # nothing to shard, reduce or count over (and its group may be the world's)
            continue
        if group is dp.group or ranks == dp_ranks:
            if isinstance(placement, Shard):
                raise ValueError(
                    f"fxzero: {where} is {placement!r} over mesh dim {names[d]!r}, which is the data-parallel group "
                    "the optimizer shards over: fxzero would average different slices. Place params Replicate over "
                    "the data-parallel dim (fxzero shards their optimizer state over it)."
                )
            continue
        if whole_params and isinstance(placement, Shard):
            raise ValueError(
                f"fxzero: {where} is {placement!r} over mesh dim {names[d]!r}, and this optimizer owns each param "
                "whole (Config.state_sharding='whole_params', the default for optimizers not known to be "
                "elementwise, such as Muon): the whole param is spread over that dim's ranks, and updating one "
                "slice as a whole param is another optimizer. Use an elementwise optimizer (AdamW) for sharded "
                "params, or keep such params replicated over the other mesh dims."
            )
        found.append((ModelDim(group, ranks, mesh.get_local_rank(d), names[d]), placement))
    return found


def _dim_names(mesh: object) -> tuple[str, ...]:
    return mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))  # type: ignore[attr-defined]


def _placed(param: DTensor) -> str:
    """``a DTensor on mesh dims ('edp', 'ep'), Replicate() over 'edp' and Shard(dim=0) over 'ep'``."""
    names = _dim_names(param.device_mesh)
    each = " and ".join(f"{p!r} over {n!r}" for p, n in zip(param.placements, names))
    return f"a DTensor on mesh dims {names}, {each}"


def _overlaps(param: DTensor, dp: DataParallelGroup, dp_ranks: tuple[int, ...]) -> list[int]:
    """Mesh dims of ``param`` (of size > 1, other than the DP group itself) that share ranks
    besides this one with the DP group: fxzero would reduce over them as if data-parallel."""
    mesh, found = param.device_mesh, []
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        ranks = tuple(dist.get_process_group_ranks(group))
        if len(ranks) > 1 and group is not dp.group and ranks != dp_ranks and set(ranks) & set(dp_ranks) != {dist.get_rank()}:
            found.append(d)
    return found


def _check_spans(param: DTensor, label: str, dp: DataParallelGroup, dp_ranks: tuple[int, ...], dtensors: Sequence[DTensor]) -> None:
    """Refuse a ``process_group`` that spans a mesh dim ``param`` is placed over, naming that dim
    (a ``Shard`` one first: the one whose slices would be averaged) and the dim to pass instead."""
    from torch.distributed.tensor import Shard  # loaded: param is a DTensor

    overlaps = _overlaps(param, dp, dp_ranks)
    if not overlaps:
        return
    d = next((d for d in overlaps if isinstance(param.placements[d], Shard)), overlaps[0])
    mesh, placement = param.device_mesh, param.placements[d]
    name, ranks = _dim_names(mesh)[d], dist.get_process_group_ranks(mesh.get_group(d))
    why = (
        "its local tensors there are different slices, which its gradient reductions would average"
        if isinstance(placement, Shard)
        else "fxzero reduces over one data-parallel dim and leaves every other mesh dim to the model"
    )
    fix = _dp_fix(param, dtensors)
    raise ValueError(
        f"fxzero: process_group (ranks {list(dp_ranks)}) spans mesh dim {name!r} (ranks {list(ranks)}), and param "
        f"{label} is {placement!r} over it ({_placed(param)}): {why}. Give this optimizer the params' data-parallel "
        f"dim only, {fix}; or, where its other params are data-parallel over all of process_group's ranks (dense "
        f"params next to experts), give {label} and the params placed like it a second DistributedOptimizer with "
        "that process_group (experts also need Config(gradient_divide_factor=...): see docs/parallelism.md)."
    )


def _dp_fix(param: DTensor, dtensors: Sequence[DTensor]) -> str:
    """``process_group=mesh['edp']``: the dims of ``param``'s mesh (size > 1) over which every
    DTensor param on that mesh is ``Replicate``: where data parallelism can be."""
    from torch.distributed.tensor import Replicate  # loaded: param is a DTensor

    mesh = param.device_mesh
    same = [p for p in dtensors if p.device_mesh == mesh]
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1 and all(isinstance(p.placements[d], Replicate) for p in same)]
    if len(dims) == 1 and mesh.mesh_dim_names:
        return f"process_group=mesh[{mesh.mesh_dim_names[dims[0]]!r}]"
    if dims == [0] and mesh.ndim == 1:
        return "process_group=<the params' 1-D DeviceMesh>"
    if len(dims) == 1:
        return f"process_group=mesh.get_group({dims[0]})"
    names = _dim_names(mesh)
    if dims:
        return f"process_group=one group over the ranks of mesh dims {tuple(names[d] for d in dims)}"
    return f"process_group=mesh['dp'] where mesh is the DeviceMesh that dims {names} belong to and 'dp' its data-parallel dim"
