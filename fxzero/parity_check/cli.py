"""``python -m fxzero parity TARGET``: :func:`fxzero.parity` from the command line.

Why: "does fxzero train my model exactly as plain PyTorch does?" should take one
command. TARGET names a function (default ``fxzero_parity``) that takes no arguments
and returns ``(model, batch_fn)`` or ``(model, batch_fn, optimizer_factory)``::

    python -m fxzero parity examples/parity_gpt.py --world-size 2
    python -m fxzero parity mypkg.models:parity_target --steps 10 --inner-compiler eager

``batch_fn(step)`` returns the global batch of ``step``: a tuple of tensors (the
forward's positional arguments) or a dict of them (its keyword arguments, as
``{"input_ids": ids, "labels": ids}`` for a Hugging Face model), split over the ranks
along dim 0. The loss is what the forward returns: a scalar, a ``ModelOutput``'s
``loss``, a dict's ``"loss"``; or ``loss_fn(output)`` (a fourth item TARGET returns);
else the mean of squares of the output's logits or first tensor, a stand-in.
``optimizer_factory(params)`` (may be None) builds the torch.optim optimizer to wrap
(default AdamW, lr 1e-3).

A model with random ops (dropout) is compared exactly: each rank seeds its generator,
the reference runs each rank's slice with that rank's generator state, and Inductor
compiles random ops as eager's (``fallback_random``) so both draw the same masks.

The function runs once here (the model and the reference) and once on each rank, which
then loads the initial state made here. fxzero runs on N gloo ranks on this machine's
CPU (no NCCL/GPU path yet). Exit status: 0 PASS, 1 FAIL (also when fxzero raised on a
rank), 2 bad arguments or TARGET, or an error in the model before any rank started (one
message; --traceback for the whole), 3 NOT COMPARABLE (BatchNorm in train mode, a loss
summed over the batch, a model that mixes samples: found before training, in seconds).
"""

from __future__ import annotations

import argparse
import sys

from ..target import TargetError, load_target
from ..testing import RankError, RankTimeout
from .plan import RETURNS, ParityError, ParityOptions, unpack_target
from .ranks import DEFAULT_FUNCTION
from .run import check

__all__ = ["run"]


def _options(args: argparse.Namespace) -> ParityOptions:
    bucket_size = None if args.bucket_size == "none" else args.bucket_size
    return ParityOptions(
        world_size=args.world_size,
        steps=args.steps,
        inner_compiler=args.inner_compiler,
        bucket_size=bucket_size,
        mxfp8=args.mxfp8,
        atol_loss=args.atol_loss,
        atol_param=args.atol_param,
        timeout=float(args.timeout),
        optimizer_state_dtype=args.optimizer_state_dtype,
        param_remainders=args.param_remainders,
        param_rounding=args.param_rounding,
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the report; the verdict's exit status (bad input exits 2 through ``parser``)."""
    try:
        factory = load_target(args.target, DEFAULT_FUNCTION, RETURNS)
        model, batch_fn, optimizer_factory, loss_fn = unpack_target(factory(), getattr(factory, "__name__", args.target))
        report = check(model, batch_fn, optimizer_factory, _options(args), target=args.target, loss_fn=loss_fn)
    except (TargetError, ParityError) as error:
        parser.error(str(error))
    except (RankError, RankTimeout) as error:
        if args.traceback:
            raise
        sys.stderr.write(f"fxzero parity: FAIL: the fxzero run did not finish: {error}\n")
        return 1
    except Exception as error:  # noqa: BLE001 - in the model or TARGET, before any rank: one message
        if args.traceback:
            raise
        from ..cli import one_message

        sys.stderr.write(one_message("fxzero parity", error))
        return 2
    sys.stdout.write(str(report))
    return report.exit_code
