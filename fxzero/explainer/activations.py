"""Activation memory of a training step, measured on tensors without data.

Why: model states (:mod:`~fxzero.explainer.sizing`) are only part of a rank's peak. The rest is
what the forward keeps for the backward and what the backward makes on the way, and that
depends on the model's code (which ops save which tensors, attention's kernel, recomputation,
the loss), not on its param shapes alone: a formula per architecture would be wrong for the
next model. So the model is run, once, as a user's step runs it, but on fake tensors (shapes,
dtypes and storage sizes, no data, no compute; a model on the meta device runs too), with a
dispatch mode that adds the bytes of every new storage an op makes and subtracts them when the
storage dies. The largest sum, from the forward's first op to the backward's last, is the
activation peak; the sum when the forward returns is what it saved for the backward.

What it counts, to compare with a measurement: the step runs eagerly (the kernels torch picks
for the device; a compiled step fuses ops and usually keeps less), each gradient is dropped
once accumulated (fxzero's hook moves it into the flat grad buffer, counted with the model
states), params and buffers are not counted (model states), nor allocator rounding or caching
(a GPU's caching allocator rounds each block up; its reserved memory is larger).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._torch_compat import DispatchMode, fake_tensors
from ..model_output import output_tensor

__all__ = ["ActivationEstimate", "estimate_activations"]


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes a forward+backward keeps alive beyond the model states, on one rank's batch."""

    inputs: str
    """The batch it ran on: each tensor input's shape and dtype."""
    saved_bytes: int
    """Live when the forward returned: what it saved for the backward, and its output."""
    peak_bytes: int
    """The most live at any point of the forward and backward."""

    def as_data(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _LiveBytes(DispatchMode):  # type: ignore[misc, valid-type]
    """Counts the bytes of the storages the ops make, while they live (views share one)."""

    def __init__(self, known: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in known:  # params, buffers, inputs: there before the step, never counted
            self._seen[tensor.untyped_storage()] = 0

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            self._count(tensor)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _device(tensor: torch.Tensor) -> torch.device:
    """A fake's device: the tensor's own, CPU for a meta tensor (ops on meta refuse a CPU operand
    the forward may make, a mask or an ``arange``; a fake on the CPU runs them)."""
    return torch.device("cpu") if tensor.device.type == "meta" else tensor.device


def _fake_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_device(tensor))


def _fake_inputs(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _fake_like(value)
    if isinstance(value, dict):
        return {key: _fake_inputs(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_inputs(item) for item in value)
    return value


def _fake_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A fake per param and buffer, by every name it has (a tied param's names share one fake);
    each param's gradient is dropped once accumulated, as fxzero's hook hands it to the buffer."""
    fakes: dict[int, torch.Tensor] = {}
    state = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in fakes:
            fakes[id(param)] = _fake_like(param).requires_grad_(param.requires_grad)
            if param.requires_grad:
                fakes[id(param)].register_post_accumulate_grad_hook(_drop_grad)
        state[name] = fakes[id(param)]
    for name, buffer in model.named_buffers(remove_duplicate=False):
        state[name] = _fake_like(buffer)
    return state


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _describe(inputs: Any) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in _tensors(inputs)) or "no tensors"


def estimate_activations(
    model: torch.nn.Module,
    inputs: tuple[Any, ...] = (),
    kwargs: Optional[dict[str, Any]] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> ActivationEstimate:
    """Run ``model(*inputs, **kwargs)`` and the backward from the sum of its output (the tensor
    :func:`~fxzero.model_output.output_tensor` picks, or ``loss_fn(output)``, as ``fxzero
    explain`` backpropagates) on fake tensors, and count what they keep alive.

    Args:
        model: the module, real or on the meta device; its params and buffers are not read.
        inputs: one rank's batch, positional (tensors are replaced by fakes of their shape).
        kwargs: keyword arguments of the forward, also faked.
        loss_fn: turns the output into the tensor to backpropagate.

    Returns:
        The bytes saved by the forward and the peak of forward+backward, on ``inputs``' shapes.

    Raises:
        RuntimeError: the forward or backward cannot run on fake tensors (it reads a tensor's
            values, ``.item()`` or a data-dependent shape, or uses an op without a fake kernel).

    Example::

        estimate_activations(model, (torch.empty(8, 1024, dtype=torch.long, device="meta"),))
    """
    kwargs = kwargs or {}
    try:
        with fake_tensors():
            state = _fake_state(model)
            args, kw = _fake_inputs(tuple(inputs)), _fake_inputs(dict(kwargs))
            counter = _LiveBytes([*state.values(), *_tensors(args), *_tensors(kw)])
            with counter:
                output = torch.func.functional_call(model, state, args, kw)
                loss = output_tensor(output, loss_fn, "fxzero explain --size").sum()
                saved = counter.live
                del output
                loss.backward()
    except Exception as error:  # noqa: BLE001 - any op may refuse fakes; say which step could not be sized
        raise RuntimeError(
            f"size: {type(model).__name__}'s forward+backward could not run on fake tensors "
            f"({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}); "
            "size it without example inputs (model states only)"
        ) from error
    return ActivationEstimate(_describe((inputs, kwargs)), saved, counter.peak)
