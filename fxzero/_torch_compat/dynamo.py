"""Dynamo's graphs and frames, and torch's logging and structured traces.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, Optional

import torch.fx as fx

__all__ = [
    "compile_id",
    "dynamo_input_names",
    "dynamo_runs_eagerly_at_top_level",
    "mark_static",
    "recompile_limit",
    "register_torch_log",
    "trace_artifact",
    "tracing",
    "undisabled",
]


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def dynamo_input_names(gm: fx.GraphModule) -> list[str]:
    """Each Dynamo graph input's module path (``blocks.0.fc.weight``) where its source is
    a module attribute, else the placeholder's name, so dumps name params as users do.
    Reads ``node.meta["grapharg"].source.name`` (Dynamo's ``L['self']._modules['fc']...``
    spelling). If it changes: placeholder names (``l_self_modules_fc_parameters_weight_``)."""
    names = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
        parts = _SOURCE_PART.findall(source if isinstance(source, str) else "")
        names.append(".".join(parts) if parts else node.name)
    return names


def dynamo_runs_eagerly_at_top_level(fn: Callable[..., Any]) -> None:
    """Dynamo runs ``fn``'s frames as they are when it meets them at the top level (called
    by eager code inside a compiled region: a module's forward pre-hook after a graph break)
    and still inlines ``fn`` where it traces a caller (the same hook, traced into the graph of
    the module it runs for). ``torch._dynamo.eval_frame.skip_code`` (what
    ``torch._dynamo.skip`` applies, without the ``_torchdynamo_disable`` mark that would make
    Dynamo break the graph at every call). If it goes: do nothing (such a frame compiles into
    a graph of its own, once per guard set, and runs as that graph: slower, the same effect).
    Called through its C half (``torch._C._dynamo.eval_frame``), which ``skip_code`` calls:
    importing ``torch._dynamo`` for it cost every ``import fxzero`` ~1.4 s on this machine,
    also in processes that never compile (the eager ranks of a torchrun job)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        from torch._dynamo.eval_frame import skip_code

        skip_code(fn.__code__)
        return
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def undisabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the ``torch._dynamo.disable`` wrapper AOTAutograd's backend puts on
    the function it returns. Dynamo disables whatever a backend returns, so a backend that
    wraps that function in its own Python would otherwise pay two disable layers (four
    ``set_eval_frame`` calls and more) on every graph call. ``torch._dynamo.eval_frame.innermost_fn``;
    if gone: ``fn`` itself (one layer more per call, the same effect)."""
    from torch._dynamo.eval_frame import innermost_fn

    return innermost_fn(fn)


def compile_id() -> Optional[Any]:
    """The Dynamo compile id of the compile in progress (``[0/0]``), for dump titles and
    trace artifacts. ``torch._guards.CompileContext.current_compile_id()``; if gone: None."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()

def register_torch_log(name: str, module: str) -> None:
    """Make ``TORCH_LOGS=name`` one of torch's registered logs (``set_logs`` and torch's
    re-inits configure it like torch's own). ``torch._logging._internal``; if gone: torch
    still resolves ``TORCH_LOGS`` entries that are module names."""
    from torch._logging._internal import log_registry, register_log

    if not log_registry.is_log(name):
        register_log(name, module)


def tracing() -> bool:
    """Whether a ``TORCH_TRACE`` handler is installed (only then are artifacts rendered).
    ``torch._logging._internal.trace_log``."""
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def trace_artifact(name: str, encoding: str, payload: Any, compile_id: Optional[Any]) -> None:
    """Write a structured-trace artifact (tlparse shows it next to Dynamo's and Inductor's
    graphs of the same compile). ``torch._logging.trace_structured``."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: payload,
        compile_id=compile_id,
    )


@contextlib.contextmanager
def recompile_limit(limit: int) -> Iterator[None]:
    """A context in which Dynamo compiles up to ``limit`` graphs of one function (one per kinds of
    input it guards on) before refusing. ``torch._dynamo.config.recompile_limit`` (every supported
    torch has this name), set and restored directly: ``torch._dynamo.config.patch`` cost 20-40 us per
    call here, as much as the compiled call's own guards, on a path that runs once per run and step."""
    import torch._dynamo

    config = torch._dynamo.config
    previous = config.recompile_limit
    config.recompile_limit = limit
    try:
        yield
    finally:
        config.recompile_limit = previous


def mark_static(tensor: Any, dim: int) -> Any:
    """``tensor``, with dimension ``dim`` a constant in the graphs Dynamo compiles for it, even under
    ``dynamic=True`` (``torch._dynamo.mark_static``; every supported torch has it). Why: a loop
    whose inner length is a constant gets a fixed trip count and no tail."""
    import torch._dynamo

    torch._dynamo.mark_static(tensor, dim)
    return tensor
