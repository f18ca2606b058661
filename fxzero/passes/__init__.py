"""fxzero's graph passes and the driver that runs them.

A pass is a function ``name_pass(gm, example_inputs, *, ...) -> gm``; one with nothing
to do returns ``gm`` unchanged. The lists below are fixed: configuration picks values
for the passes, not which code runs. With ``logging.DEBUG`` on ``fxzero.passes``
(``TORCH_LOGS="+fxzero"``) each pass logs its time and the change in node count.
``observe(pass_name, gm)``, when given, sees the graph after each pass: the dump
directory and ``TORCH_TRACE`` record every intermediate graph through it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from .bucket_reduce_scatter import bucket_reduce_scatter_pass, release_launch_outputs_pass
from .param_gather_wait import param_gather_wait_pass

__all__ = ["run_backward_passes", "run_forward_passes", "run_joint_passes"]

log = logging.getLogger(__name__)

Pass = Callable[..., fx.GraphModule]
Observer = Callable[[str, fx.GraphModule], None]

JOINT_PASSES: tuple[Pass, ...] = (bucket_reduce_scatter_pass,)
"""On AOTAutograd's joint graph, before partitioning."""
FORWARD_PASSES: tuple[Pass, ...] = (param_gather_wait_pass,)
"""On the partitioned forward (and inference) graph."""
BACKWARD_PASSES: tuple[Pass, ...] = (release_launch_outputs_pass,)
"""On the partitioned backward graph."""


def _run(
    passes: Sequence[Pass], gm: fx.GraphModule, example_inputs: Sequence[Any], observe: Optional[Observer], **kwargs: Any
) -> fx.GraphModule:
    for graph_pass in passes:
        nodes_before, start = len(gm.graph.nodes), time.perf_counter()
        gm = graph_pass(gm, example_inputs, **kwargs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %.2f ms, nodes %d -> %d",
                graph_pass.__name__,
                1e3 * (time.perf_counter() - start),
                nodes_before,
                len(gm.graph.nodes),
            )
        if observe is not None:
            observe(graph_pass.__name__, gm)
    return gm


def run_joint_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, observe: Optional[Observer] = None, **kwargs: Any
) -> fx.GraphModule:
    return _run(JOINT_PASSES, gm, example_inputs, observe, **kwargs)


def run_forward_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, observe: Optional[Observer] = None, **kwargs: Any
) -> fx.GraphModule:
    return _run(FORWARD_PASSES, gm, example_inputs, observe, **kwargs)


def run_backward_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, observe: Optional[Observer] = None, **kwargs: Any
) -> fx.GraphModule:
    return _run(BACKWARD_PASSES, gm, example_inputs, observe, **kwargs)
