"""Running a parity check: the references in this process, fxzero on N gloo ranks, twice.

Order: everything that can fail on the user's input (model, batches, optimizer, the
loss's shape) fails first, in this process, before any rank starts. The reference and
its noise floor train copies of the model (the caller's model is never changed); the
ranks train with param gathers overlapping the forward (``overlap_param_gather=True``,
opt-in, the mode with more to get wrong) and again with the default (off), and the two
must agree bitwise.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..testing import run_ranks
from ..target import resolve_target
from .plan import (
    OptimizerSpec,
    ParityOptions,
    check_model,
    default_optimizer,
    floor_parts,
    incomparable_modules,
    loss_dependence,
    normalize_batch,
    split_batch,
    tolerance,
)
from .ranks import ModelSource, RankRun, RankTask, train_rank
from .reference import Trainer, Trace, run_references
from .report import ParityReport, Setup, agreement, compare_params, ranks_agree, worst

__all__ = ["check"]


def check(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    optimizer_factory: Optional[Callable[..., Any]],
    options: ParityOptions,
    *,
    target: Optional[str] = None,
) -> ParityReport:
    """The whole check; ``target`` (a TARGET string) makes the ranks call the user's
    function to build their model, instead of unpickling the parent's."""
    start = time.perf_counter()
    check_model(model)
    batches = tuple(normalize_batch(batch_fn(step), step) for step in range(options.steps))
    for step, batch in enumerate(batches):
        split_batch(batch, options.world_size, step)  # raises, naming the tensor, if it does not split
    parts = floor_parts(options.world_size, batches)
    factory = optimizer_factory or default_optimizer
    reference = Trainer(copy.deepcopy(model), factory, options.mxfp8)
    spec = OptimizerSpec.of(reference.optimizer, reference.masters)
    floor = Trainer(copy.deepcopy(model), factory, options.mxfp8, inductor=options.inner_compiler == "inductor")
    source = ModelSource(target=resolve_target(target)) if target is not None else ModelSource.of_model(model, spec)
    trace = run_references(reference, floor, batches, parts)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    runs = [_ranks(RankTask(source, initial, batches, options, overlap, record=overlap)) for overlap in (True, False)]
    dependence = loss_dependence(trace.losses[0], trace.floor_losses[0], parts, _dtype_of(trace))
    not_comparable = incomparable_modules(model) + dependence
    setup = _setup(model, options, spec, runs[0], parts)
    return _report(setup, trace, runs[0], runs[1], not_comparable, time.perf_counter() - start)


def _ranks(task: RankTask) -> list[RankRun]:
    return run_ranks(task.options.world_size, train_rank, task, timeout=task.options.timeout)


def _setup(model: nn.Module, options: ParityOptions, spec: OptimizerSpec, runs: Sequence[RankRun], parts: int) -> Setup:
    params = list(model.parameters())
    buckets = len(set(runs[0].buckets.values()))
    elements = sum(p.numel() for p in params)
    return Setup(type(model).__name__, len(params), elements, options, spec.describe(), buckets, parts)


def _report(
    setup: Setup, trace: Trace, on: list[RankRun], off: list[RankRun], not_comparable: tuple[str, ...], seconds: float
) -> ParityReport:
    options = setup.options
    fxzero_losses = tuple(sum(step) / len(step) for step in zip(*(run.losses for run in on)))
    floor_loss = worst(abs(f - r) for f, r in zip(trace.floor_losses, trace.losses))
    floor_param = worst(d for step in trace.floor_param_diffs for d in step.values())
    dtype = _dtype_of(trace)
    loss_scale = worst(abs(x) for x in trace.losses)
    param_scale = worst(float(p.detach().abs().max()) for p in trace.params[-1].values() if p.numel())
    loss_tol = tolerance(floor_loss, loss_scale, dtype, options.atol_loss, "atol_loss")
    param_tol = tolerance(floor_param, param_scale, dtype, options.atol_param, "atol_param")
    return ParityReport(
        setup=setup,
        reference_losses=trace.losses,
        fxzero_losses=fxzero_losses,
        floor_losses=trace.floor_losses,
        params=compare_params(trace, on[0].snapshots, on[0].buckets, param_tol.value),
        loss_tolerance=loss_tol,
        param_tolerance=param_tol,
        overlap=agreement(on, off),
        ranks=ranks_agree(on),
        not_comparable=not_comparable,
        skipped_steps=on[0].skipped,
        seconds=seconds,
    )


def _dtype_of(trace: Trace) -> torch.dtype:
    """The param dtype with the coarsest rounding (it sets the smallest default tolerance)."""
    return max((p.dtype for p in trace.params[0].values()), key=lambda d: torch.finfo(d).eps)
