"""What a parity check runs, decided before anything runs: its options, the optimizer
to wrap (as plain data a rank process can rebuild), the per-rank slices of each global
batch, the modules that make the comparison meaningless, and the tolerances.

Everything here is pure (no process group, no training) and raises errors that name
the argument at fault, so a bad call fails in the caller's process, before any rank
is started.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn as nn

from .._torch_compat import batch_norm_base
from ..config import Config
from ..distributed_optimizer import DistributedOptimizer
from ..optim.state.state_dict import hyperparameters
from ..target import TargetError

__all__ = [
    "OptimizerSpec",
    "ParityError",
    "ParityOptions",
    "Tolerance",
    "batch_keys",
    "call_model",
    "check_model",
    "default_optimizer",
    "floor_parts",
    "incomparable_modules",
    "normalize_batch",
    "split_batch",
    "tolerance",
    "trainable_params",
    "unpack_target",
]

FLOOR_MULTIPLE = 10.0
"""Default tolerance = this many times the noise floor (see :func:`tolerance`)."""
ULP_MULTIPLE = 8.0
"""The smallest default tolerance: this many units of rounding (eps of the dtype) of
the largest reference value, for when the noise floor is 0."""


class ParityError(ValueError):
    """The model, batches or optimizer handed to a parity check cannot be checked."""


@dataclasses.dataclass(frozen=True)
class ParityOptions:
    """How :func:`fxzero.parity` runs fxzero (the reference is always eager, one process)."""

    world_size: int = 2
    """Gloo ranks on this machine (CPU); each takes 1/world_size of every global batch."""
    steps: int = 5
    """Optimizer steps compared."""
    inner_compiler: Literal["inductor", "eager"] = "inductor"
    """What compiles fxzero's graphs on the ranks (the reference never compiles)."""
    bucket_size: Union[int, Literal["auto"], None] = "auto"
    """``fxzero.Config.bucket_size`` on the ranks."""
    mxfp8: bool = False
    """Gather params as MXFP8 (the reference then computes on the MXFP8 round trip of its
    fp32 masters after every step, as fxzero's params are)."""
    atol_loss: Optional[float] = None
    """Largest allowed |fxzero loss - reference loss|; ``None``: from the noise floor."""
    atol_param: Optional[float] = None
    """Largest allowed |fxzero param - reference param|; ``None``: from the noise floor."""
    timeout: float = 600.0
    """Seconds each multi-rank run may take before the ranks are killed."""
    optimizer_state_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    """``fxzero.Config.optimizer_state_dtype`` on the ranks; the reference keeps fp32 state, so
    the differences reported are this option's drift against fp32, beside the noise floor."""
    param_remainders: bool = False
    """``fxzero.Config.param_remainders`` on the ranks (bf16 params; the reference keeps fp32 masters)."""
    param_rounding: Literal["auto", "nearest_even", "half_away", "stochastic"] = "auto"
    """``fxzero.Config.param_rounding`` on the ranks."""

    @property
    def precision(self) -> tuple[str, ...]:
        """The precision options set away from their defaults, as ``name=value``."""
        defaults = {"optimizer_state_dtype": "fp32", "param_remainders": False, "param_rounding": "auto"}
        return tuple(f"{k}={getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v)

    def __post_init__(self) -> None:
        for name in ("world_size", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParityError(f"parity: {name} must be a whole number >= 1, got {value!r}")
        if self.inner_compiler not in ("inductor", "eager"):
            raise ParityError(f"parity: inner_compiler must be 'inductor' or 'eager', got {self.inner_compiler!r}")
        if not isinstance(self.mxfp8, bool):
            raise ParityError(f"parity: mxfp8 must be a bool, got {self.mxfp8!r}")
        for name in ("atol_loss", "atol_param", "timeout"):
            value = getattr(self, name)
            if value is None and name != "timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ParityError(f"parity: {name} must be a finite number >= 0, got {value!r}")
        try:
            self.config(overlap=True)  # bucket_size and the precision options are checked by Config itself
        except (TypeError, ValueError) as error:
            raise ParityError("parity: " + str(error)) from None  # Config's own message names the option

    def config(self, *, overlap: bool) -> Config:
        return Config(bucket_size=self.bucket_size, mxfp8_param_gather=self.mxfp8, overlap_param_gather=overlap,
                      optimizer_state_dtype=self.optimizer_state_dtype, param_remainders=self.param_remainders,
                      param_rounding=self.param_rounding)  # fmt: skip


def default_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """What the check wraps when no ``optimizer_factory`` is given: AdamW, lr 1e-3."""
    return torch.optim.AdamW(params, lr=1e-3)


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer ``optimizer_factory`` built, as data: its class, constructor keywords
    and param groups by position in :func:`trainable_params`. Why data: the rank
    processes rebuild it around fxzero, and a factory (often a lambda) cannot be sent to
    another process, while a class and numbers can."""

    optimizer_class: type
    kwargs: dict[str, Any]
    groups: tuple[tuple[tuple[int, ...], dict[str, Any]], ...]

    @classmethod
    def of(cls, optimizer: Any, params: Sequence[torch.Tensor]) -> "OptimizerSpec":
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DistributedOptimizer):
            raise ParityError(
                f"optimizer_factory(params) must return a plain torch.optim optimizer (fxzero wraps it), "
                f"got {type(optimizer).__name__}"
            )
        position = {id(p): i for i, p in enumerate(params)}
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            if any(id(p) not in position for p in group["params"]):
                raise ParityError(
                    f"optimizer_factory(params): param_groups[{index}] holds a tensor that is not one of the params "
                    "it was given (the model's trainable params)"
                )
            hyper = hyperparameters(group)
            groups.append((tuple(position[id(p)] for p in group["params"]), hyper))
        return cls(type(optimizer), _constructor_kwargs(type(optimizer), optimizer.defaults), tuple(groups))

    def param_groups(self, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": [params[i] for i in indices], **hyper} for indices, hyper in self.groups]

    def describe(self) -> str:
        lrs = sorted({float(hyper["lr"]) for _, hyper in self.groups if "lr" in hyper})
        groups = f"{len(self.groups)} param group{'s' if len(self.groups) != 1 else ''}"
        return f"{self.optimizer_class.__name__} ({groups}" + (f", lr {', '.join(map(str, lrs))})" if lrs else ")")


def _constructor_kwargs(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the class's constructor takes: torch keeps some in ``defaults`` that
    it does not accept back (AdamW's ``decoupled_weight_decay``)."""
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


# ---- what the TARGET function returns ---------------------------------------------------
RETURNS = "(model, batch_fn[, optimizer_factory[, loss_fn]])"


def unpack_target(result: Any, name: str) -> tuple[nn.Module, Callable[[int], Any], Optional[Callable[..., Any]], Any]:
    """Split a TARGET function's return value, naming what is wrong with it."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3, 4):
        raise TargetError(f"{name}() must return {RETURNS}, got {type(result).__name__}")
    model, batch_fn = result[0], result[1]
    factory = result[2] if len(result) >= 3 else None
    loss_fn = result[3] if len(result) == 4 else None
    if loss_fn is not None and not callable(loss_fn):
        raise TargetError(f"{name}() returned loss_fn of type {type(loss_fn).__name__}; expected loss_fn(output)")
    if not isinstance(model, nn.Module):
        raise TargetError(f"{name}() returned a model of type {type(model).__name__}; expected a torch.nn.Module")
    if not callable(batch_fn):
        raise TargetError(f"{name}() returned batch_fn of type {type(batch_fn).__name__}; expected batch_fn(step)")
    if factory is not None and not callable(factory):
        raise TargetError(
            f"{name}() returned optimizer_factory of type {type(factory).__name__}; expected optimizer_factory(params)"
        )
    return model, batch_fn, factory, loss_fn


# ---- batches ----------------------------------------------------------------------------
def batch_keys(value: Any) -> tuple[str, ...]:
    """The keyword names of a batch given as a dict (``{"input_ids": ..., "labels": ...}``);
    ``()`` for positional batches."""
    return tuple(value) if isinstance(value, dict) else ()


def call_model(forward: Any, batch: tuple[torch.Tensor, ...], keys: Sequence[str]) -> Any:
    """``forward(**batch)`` for a dict batch (its values in ``keys`` order), else ``forward(*batch)``."""
    return forward(**dict(zip(keys, batch))) if keys else forward(*batch)


def normalize_batch(value: Any, step: int, keys: Sequence[str] = ()) -> tuple[torch.Tensor, ...]:
    """``batch_fn(step)``'s global batch as a tuple of tensors (a lone tensor is one; a dict's
    values in the order of step 0's ``keys``)."""
    if isinstance(value, dict):
        if tuple(value) != tuple(keys):
            raise ParityError(f"batch_fn({step}) returned keys {list(value)}; batch_fn(0) returned {list(keys)}")
        value = tuple(value.values())
    batch = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(batch, (tuple, list)) or not batch:
        raise ParityError(f"batch_fn({step}) returned {type(value).__name__}; expected a tuple of tensors")
    for index, item in enumerate(batch):
        if not isinstance(item, torch.Tensor) or item.dim() == 0:
            what = "a 0-dim tensor" if isinstance(item, torch.Tensor) else f"a {type(item).__name__}"
            raise ParityError(f"batch_fn({step})[{index}] is {what}; every item must be a tensor with a batch dim 0")
        if item.device.type != "cpu":
            raise ParityError(f"batch_fn({step})[{index}] is on {item.device}; {_CPU_ONLY}")
    return tuple(batch)


_CPU_ONLY = "fxzero parity runs its ranks on CPU with gloo (no NCCL/GPU path yet): build it on the CPU"


def split_batch(batch: tuple[torch.Tensor, ...], parts: int, step: int) -> list[tuple[torch.Tensor, ...]]:
    """``parts`` equal slices of every tensor along dim 0, as rank ``r`` takes slice ``r``."""
    for index, item in enumerate(batch):
        if item.shape[0] % parts:
            raise ParityError(
                f"batch_fn({step})[{index}] has shape {tuple(item.shape)}: its size along dim 0 ({item.shape[0]}) "
                f"is not divisible by {parts} (each rank takes an equal slice of the global batch)"
            )
    return [tuple(item.chunk(parts)[r] for item in batch) for r in range(parts)]


def floor_parts(world_size: int, batches: Sequence[tuple[torch.Tensor, ...]]) -> int:
    """Slices the noise-floor reference splits each batch into: as many as ranks (it then
    sums gradients as the ranks do); at world size 1, 2 if the batch splits, so the floor
    is still a second computation, not the reference itself (then 0)."""
    if world_size > 1:
        return world_size
    return 2 if all(t.shape[0] % 2 == 0 for batch in batches for t in batch) else 1


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ParityError(f"parity: model must be a torch.nn.Module, got {type(model).__name__}")
    if not trainable_params(model):
        raise ParityError(f"parity: {type(model).__name__} has no trainable params (requires_grad=True)")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != "cpu":
            raise ParityError(f"parity: model tensor {name!r} is on {tensor.device}; {_CPU_ONLY}")


# ---- what makes the comparison meaningless ----------------------------------------------------
def incomparable_modules(model: nn.Module) -> tuple[str, ...]:
    """Modules in train mode whose output for a sample depends on the rest of its batch: N
    ranks on slices cannot match one process. (Random ops are no reason: the reference
    draws each rank's masks from that rank's generator, :mod:`.probe`.)"""
    reasons = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, batch_norm_base()) and module.training:
            reasons.append(
                f"{name or 'model'} ({kind} in train mode): per-rank batch statistics. Fix: check the model with it in "
                "eval mode, or GroupNorm / LayerNorm in its place (SyncBatchNorm is not supported by fxzero parity)"
            )
    return tuple(reasons)


# ---- tolerances ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tolerance:
    value: float
    source: str
    """How it was chosen, for the report."""


def tolerance(floor: float, scale: float, dtype: torch.dtype, given: Optional[float], flag: str) -> Tolerance:
    """``given`` if set; else ``max(FLOOR_MULTIPLE x floor, ULP_MULTIPLE x eps(dtype) x scale)``.

    Why: the noise floor is how far two correct eager computations of the same training
    drift apart (rounding, amplified by the optimizer: Adam turns a gradient that is 0
    in exact arithmetic into lr-sized steps of either sign); fxzero, compiled, rounds
    differently again, by about as much, so a multiple of it separates rounding from a
    bug. The ulp term keeps the tolerance above 0 when the floor happens to be exactly 0.
    """
    if given is not None:
        return Tolerance(float(given), f"given ({flag})")
    ulps = ULP_MULTIPLE * torch.finfo(dtype).eps * scale
    if FLOOR_MULTIPLE * floor >= ulps:
        return Tolerance(FLOOR_MULTIPLE * floor, f"{FLOOR_MULTIPLE:g} x noise floor")
    return Tolerance(ulps, f"{ULP_MULTIPLE:g} x eps({str(dtype).removeprefix('torch.')}) x largest |value| {scale:.3g}")
