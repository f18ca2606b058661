"""What a checkpoint holds, and how it maps onto a live model and DistributedOptimizer.

The format does not depend on the world size or the bucket layout it was saved with:

* ``model/<key>`` - every entry of ``model.state_dict()``, a plain (replicated) tensor
  that DCP writes once, so the checkpoint also loads into a model without fxzero;
* ``optim/<param>/main`` - the fp32 master values of a managed param, and
  ``optim/<param>/<key>`` for every elementwise state tensor of the wrapped optimizer
  (AdamW's ``exp_avg``, ``exp_avg_sq``), each a *logical tensor of the param's global
  shape* of which every rank writes only the fragment ``[lo, hi)`` it owns, as N-D chunks
  (:class:`~fxzero.checkpoint.pieces.Pieces`: for a DTensor param the fragment is a piece
  of its local tensor, placed at the local tensor's global offset; a param replicated over
  a tensor-parallel dimension is written by that dimension's coordinate 0 only); on load
  each rank asks for its own, new fragments and DCP reads the overlapping pieces of
  whatever the saving ranks wrote: that is the resharding, over the data-parallel size,
  the bucket layout and the tensor-parallel degree alike (checkpoints of fxzero before
  DTensor support stored ``[numel]``-shaped 1-D tensors: they load into params whose
  local tensor is the whole param);
* ``optim/<param>/<key>`` for other tensors (AdamW's scalar ``step``): a plain tensor,
  the same on every rank that owns part of the param.

Params are named by their module path (the first name of a tied weight). Hyperparameters,
the optimizer class and the layout of the state go to the manifest (JSON), see
:mod:`fxzero.checkpoint.io`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor

from .._torch_compat import dtensor_global_offset, dtensor_local
from ..optim.layout.shards import FragmentTensor
from ..optim.state.state_dict import hyperparameters, is_elementwise_state
from .pieces import Pieces

if TYPE_CHECKING:
    from ..distributed_optimizer import DistributedOptimizer

__all__ = [
    "CheckpointError",
    "ChunkLoadPlanner",
    "ChunkSavePlanner",
    "apply_hyperparameters",
    "apply_loaded",
    "check_compatible",
    "group_records",
    "load_targets",
    "placed",
    "save_state",
    "slot_names",
]

MODEL, OPTIM = "model/", "optim/"
MANIFEST = "fxzero.json"
SHARDED, TENSOR = "sharded", "tensor"
"""Kinds of a per-param state entry (a non-tensor one is stored as ``["value", v]``)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded as asked: it does not match the model or
    optimizer, it is incomplete or corrupt, writing it failed (a full disk), or the ranks
    did not all make the same call. Raised on every rank, before anything live is changed."""


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where a managed param's local tensor (the param itself, unless it is a DTensor) lies
    in the global param: what turns a fragment into chunks of the logical tensor."""

    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]
    """The global shape (a 0-dim param counts as ``(1,)``)."""

    @property
    def whole(self) -> bool:
        return self.local_shape == self.size

    def pieces(self, flat: torch.Tensor, lo: int, saved: Sequence[int] = ()) -> Pieces:
        """Elements ``[lo, lo + flat.numel())`` of the local tensor, in the coordinates of a
        logical tensor of shape ``saved`` (default: the global shape; an older checkpoint's
        ``(numel,)`` when the local tensor is the whole param)."""
        if tuple(saved) in ((), self.size):
            return Pieces.of(flat, self.local_shape, lo, self.offset, self.size)
        numel = math.prod(self.size)
        return Pieces.of(flat, (numel,), lo, (0,), (numel,))

    def reads(self, saved: Sequence[int]) -> bool:
        """Whether :meth:`pieces` can place this rank's fragments in a saved tensor of shape ``saved``."""
        return tuple(saved) == self.size or (self.whole and tuple(saved) == (math.prod(self.size),))


def placed(param: torch.Tensor) -> Placed:
    """Where ``param``'s local tensor lies in the global param."""
    size = tuple(param.shape) or (1,)
    if not isinstance(param, DTensor):
        return Placed(size, (0,) * len(size), size)
    return Placed(tuple(dtensor_local(param).shape) or (1,), dtensor_global_offset(param) or (0,), size)


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict.get(index.fqn)
    return obj.piece(index.offset) if isinstance(obj, Pieces) else find_state_dict_object(state_dict, index)


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner for a flat state dict; a :class:`Pieces` resolves to the piece asked for."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for a flat state dict; a :class:`Pieces` resolves to the piece asked for."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces every value that is not a tensor, container or scalar by
        # None (torch 2.13 _iterate_state_dict), which would drop our chunks: put them back.
        chunks = {key: value for key, value in state_dict.items() if isinstance(value, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


# ---- the live side ---------------------------------------------------------------------
def slot_names(model: torch.nn.Module, opt: "DistributedOptimizer") -> list[str]:
    """The module path of each of ``opt``'s params (first name of a tied weight)."""
    name_of: dict[int, str] = {}
    for name, param in model.named_parameters():
        name_of.setdefault(id(param), name)
    for slot, param in enumerate(opt.param_table.params):
        if id(param) not in name_of:
            raise CheckpointError(
                f"optimizer param {slot} (shape {tuple(param.shape)}) is not a parameter of the given model; "
                "pass the model whose params the optimizer manages"
            )
    return [name_of[id(p)] for p in opt.param_table.params]


def _kind(value: Any, frag: FragmentTensor, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return SHARDED if is_elementwise_state(value, frag) else TENSOR
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["value", value]
    raise CheckpointError(f"optimizer state {where} is a {type(value).__name__}; checkpoints hold tensors and JSON scalars")


def save_state(model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str]) -> tuple[dict[str, Any], dict]:
    """This rank's DCP state dict, and the kind of every state entry of the params it owns
    (a param replicated over a tensor-parallel dimension is written from its coordinate 0)."""
    state: dict[str, Any] = {MODEL + key: value for key, value in model.state_dict().items()}
    spec: dict[str, dict[str, Any]] = {}
    for frag in opt.runtime.fragments:
        name, where, lo = names[frag.slot], placed(opt.param_table.params[frag.slot]), frag.where.param_offset
        writes = opt.runtime.mesh_params.counted_here(frag.slot)
        if writes:
            state[f"{OPTIM}{name}/main"] = where.pieces(opt.runtime.sharded_state.master_of(frag).detach().reshape(-1), lo)
        for key, value in opt.runtime.sharded_state.fragment_state(frag).items():
            kind = spec.setdefault(name, {})[key] = _kind(value, frag, f"{key!r} of {name!r}")
            if writes and kind == SHARDED:
                state[f"{OPTIM}{name}/{key}"] = where.pieces(value.reshape(-1), lo)
            elif writes and kind == TENSOR:
                state[f"{OPTIM}{name}/{key}"] = value
    return state, spec


def check_compatible(
    manifest: dict[str, Any], metadata: Metadata, model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str]
) -> None:
    """Everything that differs between the checkpoint and the live model/optimizer, in one error."""
    saved_class, live_class = manifest["optimizer_class"], _qualname(opt.optimizer_class)
    problems = [] if saved_class == live_class else [f"optimizer class: checkpoint {saved_class}, this optimizer {live_class}"]
    problems += _model_differences(metadata, model)
    problems += _group_differences(manifest["param_groups"], opt, names)
    for slot, name in enumerate(names):
        where, entries = placed(opt.param_table.params[slot]), metadata.state_dict_metadata
        entry = entries.get(f"{OPTIM}{name}/main")
        if opt.param_table.params[slot].numel() and not (isinstance(entry, TensorStorageMetadata) and where.reads(entry.size)):
            saved = f"of shape {tuple(entry.size)}" if isinstance(entry, TensorStorageMetadata) else "none"
            problems.append(f"param {name!r}: no fp32 master values of its shape {where.size} in the checkpoint ({saved})")
        for key, kind in manifest["state"].get(name, {}).items():
            if kind == SHARDED and not (isinstance(e := entries.get(f"{OPTIM}{name}/{key}"), TensorStorageMetadata) and where.reads(e.size)):
                problems.append(f"optimizer state {key!r} of {name!r} is in {MANIFEST} but not in the data in its shape")
            elif kind == TENSOR and f"{OPTIM}{name}/{key}" not in entries:
                problems.append(f"optimizer state {key!r} of {name!r} is in {MANIFEST} but not in the data")
    if problems:
        raise CheckpointError("checkpoint does not match the model/optimizer:\n  - " + "\n  - ".join(dict.fromkeys(problems)))


def _model_differences(metadata: Metadata, model: torch.nn.Module) -> list[str]:
    saved = {k[len(MODEL) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    live = model.state_dict(keep_vars=True)
    problems = []
    if missing := sorted(set(live) - set(saved)):
        problems.append(f"in the model but missing from the checkpoint: {missing}")
    if extra := sorted(set(saved) - set(live)):
        problems.append(f"in the checkpoint but not in the model: {extra}")
    for key in sorted(set(live) & set(saved)):
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(live[key].shape):
            problems.append(f"shape of {key!r}: checkpoint {size}, model {tuple(live[key].shape)}")
    return problems


def _group_differences(saved_groups: list[dict[str, Any]], opt: "DistributedOptimizer", names: Sequence[str]) -> list[str]:
    if len(saved_groups) != len(opt.param_groups):
        return [f"param groups: checkpoint has {len(saved_groups)}, this optimizer {len(opt.param_groups)}"]
    problems = []
    for index, saved in enumerate(saved_groups):
        live = {names[slot] for slot in opt.param_table.group_slots[index]}
        if moved := sorted(live ^ set(saved["params"])):
            problems.append(f"param group {index}: params {moved} are in it in only one of checkpoint and optimizer")
    return problems


def load_targets(
    model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str], spec: dict, metadata: Metadata
) -> dict[str, Any]:
    """Fresh tensors for everything this rank needs: DCP reads into them, and only once
    every read succeeded does :func:`apply_loaded` copy them into the live objects."""
    targets: dict[str, Any] = {
        MODEL + key: torch.empty_like(value.detach())
        for key, value in model.state_dict(keep_vars=True).items()
        if opt.param_table.find(value) is None
    }
    entries = metadata.state_dict_metadata
    for frag in opt.runtime.fragments:
        name, where, lo, numel = names[frag.slot], placed(opt.param_table.params[frag.slot]), frag.where.param_offset, frag.where.numel
        for key, kind in [("main", SHARDED), *spec.get(name, {}).items()]:
            fqn = f"{OPTIM}{name}/{key}"
            if kind == SHARDED:
                entry = entries[fqn]
                targets[fqn] = where.pieces(_empty((numel,), entry.properties.dtype), lo, entry.size)
            elif kind == TENSOR:
                targets[fqn] = _empty(entries[fqn].size, entries[fqn].properties.dtype)
    return targets


def _empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """On the CPU: the wrapped optimizer's load_state_dict moves state where it belongs."""
    return torch.empty(tuple(shape), dtype=dtype, device="cpu")


@torch.no_grad()
def apply_loaded(
    targets: dict[str, Any], model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str], spec: dict
) -> None:
    """Copy what was read into the model's other entries, the fp32 masters and the wrapped
    optimizer's state; then write masters into the param shards and all-gather them."""
    for key, value in model.state_dict(keep_vars=True).items():
        if MODEL + key in targets:
            value.detach().copy_(targets[MODEL + key])
    with opt.runtime.sharded_state.replacing():  # on exit: masters -> every rank's params
        states = []
        for frag in opt.runtime.fragments:
            name = names[frag.slot]
            opt.runtime.sharded_state.load_master(frag, targets[f"{OPTIM}{name}/main"].flat)
            states.append(
                {key: _loaded_value(targets, f"{OPTIM}{name}/{key}", kind, frag) for key, kind in spec.get(name, {}).items()}
            )
        opt.runtime.sharded_state.load_fragment_states(states)


def _loaded_value(targets: dict[str, Any], fqn: str, kind: Any, frag: FragmentTensor) -> Any:
    if kind == SHARDED:
        return targets[fqn].flat.view(frag.param.shape)
    return targets[fqn] if kind == TENSOR else kind[1]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def group_records(opt: "DistributedOptimizer", names: Sequence[str]) -> list[dict[str, Any]]:
    """Each param group's params (by name) and hyperparameters, for the manifest."""
    records = []
    for index, group in enumerate(opt.param_groups):
        hyper = hyperparameters(group)
        for key, value in hyper.items():
            if not _is_json(value):
                raise CheckpointError(
                    f"param_groups[{index}][{key!r}] is a {type(value).__name__}; checkpoints store hyperparameters as JSON"
                )
        records.append({"params": [names[slot] for slot in opt.param_table.group_slots[index]], "hyperparameters": hyper})
    return records


def apply_hyperparameters(opt: "DistributedOptimizer", records: list[dict[str, Any]]) -> None:
    """Restore saved hyperparameters (as torch.optim's load_state_dict does), keeping tuples tuples."""
    for group, record in zip(opt.param_groups, records):
        for key, value in record["hyperparameters"].items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) and isinstance(value, list) else value


def _is_json(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))
