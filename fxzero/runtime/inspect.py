"""``fxzero.explain``: what fxzero will do to a model, as text, before any training.

Why: fxzero's work is invisible in a training loop. Buckets are laid out once, and the
graph passes insert ``fxzero::wait_params`` / ``fxzero::grads_ready`` calls into
compiled graphs that no user writes. Tuning ``bucket_size``, spotting a bucket whose
padding wastes bandwidth, or checking that a reduce-scatter launches early in backward
(overlap) or that a bucket spans a graph break all need that hidden state shown.

:func:`explain` compiles the model, runs one forward+backward under
:meth:`~fxzero.DistributedOptimizer.no_sync` (no collective is launched), records the
graphs *after* fxzero's passes by wrapping ``fxzero.backend.run_forward_passes`` /
``run_backward_passes`` (looked up at call time by the backend), then zeroes the grads
so training state is unchanged. It returns a bucket table, every graph's code with
fxzero's inserted nodes marked, and a per-bucket schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from tabulate import tabulate

from ..passes.matchers import is_grads_ready
from . import ops as _ops

__all__ = ["explain"]

_WAIT = torch.ops.fxzero.wait_params.default
_ALIGN = 2**16


@dataclasses.dataclass(frozen=True)
class _Inserted:
    """One fxzero node in a recorded graph."""

    name: str
    index: int
    handle: int
    launch: bool
    """True for ``grads_ready`` (reduce-scatter launch), False for ``wait_params``."""


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """A snapshot of one AOT graph after fxzero's passes (taken before inner compile)."""

    kind: str
    code: str
    placeholders: tuple[str, ...]
    total: int
    inserted: tuple[_Inserted, ...]


@dataclasses.dataclass
class _Graph:
    """One Dynamo graph: its managed params (by forward position) and AOT graphs."""

    managed: Sequence[Any]
    """The backend's ``ManagedParam`` list; kept alive so its ``id`` stays unique."""
    parts: dict[str, _Recorded] = dataclasses.field(default_factory=dict)


def _snapshot(kind: str, gm: fx.GraphModule) -> _Recorded:
    nodes = list(gm.graph.nodes)
    inserted = tuple(
        _Inserted(n.name, i, int(n.args[-1]), is_grads_ready(n))
        for i, n in enumerate(nodes)
        if is_grads_ready(n) or (n.op == "call_function" and n.target is _WAIT)
    )
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    return _Recorded(kind, gm.code, placeholders, len(nodes), inserted)


@contextlib.contextmanager
def _recording(graphs: list[_Graph]) -> Iterator[None]:
    """Wrap the backend's pass drivers to snapshot each graph after the passes."""
    from .. import backend as _backend  # lazily: importing fxzero must not import Dynamo

    originals = _backend.run_forward_passes, _backend.run_backward_passes
    by_managed: dict[int, _Graph] = {}

    def wrap(kind: str, run: Any) -> Any:
        def recorded(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> fx.GraphModule:
            gm = run(gm, example_inputs, **kwargs)
            managed = kwargs.get("managed", ())
            graph = by_managed.get(id(managed))
            if graph is None:
                graph = by_managed[id(managed)] = _Graph(managed)
                graphs.append(graph)
            graph.parts[kind] = _snapshot(kind, gm)
            return gm

        return recorded

    _backend.run_forward_passes = wrap("forward", originals[0])
    _backend.run_backward_passes = wrap("backward", originals[1])
    try:
        yield
    finally:
        _backend.run_forward_passes, _backend.run_backward_passes = originals


def _run_once(model: torch.nn.Module, inputs: Sequence[Any], optimizer: Any, inner_compiler: str) -> list[_Graph]:
    graphs: list[_Graph] = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": inner_compiler})
    with _recording(graphs), optimizer.no_sync():
        out = compiled(*inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
    optimizer.zero_grad()
    return graphs


# ---- the bucket table ---------------------------------------------------------------
def _param_names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _bucket_row(bucket: Any, names: dict[int, str], dp: int) -> list[Any]:
    padded = bucket.param_data.numel()
    shard = padded // dp
    return [
        bucket.index,
        len(bucket.params),
        names.get(id(bucket.params[0]), "?"),
        names.get(id(bucket.params[-1]), "?"),
        bucket.numel_unpadded,
        padded,
        f"{100 * (padded - bucket.numel_unpadded) / padded:.1f}" if padded else "0.0",
        shard,
        "yes" if shard % _ALIGN == 0 else "no",
        padded * bucket.grad_data.element_size(),
        padded * bucket.param_data.element_size(),
        f"{str(bucket.param_data.dtype).removeprefix('torch.')}/{str(bucket.grad_data.dtype).removeprefix('torch.')}",
    ]


_HEADERS = (
    "bucket", "params", "first param", "last param", "numel", "padded", "pad %",
    "shard numel", "shard % 2^16 == 0", "RS bytes", "AG bytes", "dtype (param/grad)",
)  # fmt: skip


def _bucket_table(optimizer: Any, names: dict[int, str]) -> str:
    rows = [_bucket_row(b, names, optimizer.dp.size) for b in optimizer.buckets]
    return tabulate(rows, headers=_HEADERS, tablefmt="github")


# ---- the graphs ---------------------------------------------------------------------
def _bucket_of(handle: int, optimizer: Any) -> Optional[int]:
    """The bucket behind an op handle, if it belongs to ``optimizer``."""
    entry = _ops._graph_buckets[handle]
    mine = entry.sync is optimizer.grad_sync or entry.sync is optimizer.param_sync
    return entry.bucket if mine else None


def _param_mapping(graph: _Graph, optimizer: Any, names: dict[int, str]) -> list[str]:
    forward = graph.parts.get("forward")
    if forward is None:
        return []
    lines = []
    for m in sorted(graph.managed, key=lambda m: m.position):
        param = optimizer.params[m.slot]
        if getattr(param, "_fxzero_slot", None) == m.slot and m.position < len(forward.placeholders):
            lines.append(f"# {forward.placeholders[m.position]} = {names.get(id(param), '?')} (bucket {m.bucket})")
    return lines


def _marked_code(part: _Recorded, optimizer: Any) -> list[str]:
    marks: dict[str, str] = {}
    for node in part.inserted:
        bucket = _bucket_of(node.handle, optimizer)
        what = f"bucket {bucket} reduce-scatter launch" if node.launch else f"wait for bucket {bucket} all-gather"
        marks[f"{node.name} = torch.ops.fxzero"] = f"  # <- fxzero: {what}"
    out = []
    for line in part.code.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        out.append(line + next((m for key, m in marks.items() if stripped.startswith(key)), ""))
    return out


def _graph_text(number: int, graph: _Graph, optimizer: Any, names: dict[int, str]) -> str:
    lines = [f"== graph {number} =="] + _param_mapping(graph, optimizer, names)
    for kind in ("forward", "backward"):
        part = graph.parts.get(kind)
        if part is not None:
            lines += [f"-- graph {number} {kind} ({part.total} nodes) --"] + _marked_code(part, optimizer)
    return "\n".join(lines)


# ---- the schedule -------------------------------------------------------------------
def _sites(graphs: list[_Graph], optimizer: Any, bucket: int, launch: bool) -> list[str]:
    sites = []
    for number, graph in enumerate(graphs):
        for kind, part in graph.parts.items():
            for node in part.inserted:
                if node.launch == launch and _bucket_of(node.handle, optimizer) == bucket:
                    pct = round(100 * node.index / part.total)
                    sites.append(f"graph {number} {kind} at node {node.index}/{part.total} ({pct}%)")
    return sites


def _schedule(graphs: list[_Graph], optimizer: Any) -> str:
    lines = []
    for bucket in optimizer.buckets:
        launches = _sites(graphs, optimizer, bucket.index, launch=True)
        waits = _sites(graphs, optimizer, bucket.index, launch=False)
        rs = f"reduce-scatter launches in {', '.join(launches)}" if launches else "reduce-scatter launched eagerly"
        ag = f"all-gather waited in {', '.join(waits)}" if waits else "all-gather waited eagerly"
        lines.append(f"bucket {bucket.index}: {rs}; {ag}")
    return "\n".join(lines + [_spanning(graphs, optimizer)])


def _spanning(graphs: list[_Graph], optimizer: Any) -> str:
    """Buckets whose params are read by more than one compiled graph (by forward waits)."""
    seen: dict[int, set[int]] = {}
    for number, graph in enumerate(graphs):
        for part in graph.parts.values():
            for node in part.inserted:
                bucket = _bucket_of(node.handle, optimizer)
                if bucket is not None:
                    seen.setdefault(bucket, set()).add(number)
    spanning = [f"{b} (graphs {', '.join(map(str, sorted(g)))})" for b, g in sorted(seen.items()) if len(g) > 1]
    return f"buckets spanning several graphs: {'; '.join(spanning) if spanning else 'none'}"


def explain(model: torch.nn.Module, *example_inputs: Any, optimizer: Any, inner_compiler: str = "eager") -> str:
    """Compile ``model``, run one forward+backward under ``optimizer.no_sync()`` and
    return the bucket table, every compiled graph after fxzero's passes (inserted nodes
    marked) and the per-bucket schedule. Grads are zeroed afterwards; params untouched."""
    graphs = _run_once(model, example_inputs, optimizer, inner_compiler)
    names = _param_names(model)
    sections = [
        f"fxzero buckets (dp={optimizer.dp.size})\n" + _bucket_table(optimizer, names),
        *(_graph_text(i, g, optimizer, names) for i, g in enumerate(graphs)),
        "schedule\n" + _schedule(graphs, optimizer),
    ]
    return "\n\n".join(sections) + "\n"
