"""``fxzero.explain``: what fxzero will do to a model, before any training.

Why: fxzero's work is invisible in a training loop. Buckets are laid out once, and the
graph passes insert ``fxzero::wait_params`` / ``fxzero::grads_ready`` calls into
compiled graphs that no user writes. Tuning ``bucket_size``, spotting a bucket whose
padding wastes bandwidth, or checking that a gradient reduction launches early in
backward (overlap) or that a bucket spans a graph break all need that hidden state shown.

:func:`explain` compiles the model once (:mod:`~fxzero.explainer.recording`) and reports
what it found in up to four forms that read the same facts
(:class:`~fxzero.explainer.explained.Explained`): a summary (bucket table, each graph's
schedule, the collectives of a step: :mod:`~fxzero.explainer.summary`), the full form
adding every graph's marked code (:mod:`~fxzero.explainer.graphs`), a JSON file
(:mod:`~fxzero.explainer.data`) and a timeline picture (:mod:`~fxzero.explainer.timeline`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch

from .data import as_data, write_json
from .explained import Explained
from .graphs import render_graphs
from .node_costs import measure_speed
from .recording import param_names, record
from .summary import render_summary

__all__ = ["explain"]

PathLike = Union[str, "os.PathLike[str]"]


def _check_arguments(model: Any, optimizer: Any, inner_compiler: str) -> None:
    from ..distributed_optimizer import DistributedOptimizer

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxzero.explain: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"fxzero.explain: optimizer must be a fxzero.DistributedOptimizer, got {type(optimizer).__name__}"
        )
    if inner_compiler not in ("eager", "inductor"):
        raise ValueError(f"fxzero.explain: inner_compiler must be 'eager' or 'inductor', got {inner_compiler!r}")


def explain(
    model: torch.nn.Module,
    *example_inputs: Any,
    optimizer: Any,
    inner_compiler: str = "inductor",
    full: bool = False,
    json_file: Union[PathLike, None] = None,
    timeline_file: Union[PathLike, None] = None,
    dump_dir: Union[PathLike, None] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> str:
    """Compile ``model``, run one forward+backward under ``optimizer.no_sync()`` (no
    collective), and return the summary: the bucket table, where each graph launches each
    bucket's gradient reduction and waits for each gather, and the collectives of a step.
    The optimizer is left as found (grads, readiness ledger; params untouched); one holding
    gradients (between a backward and ``step()``) is refused, naming them.

    ``full=True`` appends every compiled graph's code after fxzero's passes, its nodes
    marked. ``json_file`` writes the same facts as JSON; ``timeline_file`` draws them as a
    PNG (needs matplotlib). ``inner_compiler`` defaults to ``"inductor"``, what a training
    run compiles with (its decompositions and partitioner make other graphs than
    ``"eager"``, which compiles several times faster). ``dump_dir`` also writes the graphs
    before and after each pass there (as the backend's ``dump_dir`` option does).

    ``example_kwargs`` are keyword arguments of the forward (``input_ids=...`` of a Hugging
    Face model). The backward starts from the sum of what the forward returned: a tensor,
    a ``ModelOutput``'s ``loss`` (else its ``logits``), a dict's ``"loss"`` / ``"logits"`` /
    first tensor, a tuple's first tensor; ``loss_fn(output)`` replaces that choice.

    Args:
        model: the module to compile.
        *example_inputs: positional arguments of the forward.
        optimizer: the :class:`fxzero.DistributedOptimizer` over ``model``'s params.
        inner_compiler: ``"inductor"`` or ``"eager"``.
        full: append every compiled graph's code.
        json_file: write the facts as JSON there.
        timeline_file: draw the timeline PNG there (estimated times: see docs/tools.md).
        dump_dir: write each graph before and after each pass there.
        example_kwargs: keyword arguments of the forward.
        loss_fn: turns the forward's output into the tensor to backpropagate.

    Returns:
        The summary text (with ``full``, every graph's code after it).

    Raises:
        TypeError: ``model`` is not a module, or ``optimizer`` not a DistributedOptimizer.
        ValueError: ``inner_compiler`` is neither ``"eager"`` nor ``"inductor"``.
        RuntimeError: the optimizer holds gradients not yet stepped.
        fxzero.model_output.OutputError: the output holds no tensor (nor does ``loss_fn``'s).
        fxzero.explainer.timeline.PlottingMissing: ``timeline_file`` without matplotlib.

    Example::

        report = fxzero.explain(model, x, optimizer=opt, inner_compiler="eager")
        report = fxzero.explain(hf_model, optimizer=opt, example_kwargs={"input_ids": ids})
    """
    _check_arguments(model, optimizer, inner_compiler)
    if timeline_file is not None:  # before the compile: a missing matplotlib should not cost one
        from .timeline import matplotlib_parts

        matplotlib_parts()
    options: dict[str, Any] = {"inner_compiler": inner_compiler}
    if dump_dir is not None:
        options["dump_dir"] = dump_dir
    graphs = record(model, example_inputs, optimizer, options, example_kwargs, loss_fn)
    speed = None
    if json_file is not None or timeline_file is not None:  # estimated times: this machine's speeds
        speed = measure_speed(next((p.device for p in model.parameters()), torch.device("cpu")))
    explained = Explained(optimizer, graphs, param_names(model), type(model).__name__, inner_compiler, speed)
    if json_file is not None or timeline_file is not None:
        data = as_data(explained)
        if json_file is not None:
            write_json(data, json_file)
        if timeline_file is not None:
            from .timeline import draw_timeline  # matplotlib only when a picture is asked for

            draw_timeline(data, timeline_file)
    text = render_summary(explained)
    return text + "\n" + render_graphs(explained) if full else text
