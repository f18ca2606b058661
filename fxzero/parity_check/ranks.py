"""The rank side of a parity check: fxzero training the user's model on N gloo ranks.

The harness (:mod:`fxzero.testing`) sends functions by reference and arguments by
pickle, so a rank cannot be handed the live model. It re-creates it instead, from a
:class:`ModelSource`: the TARGET the command line was given (the rank calls the
user's function itself, as the parent did), or, from Python, the model pickled in the
parent (its class must then be importable by name). Either way the rank then loads the
parent's initial ``state_dict``, so every rank and the reference start from the same
values. The batches come from the parent too (computed once), so ``batch_fn`` never
runs on a rank.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed_optimizer import DistributedOptimizer
from ..target import load_target
from .plan import (
    RETURNS,
    OptimizerSpec,
    ParityError,
    ParityOptions,
    default_optimizer,
    split_batch,
    trainable_params,
    unpack_target,
)
from .._torch_compat import inductor_eager_random
from .probe import RANK_SEED
from .reference import Call, param_snapshot

__all__ = ["DEFAULT_FUNCTION", "ModelSource", "RankRun", "RankTask", "train_rank"]

DEFAULT_FUNCTION = "fxzero_parity"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """How a rank process gets the model and the optimizer to wrap."""

    target: Optional[str] = None
    """A resolved TARGET (``/abs/file.py[:fn]`` or ``module[:fn]``): the rank calls it."""
    pickled: Optional[bytes] = None
    """``pickle.dumps((model, OptimizerSpec))`` made in the parent."""

    @classmethod
    def of_model(cls, model: nn.Module, spec: OptimizerSpec, loss_fn: Any = None) -> "ModelSource":
        try:
            return cls(pickled=pickle.dumps((model, spec, loss_fn)))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ParityError(
                f"fxzero.parity sends the model to its rank processes by pickle, and this {type(model).__name__} "
                f"(or its optimizer class or loss_fn) cannot be pickled: {error}. Define the model's class at module level in "
                "an importable module, or run `python -m fxzero parity TARGET`, whose ranks call TARGET's function"
            ) from error

    def load(self) -> tuple[nn.Module, OptimizerSpec, Any]:
        """The model, the optimizer to wrap, and ``loss_fn`` (or None)."""
        if self.target is not None:
            factory = load_target(self.target, DEFAULT_FUNCTION, RETURNS)
            model, _, optimizer_factory, loss_fn = unpack_target(factory(), getattr(factory, "__name__", self.target))
            params = trainable_params(model)
            return model, OptimizerSpec.of((optimizer_factory or default_optimizer)(params), params), loss_fn
        try:
            return pickle.loads(self.pickled)
        except Exception as error:  # noqa: BLE001 - any unpickling failure means the same thing
            raise ParityError(
                f"rank {dist.get_rank()} cannot re-create the model from its pickle ({type(error).__name__}: {error}); "
                "the model's class must be importable by name in a fresh process (module level, on sys.path), or run "
                "`python -m fxzero parity TARGET`"
            ) from error


@dataclasses.dataclass(frozen=True)
class RankTask:
    source: ModelSource
    initial_state: dict[str, Any]
    batches: tuple[tuple[torch.Tensor, ...], ...]
    """The global batches; each rank takes its slice."""
    options: ParityOptions
    overlap: bool
    """``Config.overlap_param_gather``."""
    record: bool
    """Rank 0 returns the params after every step (else only after the last)."""
    keys: tuple[str, ...] = ()
    """A dict batch's keyword names (``()``: positional)."""
    random: bool = False
    """The model draws random numbers: each rank seeds ``RANK_SEED + rank`` (the reference draws
    the same), and Inductor compiles random ops as eager's (:func:`inductor_eager_random`; not
    around the eager inner compiler, which draws eager's already: under the flag its partition
    ran the dropouts again in backward, drawing new masks from the generator)."""


@dataclasses.dataclass(frozen=True)
class RankRun:
    losses: tuple[float, ...]
    """This rank's loss (on its slice) at each step."""
    params: dict[str, torch.Tensor]
    """After the last step."""
    snapshots: tuple[dict[str, torch.Tensor], ...]
    """After each step (rank 0 of a recording run; else empty)."""
    buckets: dict[str, int]
    """Bucket index of every managed param, by module path."""
    skipped: tuple[int, ...]
    """Steps (1-based) whose update fxzero skipped (non-finite gradient norm)."""


def _optimizer(model: nn.Module, spec: OptimizerSpec, task: RankTask) -> DistributedOptimizer:
    params = trainable_params(model)
    config = task.options.config(overlap=task.overlap)
    return DistributedOptimizer(
        spec.param_groups(params), spec.optimizer_class, config=config, module=model, **spec.kwargs
    )


def train_rank(task: RankTask) -> RankRun:
    """fxzero as a user runs it: ``DistributedOptimizer(..., module=model)`` and
    ``torch.compile(model, backend="fxzero")`` on this rank's slice of each batch."""
    rank = dist.get_rank()
    model, spec, loss_fn = task.source.load()
    model.load_state_dict(task.initial_state)
    opt = _optimizer(model, spec, task)
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": task.options.inner_compiler})
    if task.random:
        torch.manual_seed(RANK_SEED + rank)
    with inductor_eager_random(task.random and task.options.inner_compiler == "inductor"):
        return _train(task, model, compiled, opt, Call(task.keys, loss_fn))


def _train(task: RankTask, model: nn.Module, compiled: Any, opt: DistributedOptimizer, call: Call) -> RankRun:
    rank, world = dist.get_rank(), dist.get_world_size()
    record = task.record and rank == 0
    losses, snapshots, skipped = [], [], []
    for step, batch in enumerate(task.batches):
        loss = call.loss(compiled, split_batch(batch, world, step)[rank], step)
        loss.backward()
        if record and step > 0:
            # The params after the previous step, read once this forward has waited for
            # every bucket's gather: reading them right after step() would need
            # finish_param_sync(), which would leave the forward no gather to wait for.
            snapshots.append(param_snapshot(model))
        if opt.step().skipped:
            skipped.append(step + 1)
        opt.zero_grad()
        losses.append(float(loss.detach()))
    opt.finish_param_sync()
    params = param_snapshot(model)
    name = {id(p): n for n, p in model.named_parameters()}
    buckets = {name[id(p)]: b.index for b in opt.runtime.buckets for p in b.params}
    return RankRun(tuple(losses), params, tuple(snapshots) + ((params,) if record else ()), buckets, tuple(skipped))
