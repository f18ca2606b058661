"""``python -m fxzero parity TARGET``: :func:`fxzero.parity` from the command line.

Why: "does fxzero train my model exactly as plain PyTorch does?" should take one
command. TARGET names a function (default ``fxzero_parity``) that takes no arguments
and returns ``(model, batch_fn)`` or ``(model, batch_fn, optimizer_factory)``::

    python -m fxzero parity examples/parity_gpt.py --world-size 2
    python -m fxzero parity mypkg.models:parity_target --steps 10 --inner-compiler eager

``model(*batch)`` returns the scalar training loss (a mean over the batch);
``batch_fn(step)`` returns the global batch of ``step`` (a tuple of tensors, split over
the ranks along dim 0); ``optimizer_factory(params)`` builds the torch.optim optimizer
to wrap (default AdamW, lr 1e-3).

The function runs once here (the model and the reference) and once on each rank, which
then loads the initial state made here. fxzero runs on N gloo ranks on this machine's
CPU (no NCCL/GPU path yet). Exit status: 0 PASS, 1 FAIL (also when fxzero raised on a
rank), 2 bad arguments or TARGET, 3 NOT COMPARABLE (BatchNorm or dropout in train mode,
or a loss that is not a mean over the batch: no global-batch reference can match).
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
        model, batch_fn, optimizer_factory = unpack_target(factory(), getattr(factory, "__name__", args.target))
        report = check(model, batch_fn, optimizer_factory, _options(args), target=args.target)
    except (TargetError, ParityError) as error:
        parser.error(str(error))
    except (RankError, RankTimeout) as error:
        sys.stderr.write(f"fxzero parity: FAIL: the fxzero run did not finish: {error}\n")
        return 1
    sys.stdout.write(str(report))
    return report.exit_code
