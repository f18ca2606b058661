""":func:`fxzero.parity`: does fxzero train *this* model exactly as plain PyTorch does?

(This package is ``fxzero.parity_check``, not ``fxzero.parity``: :mod:`fxzero` imports it on
first use, and a subpackage named ``parity`` would replace the function ``fxzero.parity``
by itself as soon as any of its modules loaded.)

Why: a new model is where a distributed backend breaks (a stale param read under
Inductor's fusion was found on a real model, not by the test suite), and the user who
brings it has no way to ask. This trains the model with fxzero as a user would
(``DistributedOptimizer(..., module=model)`` and ``torch.compile(backend="fxzero")``)
on N gloo ranks, each on its slice of every global batch, and compares it with plain
single-process eager training on the whole batch, step by step, against the noise
floor of eager training itself. It also reruns fxzero with param gathers
overlapping the forward (opt-in; the results must be bitwise identical) and checks that all ranks hold the
same params. Modules in ``plan`` decide, ``reference`` and ``ranks`` run, ``report``
compares and judges, ``report_format`` prints.

Limits: the ranks run on CPU with gloo (:mod:`fxzero.testing`); there is no NCCL/GPU
path yet, so models and batches must be on the CPU.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import torch.nn as nn

from .plan import ParityError, ParityOptions
from .report import ParityReport
from .run import check

__all__ = ["ParityError", "ParityOptions", "ParityReport", "parity"]


def parity(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    optimizer_factory: Optional[Callable[..., Any]] = None,
    *,
    world_size: int = 2,
    steps: int = 5,
    inner_compiler: Literal["inductor", "eager"] = "inductor",
    bucket_size: Union[int, Literal["auto"], None] = "auto",
    mxfp8: bool = False,
    atol_loss: Optional[float] = None,
    atol_param: Optional[float] = None,
    timeout: float = 600.0,
    optimizer_state_dtype: Literal["fp32", "bf16", "fp8"] = "fp32",
    param_remainders: bool = False,
    param_rounding: Literal["auto", "nearest_even", "half_away", "stochastic"] = "auto",
    loss_fn: Optional[Callable[[Any], Any]] = None,
) -> ParityReport:
    """Train ``model`` with fxzero on ``world_size`` ranks and eagerly in this process;
    compare (``print(report)``; ``report.verdict`` is ``"PASS"``, ``"FAIL"`` or
    ``"NOT COMPARABLE"``).

    A model with random ops (dropout) is compared exactly: each rank seeds its generator,
    the reference runs each rank's slice with that rank's generator, and Inductor compiles
    random ops as eager's so both draw the same masks. A model the check cannot compare
    (BatchNorm in train mode, a summed loss, samples mixed across the batch) is found
    before training and reported ``NOT COMPARABLE`` with the fix, in seconds.
    ``atol_loss`` / ``atol_param`` replace the default tolerances (10x the noise floor).
    ``optimizer_state_dtype``, ``param_remainders``, ``param_rounding``: fxzero's precision options
    (:class:`fxzero.Config`) on the ranks, against a reference that keeps fp32 state and masters:
    the report then gives each option's drift against fp32 beside the noise floor.

    ``model`` is not changed: the reference trains copies, and the ranks get it by
    pickle, so its class must be importable by name in a fresh process (defined at
    module level; in a script, under ``if __name__ == "__main__":``).
    ``python -m fxzero parity TARGET`` has no such need: its ranks call TARGET's function.

    Args:
        model: the module to check (on the CPU); not changed.
        batch_fn: ``batch_fn(step)`` returns the *global* batch of ``step``: a tuple of
            tensors (positional arguments), one tensor, or a dict (keyword arguments, e.g.
            ``{"input_ids": ids, "labels": ids}``); rank r takes slice r of ``world_size``
            equal slices along dim 0.
        optimizer_factory: builds the plain ``torch.optim`` optimizer to wrap from the
            params (default AdamW, lr 1e-3).
        world_size: gloo ranks started on this machine.
        steps: optimizer steps compared.
        inner_compiler: ``"inductor"`` (what training compiles with) or ``"eager"`` (faster).
        bucket_size: the ranks' ``Config.bucket_size``.
        mxfp8: gather params as MXFP8 (``Config.mxfp8_param_gather``); the reference computes
            on the MXFP8 round trip of fp32 masters.
        atol_loss: the loss tolerance (default 10x the noise floor).
        atol_param: the param tolerance (default 10x the noise floor).
        timeout: seconds for each rank run.
        optimizer_state_dtype: the ranks' ``Config.optimizer_state_dtype``.
        param_remainders: the ranks' ``Config.param_remainders``.
        param_rounding: the ranks' ``Config.param_rounding``.
        loss_fn: ``loss_fn(output)`` is the training loss (a mean over the batch). Without
            it: a scalar output, a ``ModelOutput``'s or dict's ``loss``; else the mean of
            squares of the output's logits or first tensor (a stand-in loss).

    Returns:
        A :class:`ParityReport`: the numbers, ``verdict`` and the params, worst first.

    Raises:
        ParityError: bad options, a batch that does not split evenly, a model that does
            not pickle.
        fxzero.testing.RankError: fxzero raised on a rank.
        fxzero.testing.RankTimeout: a rank did not finish within ``timeout``.

    Example::

        report = fxzero.parity(model, lambda step: (x[step], y[step]), world_size=2, steps=5)
        assert report.verdict == "PASS", report.params[0].name
    """
    options = ParityOptions(
        world_size=world_size,
        steps=steps,
        inner_compiler=inner_compiler,
        bucket_size=bucket_size,
        mxfp8=mxfp8,
        atol_loss=atol_loss,
        atol_param=atol_param,
        timeout=timeout,
        optimizer_state_dtype=optimizer_state_dtype,
        param_remainders=param_remainders,
        param_rounding=param_rounding,
    )
    return check(model, batch_fn, optimizer_factory, options, loss_fn=loss_fn)
