"""What a checkpoint holds, and how it maps onto a live model and DistributedOptimizer.

The format does not depend on the world size or the bucket layout it was saved with:

* ``model/<key>`` - every entry of ``model.state_dict()``, a plain (replicated) tensor
  that DCP writes once, so the checkpoint also loads into a model without fxzero;
* ``optim/<param>/main`` - the fp32 master values of a managed param, and
  ``optim/<param>/<key>`` for every elementwise state tensor of the wrapped optimizer
  (AdamW's ``exp_avg``, ``exp_avg_sq``), each a *logical full 1-D tensor* of the param's
  numel of which every rank writes only the fragment ``[lo, hi)`` it owns (a
  :class:`Chunk`); on load each rank asks for its own, new fragments and DCP reads the
  overlapping pieces of whatever the saving ranks wrote: that is the resharding;
* ``optim/<param>/<key>`` for other tensors (AdamW's scalar ``step``): a plain tensor,
  the same on every rank that owns part of the param.

Params are named by their module path (the first name of a tied weight). Hyperparameters,
the optimizer class and the layout of the state go to the manifest (JSON), see
:mod:`fxzero.checkpoint.io`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.utils import find_state_dict_object

from .._torch_compat import DcpCheckpointable
from ..optim.layout import Fragment
from ..optim.shards import FragmentTensor
from ..optim.state_dict import hyperparameters, is_elementwise_state

if TYPE_CHECKING:
    from ..distributed_optimizer import DistributedOptimizer

__all__ = [
    "CheckpointError",
    "Chunk",
    "ChunkLoadPlanner",
    "ChunkSavePlanner",
    "apply_hyperparameters",
    "apply_loaded",
    "check_compatible",
    "group_records",
    "load_targets",
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


@dataclasses.dataclass(frozen=True, eq=False)
class Chunk(DcpCheckpointable):
    """``local`` is the piece ``[offset, offset + local.numel())`` of a logical 1-D tensor
    of ``numel`` elements. It speaks DCP's checkpointable protocol
    (:class:`~fxzero._torch_compat.DcpCheckpointable`), so DCP plans uneven and empty
    pieces, at any world size, without ShardedTensor (which needs a process group even
    at world size 1)."""

    local: torch.Tensor
    offset: int
    numel: int

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def write_items(self, fqn: str) -> list[WriteItem]:
        if self.local.numel() == 0:
            return []
        data = TensorWriteData(self._chunk(), TensorProperties.create_from_tensor(self.local), torch.Size([self.numel]))
        return [WriteItem(MetadataIndex(fqn, torch.Size([self.offset])), WriteItemType.SHARD, tensor_data=data)]

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.local.numel() else []


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict.get(index.fqn)
    return obj.local if isinstance(obj, Chunk) else find_state_dict_object(state_dict, index)


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner for a flat state dict; a :class:`Chunk` resolves to its local piece."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for a flat state dict; a :class:`Chunk` resolves to its local piece."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces every value that is not a tensor, container or scalar by
        # None (torch 2.13 _iterate_state_dict), which would drop our chunks: put them back.
        chunks = {key: value for key, value in state_dict.items() if isinstance(value, Chunk)}
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
    for slot, param in enumerate(opt.params):
        if id(param) not in name_of:
            raise CheckpointError(
                f"optimizer param {slot} (shape {tuple(param.shape)}) is not a parameter of the given model; "
                "pass the model whose params the optimizer manages"
            )
    return [name_of[id(p)] for p in opt.params]


def _kind(value: Any, frag: FragmentTensor, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return SHARDED if is_elementwise_state(value, frag) else TENSOR
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["value", value]
    raise CheckpointError(f"optimizer state {where} is a {type(value).__name__}; checkpoints hold tensors and JSON scalars")


def save_state(model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str]) -> tuple[dict[str, Any], dict]:
    """This rank's DCP state dict, and the kind of every state entry of the params it owns."""
    state: dict[str, Any] = {MODEL + key: value for key, value in model.state_dict().items()}
    spec: dict[str, dict[str, Any]] = {}
    for frag in opt.fragments:
        name, numel, where = names[frag.slot], opt.params[frag.slot].numel(), frag.where
        state[f"{OPTIM}{name}/main"] = Chunk(frag.param.detach().reshape(-1), where.param_offset, numel)
        for key, value in opt.fragment_state(frag).items():
            kind = spec.setdefault(name, {})[key] = _kind(value, frag, f"{key!r} of {name!r}")
            if kind == SHARDED:
                state[f"{OPTIM}{name}/{key}"] = Chunk(value.reshape(-1), where.param_offset, numel)
            elif kind == TENSOR:
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
        entry = metadata.state_dict_metadata.get(f"{OPTIM}{name}/main")
        numel = opt.params[slot].numel()
        if numel and (not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != (numel,)):
            problems.append(f"param {name!r}: no fp32 master values of {numel} elements in the checkpoint")
        for key, kind in manifest["state"].get(name, {}).items():
            if kind in (SHARDED, TENSOR) and f"{OPTIM}{name}/{key}" not in metadata.state_dict_metadata:
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
    device = torch.device("cpu")  # the wrapped optimizer's load_state_dict moves state where it belongs
    for frag in opt.fragments:
        name, numel, where = names[frag.slot], opt.params[frag.slot].numel(), frag.where
        targets[f"{OPTIM}{name}/main"] = _fresh_chunk(where, numel, torch.float32, device)
        for key, kind in spec.get(name, {}).items():
            fqn = f"{OPTIM}{name}/{key}"
            if kind == SHARDED:
                targets[fqn] = _fresh_chunk(where, numel, metadata.state_dict_metadata[fqn].properties.dtype, device)
            elif kind == TENSOR:
                entry = metadata.state_dict_metadata[fqn]
                targets[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
    return targets


def _fresh_chunk(where: Fragment, numel: int, dtype: torch.dtype, device: torch.device) -> Chunk:
    return Chunk(torch.empty(where.numel, dtype=dtype, device=device), where.param_offset, numel)


@torch.no_grad()
def apply_loaded(
    targets: dict[str, Any], model: torch.nn.Module, opt: "DistributedOptimizer", names: Sequence[str], spec: dict
) -> None:
    """Copy what was read into the model's other entries, the fp32 masters and the wrapped
    optimizer's state; then write masters into the param shards and all-gather them."""
    for key, value in model.state_dict(keep_vars=True).items():
        if MODEL + key in targets:
            value.detach().copy_(targets[MODEL + key])
    with opt.replacing_state():  # on exit: masters -> every rank's params
        states = []
        for frag in opt.fragments:
            name = names[frag.slot]
            frag.param.view(-1).copy_(targets[f"{OPTIM}{name}/main"].local)
            states.append(
                {key: _loaded_value(targets, f"{OPTIM}{name}/{key}", kind, frag) for key, kind in spec.get(name, {}).items()}
            )
        opt.load_fragment_states(states)


def _loaded_value(targets: dict[str, Any], fqn: str, kind: Any, frag: FragmentTensor) -> Any:
    if kind == SHARDED:
        return targets[fqn].local.view(frag.param.shape)
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
