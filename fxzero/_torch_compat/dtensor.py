"""DTensor params (tensor parallelism): their local tensors and where they lie.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "dtensor_global_offset",
    "dtensor_local",
    "flat_input_positions",
    "is_dtensor",
    "local_tensor_or_none",
    "set_dtensor_local",
]


dtensor_local: Callable[[torch.Tensor], torch.Tensor] = operator.attrgetter("_local_tensor")
"""The local tensor a ``DTensor`` (or a ``DTensor`` param) holds on this rank, itself (not a
view made through autograd, as ``to_local()`` makes one). An ``attrgetter``, so mapping it
over the params each step stays in C.

What for: fxzero's flat buffers hold each DTensor param's local tensor, and the optimizer
checks by pointer every step that it still does. Reads ``DTensor._local_tensor`` (what
FSDP2's ``FSDPParam`` reads); if torch renames it: ``tensor.to_local()`` under
``torch.no_grad()``, which returns a view of the same memory."""


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing ``torch.distributed.tensor``: no DTensor
    exists before that module is loaded (nor where torch has no distributed package), and
    loading it cost every ``import fxzero`` ~0.6 s on this machine."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(value, cls)


def flat_input_positions(example_inputs: Sequence[Any]) -> tuple[list[int], int]:
    """Where each Dynamo graph input lands among AOTAutograd's flattened graph inputs (a
    tensor subclass input, a DTensor, becomes one placeholder per ``__tensor_flatten__``
    attribute, its local tensor first), and how many there are.

    What for: fxzero finds managed params among Dynamo's inputs, while its passes index the
    joint, forward and backward graphs, whose placeholders are the flattened ones (a DTensor
    param is its local tensor there, then its device mesh). Uses
    ``torch.utils._python_dispatch.is_traceable_wrapper_subclass`` (AOTAutograd's own test).
    Static shapes only: with dynamic shapes AOTAutograd appends the outer sizes' symbols per
    subclass; a count that disagrees with the joint graph's makes fxzero leave that graph's
    gradients to autograd (its eager hooks take them)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def count(value: Any) -> int:
        if not is_traceable_wrapper_subclass(value):
            return 1
        attrs, _ = value.__tensor_flatten__()
        return sum(count(getattr(value, a)) for a in attrs)

    positions, total = [], 0
    for value in example_inputs:
        positions.append(total)
        total += count(value)
    return positions, total


def set_dtensor_local(param: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of DTensor ``param``, in place (same Parameter object).

    What for: a DTensor param's local tensor becomes a view of fxzero's flat param buffer,
    so the gathers write what the model reads, while the module keeps its Parameter (hooks,
    optimizer references, tied weights stay valid). ``local`` must have the old local's
    shape, dtype and device (the DTensor's metadata is not changed).

    Why not only assign ``DTensor._local_tensor`` (as FSDP2's ``FSDPParam.reset_sharded_param``
    does): the DTensor wrapper records its local tensor's storage offset when it is made
    (``torch.Tensor._dtensor__new__``), and Dynamo's fakeification rebuilds the wrapper from a
    fake local (``__tensor_unflatten__``, taking the fake local's offset) and compares the two
    offsets (``torch/_subclasses/meta_utils.py``, ``MetaConverter.meta_tensor``, torch 2.13):
    a wrapper still saying 0 over a local at a nonzero offset into the buffer takes the ``set_``
    branch there and fails ("Attempted to set the storage of a tensor on device "cpu" to a
    storage on different device "meta""), so ``torch.compile`` of the model failed. A local at
    a new offset therefore gets a fresh wrapper made from it, swapped into ``param`` with
    ``torch.utils.swap_tensors`` (the object, its attributes, hooks and grad are kept; the
    hooks live on the C++ tensor, so their dicts are handed over before the swap). Uses
    ``DTensor._spec``; if torch renames it: ``DTensor.from_local(local, param.device_mesh,
    param.placements, shape=param.shape, stride=param.stride(), run_check=False)``."""
    if local.storage_offset() == param.storage_offset():
        param._local_tensor = local  # type: ignore[attr-defined]
        return
    from torch.distributed.tensor import DTensor

    fresh = DTensor(local, param._spec, requires_grad=param.requires_grad)  # type: ignore[attr-defined]
    fresh.__dict__.update(param.__dict__)
    for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        if getattr(param, hooks, None) is not None:
            setattr(fresh, hooks, getattr(param, hooks))
    if param.grad is not None:
        fresh.grad = param.grad
    torch.utils.swap_tensors(param, fresh)


def dtensor_global_offset(param: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's local tensor of DTensor ``param`` starts in the global tensor, per dim.

    What for: fxzero's checkpoints store each param's optimizer state as the global tensor, so
    a run with another tensor-parallel degree reads it; a rank's fragment of the local tensor
    is placed there. Uses ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
    (what DCP's own DTensor write items use). If torch moves it:
    ``param.__create_chunk_list__()[0].offsets``, DCP's checkpointable protocol on DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)  # type: ignore[attr-defined]
    return tuple(int(o) for o in offset)


def local_tensor_or_none(value: Any) -> Optional[torch.Tensor]:
    """``value``'s local tensor if it is a DTensor, else ``None``, without an ``isinstance``
    check (``DTensor._local_tensor``, as :data:`dtensor_local`): what the param table asks of
    a param to tell whether a compiled graph's input is that param's local tensor."""
    return getattr(value, "_local_tensor", None)
