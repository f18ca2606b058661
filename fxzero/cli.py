"""``fxzero explain TARGET`` (or ``python -m fxzero explain``): :func:`fxzero.explain` from the command line.

Why: the first question about a distributed backend ("how many buckets, how much
padding, where does each gradient reduction fire, which graph touched which bucket")
should take one command, not a script. TARGET names a function that builds what to explain::

    fxzero explain examples/explain_mlp.py                 # its fxzero_explain(): the summary
    fxzero explain examples/explain_mlp.py --full          # and every compiled graph's code
    fxzero explain examples/explain_mlp.py:build --world-size 8 --json layout.json --timeline timeline.png

``path/to/file.py[:function]`` or ``package.module[:function]``; the function (default
``fxzero_explain``) takes no arguments and returns ``(model, example_inputs)``,
``(model, example_inputs, optimizer)`` or ``(model, example_inputs, optimizer, loss_fn)``
(optimizer may be None). ``example_inputs`` is a tuple of positional arguments (a lone
tensor is one argument) or a dict of keyword arguments (``{"input_ids": ids}``). The
backward starts from the model's output: a tensor, a ``ModelOutput``'s loss (else its
logits), a dict's or a tuple's first tensor, or ``loss_fn(output)``. Without an optimizer the command makes a
``DistributedOptimizer`` (SGD; the wrapped optimizer does not change the layout) with
``--bucket-size`` / ``--pad-for-high-busbw`` / ``--overlap-param-gather`` (without it the
step finishes every all-gather and the forward graphs carry no wait).

It prints the summary (bucket table, each graph's schedule, the collectives of a step);
``--full`` adds the graphs' code, ``--json FILE`` writes the facts as JSON and
``--timeline FILE.png`` draws the schedule on a step's estimated time (matplotlib). Graphs are compiled with
Inductor, as training compiles them (``--inner-compiler eager``: faster, other graphs).

It runs in one process, without a process group (world size 1). ``--world-size N``
lays buckets out as N ranks would, on torch's ``"fake"`` process group (no
communication, nothing runs on other ranks), so padding and shard sizes are N-rank
ones; the collectives and default bucket size are then NCCL's (on gloo fxzero reduces
with alltoall and gathers with a broadcast per rank). Nothing trains: grads are zeroed
and params untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from .config import Config
from .help_text import plain_text
from .version import __version__
from .parity_check import cli as parity_cli
from .target import TargetError, load_target
from .explainer.data import write_json
from .explainer.timeline import PlottingMissing

__all__ = ["main"]

_DEFAULT_FUNCTION = "fxzero_explain"
_RETURNS = "(model, example_inputs[, optimizer[, loss_fn]])"


@dataclasses.dataclass(frozen=True)
class Explainee:
    """What TARGET's function returned, in the parts :func:`fxzero.explain` takes."""

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    optimizer: Optional[Any]
    loss_fn: Optional[Callable[[Any], Any]]


def unpack(result: Any, name: str) -> Explainee:
    """Split a factory's return value, naming what is wrong with it."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3, 4):
        raise TargetError(f"{name}() must return {_RETURNS}, got {type(result).__name__}")
    model, inputs = result[0], result[1]
    optimizer = result[2] if len(result) >= 3 else None
    loss_fn = result[3] if len(result) == 4 else None
    if loss_fn is not None and not callable(loss_fn):
        raise TargetError(f"{name}() returned loss_fn of type {type(loss_fn).__name__}; expected loss_fn(output)")
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"{name}() returned a model of type {type(model).__name__}; expected a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, dict):  # keyword arguments: input_ids=..., labels=... of a Hugging Face model
        return Explainee(model, (), dict(inputs), optimizer, loss_fn)
    if not isinstance(inputs, (tuple, list)):
        raise TargetError(
            f"{name}() returned example_inputs of type {type(inputs).__name__}; expected a tuple of arguments, "
            "a dict of keyword arguments or a tensor"
        )
    return Explainee(model, tuple(inputs), {}, optimizer, loss_fn)


def _bucket_size(text: str) -> Union[int, str]:
    if text in ("auto", "none"):
        return text
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bucket-size takes a number of elements, 'auto' or 'none', got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--bucket-size must be > 0 elements, got {value}")
    return value


def _whole(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text) if text.isdigit() else 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= 1, got {text!r}")
        return value

    return parse


_world_size = _whole("--world-size")


def _tolerance(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number >= 0, got {text!r}")
        return value

    return parse


_DESCRIPTION = """fxzero: ZeRO-1 distributed-optimizer training as a torch.compile backend.
The same commands run as python -m fxzero COMMAND."""
_EPILOG = "Run fxzero COMMAND --help for a command's arguments and examples."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxzero", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"fxzero {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _explain_parser(commands)
    _parity_parser(commands)
    for command in commands.choices.values():  # their descriptions are module docstrings (reST)
        command.description = plain_text(command.description)
    return parser


def _explain_parser(commands: Any) -> None:
    explain = commands.add_parser(
        "explain",
        help="compile a model without training; print its buckets, schedule and collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument("target", metavar="TARGET", help="file.py[:function] or package.module[:function]")
    explain.add_argument(
        "--bucket-size",
        type=_bucket_size,
        default=None,
        help="elements per bucket ('auto': Megatron's default; 'none': one bucket)",
    )
    explain.add_argument("--pad-for-high-busbw", action="store_true", help="pad shards to multiples of 2^16 elements")
    explain.add_argument(
        "--overlap-param-gather", action="store_true", help="Config.overlap_param_gather: the forward graphs wait for gathers"
    )
    explain.add_argument(
        "--world-size", type=_world_size, default=None, help="lay buckets out for N ranks (fake process group)"
    )
    explain.add_argument(
        "--inner-compiler",
        choices=("inductor", "eager"),
        default="inductor",
        help="how graphs are compiled (default inductor, as training does; eager is faster)",
    )
    explain.add_argument("--full", action="store_true", help="also print every compiled graph's code, fxzero's nodes marked")
    explain.add_argument("--json", metavar="FILE", default=None, help="write buckets, graphs, schedule and collectives as JSON")
    explain.add_argument(
        "--timeline", metavar="FILE.png", default=None, help="draw when each bucket launches and waits, on a step's estimated time (matplotlib)"
    )
    explain.add_argument(
        "--dump-dir", default=None, help="also write every graph before/after each pass, diffs and summary.json here"
    )
    _size_flags(explain)
    _traceback_flag(explain)


def _size_flags(explain: argparse.ArgumentParser) -> None:
    size = explain.add_argument_group("sizing a run (--size: nothing compiles; the model may be on the meta device)")
    size.add_argument("--size", action="store_true",
                      help="print the bytes per rank (params, grads, optimizer state, masters, scratch) and per collective "
                           "for --world-size data-parallel ranks, instead of compiling")  # fmt: skip
    size.add_argument("--tp", type=_whole("--tp"), default=1, help="tensor-parallel ranks per data-parallel rank (default 1)")
    size.add_argument("--instances", type=_whole("--instances"), default=1,
                      help="optimizer instances the data-parallel ranks form (default 1)")  # fmt: skip
    size.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "fp8"), default="fp32", help="Config.optimizer_state_dtype")
    size.add_argument("--param-remainders", action="store_true", help="Config.param_remainders (bf16 params)")
    size.add_argument("--states-per-element", type=int, default=2, help="the wrapped optimizer's states (AdamW 2, default)")
    size.add_argument("--bandwidth", type=_tolerance("--bandwidth"), default=None, metavar="GB/s",
                      help="per-link bandwidth: adds each collective's time from Inductor's NCCL model")  # fmt: skip
    size.add_argument("--transport", choices=("nccl", "gloo"), default="nccl",
                      help="the default bucket size's, and gloo's exchange scratch (default nccl)")  # fmt: skip
    size.add_argument("--batch", type=_whole("--batch"), default=None, metavar="N",
                      help="per-rank batch: the example inputs' first dim becomes N for the activations")  # fmt: skip


def _size(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    from .explainer.activations import estimate_activations
    from .explainer.sizing import size_run

    factory = load_target(args.target, _DEFAULT_FUNCTION, _RETURNS)
    result = factory()
    target = None if isinstance(result, torch.nn.Module) else unpack(result, getattr(factory, "__name__", args.target))
    model = result if target is None else target.model
    config = Config(bucket_size="auto" if args.bucket_size is None else None if args.bucket_size == "none" else args.bucket_size,
                    pad_for_high_busbw=args.pad_for_high_busbw, optimizer_state_dtype=args.optimizer_state_dtype,
                    param_remainders=args.param_remainders)  # fmt: skip
    activations = None
    if target is not None and (target.inputs or target.kwargs):  # a batch to run: its activations too
        inputs, kwargs = (_rebatched(v, args.batch) for v in (target.inputs, target.kwargs))
        activations = estimate_activations(model, inputs, kwargs, target.loss_fn)
    try:
        report = size_run(model, args.world_size or 1, tp=args.tp, instances=args.instances, config=config,
                          states_per_element=args.states_per_element, bandwidth_gbps=args.bandwidth,
                          transport=args.transport, activations=activations)  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    if args.json is not None:
        write_json({"schema": SIZE_SCHEMA, "size": report.as_data()}, args.json)
    return report.text()


def _rebatched(value: Any, batch: Optional[int]) -> Any:
    """``value`` with each tensor's first dim made ``batch`` (a meta tensor: only its shape is read)."""
    if batch is None:
        return value
    if isinstance(value, torch.Tensor):
        shape = (batch, *value.shape[1:]) if value.dim() else value.shape
        return torch.empty(shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {key: _rebatched(item, batch) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rebatched(item, batch) for item in value)
    return value


SIZE_SCHEMA = 1
"""``--size --json``: ``{"schema": 1, "size": {model, params, dp, tp, instances, buffer_elements, buckets,
param_bytes, grad_bytes, state_bytes, master_bytes, scratch_bytes, exchange_bytes, transport, total_bytes,
bytes_per_param, activations: null or {inputs, saved_bytes, peak_bytes}, peak_bytes (null without activations),
collectives: [{op, count, bytes, ring_bytes_per_rank, ms}]}}``."""


def _traceback_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--traceback", action="store_true", help="on an error, print the whole traceback instead of one message"
    )


MESSAGE_LINES = 6
"""Lines of an error's message printed: Dynamo's errors append pages of context."""


def one_message(command: str, error: BaseException) -> str:
    """An error as a few lines naming what failed and how to see where: tracebacks of a
    compile run to hundreds of lines, and under a process group torch prefixes each with
    ``[rank0]:``, burying the one line that says what is wrong."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()][:MESSAGE_LINES]
    text = "\n  ".join(lines) or "(no message)"
    return f"{command}: error: {type(error).__name__}: {text}\n(rerun with --traceback to see where it was raised)\n"


def _parity_parser(commands: Any) -> None:
    parity = commands.add_parser(
        "parity",
        help="train a model with fxzero on N ranks and eagerly in one process; compare",
        description=parity_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parity.add_argument("target", metavar="TARGET", help="file.py[:function] or package.module[:function]")
    parity.add_argument("--world-size", type=_world_size, default=2, help="gloo ranks on this machine (default 2)")
    parity.add_argument("--steps", type=_whole("--steps"), default=5, help="optimizer steps compared (default 5)")
    parity.add_argument("--inner-compiler", choices=("inductor", "eager"), default="inductor", help="default inductor")
    parity.add_argument("--bucket-size", type=_bucket_size, default="auto", help="elements per bucket (default auto)")
    parity.add_argument("--mxfp8", action="store_true", help="gather params as MXFP8 (Config.mxfp8_param_gather)")
    parity.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "fp8"), default="fp32",
                        help="Config.optimizer_state_dtype on the ranks: the report gives its drift against fp32")  # fmt: skip
    parity.add_argument("--param-remainders", action="store_true", help="Config.param_remainders on the ranks (bf16 params)")
    parity.add_argument("--param-rounding", choices=("auto", "nearest_even", "half_away", "stochastic"), default="auto",
                        help="Config.param_rounding on the ranks")  # fmt: skip
    for flag in ("--atol-loss", "--atol-param"):
        parity.add_argument(flag, type=_tolerance(flag), default=None, help="default: 10x the noise floor")
    parity.add_argument("--timeout", type=_whole("--timeout"), default=600, help="seconds per rank run (default 600)")
    _traceback_flag(parity)


def _optimizer(model: torch.nn.Module, args: argparse.Namespace) -> Any:
    from .distributed_optimizer import DistributedOptimizer

    size = "auto" if args.bucket_size is None else None if args.bucket_size == "none" else args.bucket_size
    config = Config(bucket_size=size, pad_for_high_busbw=args.pad_for_high_busbw, overlap_param_gather=args.overlap_param_gather)
    return DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.0, config=config, module=model)


@contextlib.contextmanager
def _fake_group(world_size: Optional[int], parser: argparse.ArgumentParser) -> Iterator[None]:
    """A communication-free process group of ``world_size`` ranks (this process is rank 0)."""
    import torch.distributed as dist

    if world_size is None or world_size == 1:
        yield
        return
    if dist.is_initialized():
        parser.error("--world-size: a process group is already initialized; run without --world-size")
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    from .explainer import explain

    with _fake_group(args.world_size, parser):
        factory = load_target(args.target, _DEFAULT_FUNCTION, _RETURNS)
        target = unpack(factory(), getattr(factory, "__name__", args.target))
        model, optimizer = target.model, target.optimizer
        if optimizer is None:
            optimizer = _optimizer(model, args)
        elif args.bucket_size is not None or args.pad_for_high_busbw or args.overlap_param_gather:
            parser.error(
                "--bucket-size/--pad-for-high-busbw/--overlap-param-gather: TARGET returned its own optimizer, "
                "whose Config decides the layout and the waits"
            )
        return explain(
            model,
            *target.inputs,
            optimizer=optimizer,
            example_kwargs=target.kwargs,
            loss_fn=target.loss_fn,
            inner_compiler=args.inner_compiler,
            full=args.full,
            json_file=args.json,
            timeline_file=args.timeline,
            dump_dir=args.dump_dir,
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "parity":
        return parity_cli.run(args, parser)
    try:
        text = _size(args, parser) if args.size else _explain(args, parser)
    except (TargetError, PlottingMissing) as error:
        parser.error(str(error))
    except Exception as error:  # noqa: BLE001 - one message, not a traceback per rank
        if args.traceback:
            raise
        sys.stderr.write(one_message("fxzero explain", error))
        return 1
    sys.stdout.write(text)
    for path, what in ((args.json, "JSON"), (args.timeline, "timeline")):
        if path is not None:
            sys.stdout.write(f"\n{what} written to {path}\n")
    if args.dump_dir is not None:
        sys.stdout.write(f"\ngraphs before/after each fxzero pass, diffs and summary.json written to {args.dump_dir}\n")
    return 0

