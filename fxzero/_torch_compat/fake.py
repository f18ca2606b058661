"""Tensors without data, and watching every op: ``FakeTensorMode`` and ``TorchDispatchMode``.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

from typing import Any, ContextManager

__all__ = ["DispatchMode", "fake_tensors"]


def fake_tensors() -> ContextManager[Any]:
    """A context in which every tensor made is a fake: shape, dtype, device and storage size,
    no data and no compute.

    What for: ``fxzero explain --size`` runs a model's forward and backward on fakes to see
    which tensors they keep alive, for a model on the meta device too. Uses
    ``torch._subclasses.fake_tensor.FakeTensorMode`` (the same in 2.11 through 2.15). If torch
    moves it: the meta device alone, which runs the same ops but refuses a model that makes
    a CPU tensor in its forward (a mask, ``torch.arange`` without ``device=``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _dispatch_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


DispatchMode: type = _dispatch_mode()
"""The base class of a mode that sees every ATen op under autograd, backward included
(``__torch_dispatch__(func, types, args, kwargs)``). What for: the activation estimate counts
the bytes of each op's outputs while they live. Uses ``torch.utils._python_dispatch.TorchDispatchMode``
(a private module; public in substance: torch's docs teach it). If torch moves it: a
``__torch_function__`` mode, which does not see the ops backward runs."""
