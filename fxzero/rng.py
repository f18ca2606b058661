"""A process's random number generators, captured so that a resume draws what the
uninterrupted run would have drawn.

Dropout under Inductor draws one batch of seeds per compiled graph from the device's
default generator, under the eager inner compiler (and eager) the masks come from that
generator directly: a run resumed from a checkpoint draws the uninterrupted run's masks
only if each rank's generators are where they were at the save. What is captured follows
Hugging Face Trainer's ``rng_state_<rank>.pth``: Python's ``random``, NumPy's global
generator (when NumPy is installed), torch's CPU default generator and, where CUDA is
initialized, each CUDA device's (a process that never initialized CUDA drew nothing from it).

A state is a dict of tuples, ints, floats and tensors, so it loads with
``torch.load(weights_only=True)``. :func:`problems` checks one whole, without touching the
live generators (each part is tried on a fresh generator of its kind), so a caller can
refuse a damaged state before it changes anything; :func:`restore` then sets them all.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture", "device_mismatch", "problems", "restore"]

_PARTS = ("python", "numpy", "cpu", "cuda")


def capture() -> dict[str, Any]:
    """This process's generator states (see the module)."""
    state: dict[str, Any] = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        legacy = numpy.random.get_state(legacy=False)  # MT19937's key, position and cached Gaussian
        state["numpy"] = {
            "key": torch.from_numpy(legacy["state"]["key"].astype("int64")),
            "pos": int(legacy["state"]["pos"]),
            "has_gauss": int(legacy["has_gauss"]),
            "gauss": float(legacy["gauss"]),
        }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def problems(state: Any) -> list[str]:
    """What is wrong with ``state`` (empty if :func:`restore` can set it), checked on fresh
    generators: the live ones are not touched."""
    if not isinstance(state, dict) or "python" not in state or "cpu" not in state:
        return ["it is not a dict of generator states with 'python' and 'cpu' entries"]
    found = [f"unknown entry {key!r}" for key in state if key not in _PARTS]
    for key, check in (("python", _check_python), ("numpy", _check_numpy), ("cpu", _check_cpu), ("cuda", _check_cuda)):
        if key in state:
            try:
                check(state[key])
            except (TypeError, ValueError, RuntimeError, KeyError, OverflowError) as err:
                found.append(f"its {key} generator state is invalid ({type(err).__name__}: {err})")
    return found


def restore(state: dict[str, Any]) -> None:
    """Set every generator :func:`capture` captured (a state :func:`problems` passed)."""
    random.setstate(_python_state(state["python"]))
    torch.set_rng_state(state["cpu"])
    if "numpy" in state and (numpy := _numpy()) is not None:
        numpy.random.set_state(_numpy_state(state["numpy"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def device_mismatch(state: dict[str, Any]) -> str:
    """Why ``state`` cannot be restored in this process although it is valid (its CUDA states are
    for another number of devices), or ``""``."""
    saved, here = len(state.get("cuda", ())), torch.cuda.device_count()
    return f"saved with {saved} CUDA device(s), this process sees {here}" if saved and saved != here else ""


def _numpy() -> Any:
    """NumPy if installed (torch does not require it); imported here, not with fxzero."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _python_state(value: Any) -> tuple:
    version, internal, gauss_next = value  # torch.load gives back the tuples random.getstate made
    return (version, tuple(internal), gauss_next)


def _check_python(value: Any) -> None:
    random.Random().setstate(_python_state(value))


def _numpy_state(value: dict[str, Any]) -> tuple:
    numpy = _numpy()
    key = value["key"]
    if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.shape == (624,)):
        raise ValueError("numpy's key must be an int64 tensor of 624 values")
    return ("MT19937", key.numpy().astype(numpy.uint32), int(value["pos"]), int(value["has_gauss"]), float(value["gauss"]))


def _check_numpy(value: Any) -> None:
    """Where NumPy is not installed nothing can draw from it, and :func:`restore` skips it."""
    numpy = _numpy()
    if numpy is not None:
        numpy.random.RandomState().set_state(_numpy_state(value))


def _check_cpu(value: Any) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8):
        raise TypeError(f"expected a uint8 tensor, got {type(value).__name__}")
    torch.Generator().set_state(value)


def _check_cuda(value: Any) -> None:
    if not (isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in value)):
        raise TypeError("expected a list of uint8 tensors, one per CUDA device")
