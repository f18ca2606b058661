"""Text of :func:`fxzero.explain`: the bucket table, the marked graphs, the schedule.

Why a separate module: :mod:`fxzero.explainer` decides *what* to record; this
decides how a newcomer reads it. The output must answer, from one screen: how many
buckets and how much padding (table), where each reduce-scatter fires and each gather
is waited (schedule, as % of the graph), and which graph touched which bucket (table's
``graphs`` column, graph headers, spanning line). It is deterministic (no addresses,
timings, op handles or paths), so tests hold it as golden text.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch.distributed
from tabulate import tabulate

from .._torch_compat import group_ranks_by_name
from ..optim.mesh import local_of

if TYPE_CHECKING:
    from ..dump import InsertedNode
    from . import Explained, Graph, Recorded

__all__ = ["render"]

_ALIGN = 2**16
_HEADERS = (
    "bucket", "params", "first param", "last param", "numel", "padded", "pad %",
    "shard numel", "shard % 2^16 == 0", "RS bytes", "AG bytes", "dtype (param/grad)", "graphs",
)  # fmt: skip
_FREES = re.compile(r";  (?:\w+ = )+None$")
_SUBGRAPH_FETCH = re.compile(r"^\s*(\w+) = self\.\1$")
_MODEL_COLLECTIVE = re.compile(r"= torch\.ops\._c10d_functional\.(\w+)\.default\(.*'([^']+)'\)")
"""A functional collective the model's code put in the graph (DTensor's tensor-parallel
redistributions): op name and the group name, its last argument. Its ``wait_tensor`` is no
collective of its own."""


def render(explained: "Explained") -> str:
    sections = [
        _bucket_section(explained),
        *(_graph_text(i, g, explained) for i, g in enumerate(explained.graphs)),
        "schedule (node k/N: the k-th of the graph's N nodes; backward graphs run in reverse graph order)\n"
        + _schedule(explained),
        _collectives(explained),
    ]
    return "\n\n".join(sections) + "\n"


# ---- the bucket table ---------------------------------------------------------------
def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _graphs_of_bucket(explained: "Explained", bucket: int) -> str:
    numbers = [str(i) for i, g in enumerate(explained.graphs) if bucket in explained.buckets_of(g)]
    return ", ".join(numbers) if numbers else "eager only"


def _numel(bucket: Any) -> int:
    """Param elements only (a DTensor param's local ones: what the buffer holds); the param
    start alignment counts as padding."""
    return sum(local_of(p).numel() for p in bucket.params)


def _gather_bytes(bucket: Any, optimizer: Any) -> Any:
    """What the bucket's all-gather moves: its param bytes, or MXFP8 codes + scales."""
    nbytes = optimizer.gather.bytes_per_gather(bucket.index)
    return f"{nbytes} (MXFP8)" if optimizer.config.mxfp8_param_gather else nbytes


def _bucket_row(bucket: Any, explained: "Explained") -> list[Any]:
    names, padded, numel = explained.names, bucket.param_data.numel(), _numel(bucket)
    shard = padded // explained.optimizer.dp.size
    return [
        bucket.index,
        len(bucket.params),
        names.get(id(bucket.params[0]), "?"),
        names.get(id(bucket.params[-1]), "?"),
        numel,
        padded,
        f"{100 * (padded - numel) / padded:.1f}" if padded else "0.0",
        shard,
        "yes" if shard % _ALIGN == 0 else "no",
        padded * bucket.grad_data.element_size(),
        _gather_bytes(bucket, explained.optimizer),
        f"{_dtype(bucket.param_data)}/{_dtype(bucket.grad_data)}",
        _graphs_of_bucket(explained, bucket.index),
    ]


def _bucket_section(explained: "Explained") -> str:
    buckets = explained.optimizer.buckets
    numel = sum(_numel(b) for b in buckets)
    padded = sum(b.param_data.numel() for b in buckets)
    pad = 100 * (padded - numel) / padded if padded else 0.0
    title = (
        f"fxzero buckets (dp={explained.optimizer.dp.size}): {len(buckets)} bucket{'s' * (len(buckets) != 1)}, {numel:,} param elements "
        f"in {padded:,} buffer elements ({pad:.1f}% padding: param starts aligned, buckets to dp shards)"
    )
    rows = [_bucket_row(b, explained) for b in buckets]
    return title + "\n" + tabulate(rows, headers=_HEADERS, tablefmt="github") + _ownership_section(explained.optimizer)


def _ownership_section(optimizer: Any) -> str:
    """Under whole-param ownership: which rank owns (holds the state of, updates) each param."""
    balance = optimizer.balance
    if balance is None:
        return ""
    rows = sorted(
        ([row.owner, row.label, row.bucket, local_of(row.param).numel()] for row in optimizer.param_table.rows),
        key=lambda r: (r[0], r[2]),
    )
    return "\n\n" + balance.describe() + "\n" + tabulate(rows, headers=["rank", "param", "bucket", "elements"], tablefmt="github")


# ---- the graphs ---------------------------------------------------------------------
def _early_handoffs(graph: "Graph", part: "Recorded", explained: "Explained") -> dict[str, int]:
    """Hand-offs of a backward that are not their bucket's last in it (name -> ordinal):
    they only add gradients into ``main_grad``; the last one launches the bucket."""
    by_bucket: dict[Any, list[str]] = {}
    for node in part.inserted:
        if node.launch:
            by_bucket.setdefault(explained.bucket_of(graph, node), []).append(node.name)
    return {name: k for names in by_bucket.values() for k, name in enumerate(names[:-1])}


def _node_label(node: "InsertedNode", bucket: Any, early: dict[str, int]) -> str:
    if node.name in early:
        return f"grads_bucket{bucket}_{early[node.name]}"
    return f"{'rs_launch' if node.launch else 'ag_wait'}_bucket{bucket}"


def _renames(graph: "Graph", part: "Recorded", explained: "Explained", early: dict[str, int]) -> dict[str, str]:
    """Graph identifiers shown under another name: params by module path, fxzero's
    nodes by what they do and for which bucket."""
    renames = {placeholder: path for placeholder, path, _ in explained.params_of(graph)}
    for node in part.inserted:
        renames[node.name] = _node_label(node, explained.bucket_of(graph, node), early)
    return renames


def _mark(node: "InsertedNode", bucket: Any, early: dict[str, int]) -> str:
    if node.name in early:
        return f"  # <- fxzero: add these grads of bucket {bucket} into main_grad (they die here)"
    if node.launch:
        return f"  # <- fxzero: launch bucket {bucket}'s reduce-scatter (its grads from this graph are in)"
    return f"  # <- fxzero: wait for bucket {bucket}'s all-gather (and launch the next)"


def _marked_code(graph: "Graph", part: "Recorded", explained: "Explained") -> list[str]:
    early = _early_handoffs(graph, part, explained)
    renames = _renames(graph, part, explained, early)
    pattern = (
        re.compile(r"\b(" + "|".join(sorted(map(re.escape, renames), key=len, reverse=True)) + r")\b")
        if renames
        else None
    )
    marks = {f"{node.name} = torch.ops.fxzero": node for node in part.inserted}
    out = []
    for line in part.code.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or _SUBGRAPH_FETCH.match(line):
            continue
        line = _FREES.sub("", line)
        node = next((n for key, n in marks.items() if stripped.startswith(key)), None)
        if pattern is not None:
            line = pattern.sub(lambda m: renames[m.group(1)], line)
        if node is not None:
            line += _mark(node, explained.bucket_of(graph, node), early)
        elif (found := _MODEL_COLLECTIVE.search(stripped)) is not None:
            line += f"  # <- the model's own {found.group(1)} over {_group(found.group(2))}"
        out.append(line)
    return out


def _graph_text(number: int, graph: "Graph", explained: "Explained") -> str:
    params = explained.params_of(graph)
    buckets = ", ".join(map(str, explained.buckets_of(graph))) or "none"
    lines = [f"== graph {number}: {len(params)} params of buckets {buckets} =="]
    lines += [f"# {placeholder} = {path} (bucket {bucket})" for placeholder, path, bucket in params]
    for kind in ("forward", "inference", "backward"):
        part = graph.parts.get(kind)
        if part is not None:
            lines.append(f"-- graph {number} {kind}, after fxzero's passes ({part.total} nodes; frees omitted) --")
            lines += _marked_code(graph, part, explained)
    return "\n".join(lines)


# ---- the schedule -------------------------------------------------------------------
def _sites(explained: "Explained", bucket: int, launch: bool) -> list[str]:
    sites = []
    for number, graph in enumerate(explained.graphs):
        for kind, part in graph.parts.items():
            early = _early_handoffs(graph, part, explained)
            for node in part.inserted:
                if node.launch == launch and node.name not in early and explained.bucket_of(graph, node) == bucket:
                    pct = round(100 * node.index / part.total)
                    sites.append(f"graph {number} {kind} at node {node.index}/{part.total} ({pct}%)")
    return sites


def _schedule_line(explained: "Explained", bucket: int) -> str:
    launches = _sites(explained, bucket, launch=True)
    waits = _sites(explained, bucket, launch=False)
    rs = f"reduce-scatter launches in {', '.join(launches)}" if launches else "reduce-scatter launched by eager hooks"
    if len(launches) > 1:
        rs += " (at the last of these to run)"
    if not explained.optimizer.param_sync.overlap:
        ag = "all-gather finished inside step() (overlap_param_gather off: no wait in the graphs)"
    elif waits:
        ag = f"all-gather waited in {', '.join(waits)}" + (" (by the first to run)" if len(waits) > 1 else "")
    else:
        ag = "all-gather waited by eager hooks"
    return f"bucket {bucket}: {rs}; {ag}"


def _schedule(explained: "Explained") -> str:
    lines = [_schedule_line(explained, bucket.index) for bucket in explained.optimizer.buckets]
    return "\n".join(lines + [_spanning(explained)])


def _spanning(explained: "Explained") -> str:
    """Buckets whose params are read by more than one compiled graph (graph breaks)."""
    seen: dict[int, list[int]] = {}
    for number, graph in enumerate(explained.graphs):
        for bucket in explained.buckets_of(graph):
            seen.setdefault(bucket, []).append(number)
    spanning = [f"{b} (graphs {', '.join(map(str, g))})" for b, g in sorted(seen.items()) if len(g) > 1]
    return f"buckets spanning several graphs: {'; '.join(spanning) if spanning else 'none'}"


# ---- every collective -----------------------------------------------------------------
def _group(name: str) -> str:
    ranks = group_ranks_by_name(name)
    return f"group {name} (ranks {ranks})" if ranks is not None else f"group {name}"


def _model_collectives(part: "Recorded") -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for line in part.code.splitlines():
        found = _MODEL_COLLECTIVE.search(line.strip())
        if found is not None:
            counts[found.groups()] = counts.get(found.groups(), 0) + 1
    return counts


def _collectives(explained: "Explained") -> str:
    """Both kinds a step runs: fxzero's (one reduction and one gather per bucket, over the
    data-parallel group) and the model's own inside its graphs (tensor parallel's, over the
    other mesh dims), so a reader sees which group each runs on."""
    opt = explained.optimizer
    dp = opt.dp
    ranks = list(torch.distributed.get_process_group_ranks(dp.group)) if dp.group is not None else list(range(dp.size))  # None: the world
    counts = opt.collectives_per_step
    ours = ", ".join(f"{c} x {op}" for op, c in sorted(counts.items())) or "none (data-parallel size 1)"
    mesh = " (the grad norm's all-reduce runs once more over each other mesh dim)" if opt.reduced.mesh_norms is not None else ""
    if dp.replica_count > 1:  # hierarchical: which all-reduces leave the instance
        others = list(torch.distributed.get_process_group_ranks(dp.replicas))
        mesh += (f"; instances: {dp.replica_count}, this rank's shard all-reduced over ranks {others} (one all-reduce "
                 "per bucket, the only collective leaving the instance)")
    lines = [f"collectives: fxzero's per step, as c10d counts them: {ours}; data-parallel group: ranks {ranks}{mesh}"]
    for number, graph in enumerate(explained.graphs):
        for kind, part in graph.parts.items():
            counts = _model_collectives(part)
            if counts:
                listed = ", ".join(f"{c} x {op} over {_group(name)}" for (op, name), c in sorted(counts.items()))
                lines.append(f"the model's own in graph {number} {kind}: {listed}")
    if len(lines) == 1:
        lines.append("the model's own in its graphs: none")
    return "\n".join(lines)
