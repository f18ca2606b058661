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
from .._torch_compat import inductor_eager_random
from .plan import (
    OptimizerSpec,
    ParityOptions,
    batch_keys,
    check_model,
    default_optimizer,
    floor_parts,
    incomparable_modules,
    normalize_batch,
    split_batch,
    tolerance,
)
from .probe import RankGenerators, batch_mixing, has_random_ops
from .ranks import ModelSource, RankRun, RankTask, train_rank
from .reference import Call, Trainer, Trace, run_references
from .report import ParityReport, Setup, agreement, compare_params, ranks_agree, untrained_report, worst

__all__ = ["check"]


def check(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    optimizer_factory: Optional[Callable[..., Any]],
    options: ParityOptions,
    *,
    target: Optional[str] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
) -> ParityReport:
    """The whole check; ``target`` (a TARGET string) makes the ranks call the user's
    function to build their model, instead of unpickling the parent's."""
    start = time.perf_counter()
    check_model(model)
    keys = batch_keys(first := batch_fn(0))
    batches = tuple(normalize_batch(first if step == 0 else batch_fn(step), step, keys) for step in range(options.steps))
    for step, batch in enumerate(batches):
        split_batch(batch, options.world_size, step)  # raises, naming the tensor, if it does not split
    random = has_random_ops(model, split_batch(batches[0], options.world_size, 0)[0], keys, loss_fn)
    mixing_parts = floor_parts(options.world_size, batches)
    not_comparable = incomparable_modules(model) + batch_mixing(model, batches[0], mixing_parts, keys, loss_fn, random)
    factory = optimizer_factory or default_optimizer
    reference = _trainer(model, factory, options, None, Call(keys, loss_fn), random)
    spec = OptimizerSpec.of(reference.optimizer, reference.masters)
    if not_comparable:  # found in seconds, before any training
        setup = _setup(model, options, spec, None, 0, random)
        return untrained_report(setup, not_comparable, time.perf_counter() - start)
    parts = options.world_size if random else mixing_parts
    floor = _trainer(model, factory, options, _floor_compiler(options, random), Call(keys, loss_fn), random)
    source = ModelSource(target=resolve_target(target)) if target is not None else ModelSource.of_model(model, spec, loss_fn)
    with inductor_eager_random(random and options.inner_compiler == "inductor"):
        trace = run_references(reference, floor, batches, parts)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tasks = [RankTask(source, initial, batches, options, overlap, overlap, keys, random) for overlap in (True, False)]
    runs = [_ranks(task) for task in tasks]
    setup = _setup(model, options, spec, runs[0], parts, random)
    return _report(setup, trace, runs[0], runs[1], (), time.perf_counter() - start)


def _floor_compiler(options: ParityOptions, random: bool) -> Optional[str]:
    """Plain Inductor when the ranks compile with Inductor; with the eager inner compiler,
    AOTAutograd without Inductor for a model with random ops (its slices run with the
    reference's generators, so an eager floor would be the reference itself), else eager."""
    if options.inner_compiler == "inductor":
        return "inductor"
    return "aot_eager" if random else None


def _trainer(model: nn.Module, factory: Any, options: ParityOptions, compiler: Optional[str], call: Call, random: bool) -> Trainer:
    generators = RankGenerators(options.world_size) if random else None
    return Trainer(copy.deepcopy(model), factory, options.mxfp8, compiler, call, generators)


def _ranks(task: RankTask) -> list[RankRun]:
    return run_ranks(task.options.world_size, train_rank, task, timeout=task.options.timeout)


def _setup(model: nn.Module, options: ParityOptions, spec: OptimizerSpec, runs: Optional[Sequence[RankRun]], parts: int,
           random: bool) -> Setup:  # fmt: skip
    params = list(model.parameters())
    buckets = len(set(runs[0].buckets.values())) if runs else 0
    elements = sum(p.numel() for p in params)
    return Setup(type(model).__name__, len(params), elements, options, spec.describe(), buckets, parts, random)


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
