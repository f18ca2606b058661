"""The bucket timeline picture of :func:`fxzero.explain` (``timeline_file=`` / ``--timeline FILE.png``).

Why a picture: overlap is a matter of time. A row per bucket and a panel per compiled graph,
on one axis of a step's estimated time (the forwards in order, then the backwards in reverse,
as a step runs them; each node's time a roofline estimate from its FLOPs and bytes at the
machine's measured speed, :mod:`~fxzero.explainer.node_costs`), show at a glance whether the
gradient reductions launch early in backward (markers to the left of the backward span, with
compute still ahead of them) or bunch at its end, and whether the gathers are waited late in
forward. Without a measured speed the axis is node positions, and says so.

matplotlib is optional (``pip install 'fxzero[bench]'``) and imported only when a picture is asked for.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Union

__all__ = ["PlottingMissing", "draw_timeline", "matplotlib_parts"]

_LAUNCH, _WAIT, _HANDOFF = "tab:red", "tab:blue", "tab:gray"


class PlottingMissing(ImportError):
    """matplotlib is not installed: what to install is in the message."""


def matplotlib_parts() -> tuple[Any, Any]:
    """``(Figure, Line2D)``, or :class:`PlottingMissing`. A bare ``Figure`` renders to a file
    without pyplot: no global backend switched, no figure left open in the user's process."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise PlottingMissing(
            "fxzero explain --timeline needs matplotlib: pip install 'fxzero[bench]' (or matplotlib>=3.8)"
        ) from None
    return Figure, Line2D


def _conditions(data: dict[str, Any], date: str) -> str:
    c = data["conditions"]
    size = "none (one per dtype)" if c["bucket_size"] is None else f"{c['bucket_size']:,} elements"
    assumed = c["collectives_assume"]
    group = f"{c['backend']} group" + (f", collectives as on {assumed.upper()}" if assumed not in (None, c["backend"]) else "")
    names = data["collectives"]
    ops = f"reduction {names['reduction']}, gather {names['gather']}; " if names["reduction"] else ""
    return (
        f"world size {c['world_size']} ({group}); bucket size {size}; {len(data['buckets'])} bucket{'s' * (len(data['buckets']) != 1)}; "
        f"overlap_param_gather {'on' if c['overlap_param_gather'] else 'off'}\n{ops}inner compiler {c['inner_compiler']}; "
        f"fxzero {c['fxzero']}, torch {c['torch']}; {date}"
    )


@dataclasses.dataclass(frozen=True)
class _Axis:
    """The x axis: estimated time (in ms, or µs for a step under a millisecond) when every part
    has one (explain measured the machine's speed), else node positions."""

    timed: bool
    unit: str = "nodes"
    scale: float = 1.0

    @classmethod
    def of(cls, data: dict[str, Any]) -> "_Axis":
        parts = [part for g in data["graphs"] for part in g["parts"].values()]
        if not parts or not data["conditions"].get("speed") or any(part.get("ms") is None for part in parts):
            return cls(False)
        return cls(True, "ms") if sum(part["ms"] for part in parts) >= 1 else cls(True, "µs", 1e3)

    def width(self, part: dict[str, Any]) -> float:
        return part["ms"] * self.scale if self.timed else part["nodes"]

    def at(self, event: dict[str, Any]) -> float:
        return event["ms"] * self.scale if self.timed else event["node"]

    def label(self, data: dict[str, Any]) -> str:
        if not self.timed:
            return ("node position in the step's compiled graphs, not time (forwards, then backwards in reverse; "
                    "k/N: node k of the part's N nodes)")  # fmt: skip
        return (f"estimated time into the step's forward+backward, {self.unit}: per node max(FLOPs / peak, bytes / bandwidth) "
                f"at {data['conditions']['speed']}\n(forwards, then backwards in reverse; fxzero's collectives drawn where "
                "they are issued, their own time not shown; k/N: node k of the part's N nodes)")  # fmt: skip


def _step_starts(graphs: list[dict[str, Any]], axis: _Axis) -> tuple[dict[tuple[str, str], float], float]:
    """Where each graph's part starts in a step, as a step runs them: the forwards (or inference
    graphs) in order, then the backwards in reverse; and where the step ends."""
    starts, x = {}, 0.0
    order = [(g, k) for g in graphs for k in ("forward", "inference")]
    order += [(g, "backward") for g in reversed(graphs)]
    for graph, kind in order:
        part = graph["parts"].get(kind)
        if part is not None:
            starts[(graph["id"], kind)] = x
            x += axis.width(part)
    return starts, x


def _events(ax: Any, part: dict[str, Any], start: float, rows: dict[int, int], axis: _Axis) -> None:
    for what, color, marker, size in (("waits", _WAIT, "v", 90), ("launches", _LAUNCH, "^", 90), ("handoffs", _HANDOFF, "o", 25)):
        for e in part[what]:
            x, y = start + axis.at(e), rows[e["bucket"]]
            ax.scatter([x], [y], color=color, marker=marker, s=size, zorder=3)
            if what != "handoffs":
                ax.annotate(f"{e['node']}/{part['nodes']}", (x, y), textcoords="offset points", xytext=(0, 8),
                            ha="center", fontsize=7, color=color)  # fmt: skip


def _panel(ax: Any, graph: dict[str, Any], starts: dict[tuple[str, str], float], overlap: bool, axis: _Axis) -> None:
    buckets = sorted(graph["buckets"])
    rows = {b: i for i, b in enumerate(buckets)}
    for n, (kind, part) in enumerate(graph["parts"].items()):
        start, width = starts[(graph["id"], kind)], axis.width(part)
        ax.axvspan(start, start + width, color="0.93" if n % 2 == 0 else "0.85", zorder=0)
        size = f"{part['nodes']} nodes, {width:.3g} {axis.unit}" if axis.timed else f"{part['nodes']} nodes"
        ax.text(start + width / 2, len(buckets) - 0.35, f"{kind} ({size})", ha="center", va="bottom", fontsize=8)
        _events(ax, part, start, rows, axis)
    params = ", ".join(p["name"] for p in graph["params"][:3]) + (", …" if len(graph["params"]) > 3 else "")
    ax.set_title(f"graph {graph['id']}: {len(graph['params'])} params ({params})", fontsize=9, loc="left")
    ax.set_yticks(range(len(buckets)), [f"bucket {b}" for b in buckets], fontsize=8)
    ax.set_ylim(-0.6, len(buckets) + 0.1)
    if not overlap:
        ax.text(0, -0.5, "no waits: gathers finish inside step() (overlap_param_gather off)", fontsize=7, va="bottom")


def draw_timeline(data: dict[str, Any], path: Union[str, "os.PathLike[str]"], date: str = "") -> None:
    """Draw ``data`` (:func:`fxzero.explainer.data.as_data`) into the PNG at ``path``."""
    Figure, Line2D = matplotlib_parts()
    graphs = data["graphs"] or [{"id": "none", "params": [], "buckets": [], "parts": {}}]
    heights = [0.55 * max(len(g["buckets"]), 1) + 0.9 for g in graphs]
    fig = Figure(figsize=(11, sum(heights) + 1.6))
    axes = fig.subplots(len(graphs), 1, squeeze=False, sharex=True, gridspec_kw={"height_ratios": heights})
    axis = _Axis.of(data)
    starts, end = _step_starts(graphs, axis)
    for ax, graph in zip(axes[:, 0], graphs):
        _panel(ax, graph, starts, data["conditions"]["overlap_param_gather"], axis)
    axes[0, 0].set_xlim(-0.02 * end, 1.01 * max(end, 1e-9))
    axes[-1, 0].set_xlabel(axis.label(data), fontsize=8)
    names = data["collectives"]
    handles = [
        Line2D([], [], color=_WAIT, marker="v", ls="", label=f"gather waited ({names['gather'] or 'none at world size 1'})"),
        Line2D([], [], color=_LAUNCH, marker="^", ls="", label=f"reduction launched ({names['reduction'] or 'none at world size 1'})"),
    ]  # fmt: skip
    if any(part["handoffs"] for g in graphs for part in g["parts"].values()):
        handles.append(Line2D([], [], color=_HANDOFF, marker="o", ls="", label="grads handed off (bucket not complete yet)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.025), ncol=len(handles), fontsize=8, frameon=False)
    spanning = [f"bucket {b['index']} (graphs {', '.join(map(str, b['graphs']))})" for b in data["buckets"] if len(b["graphs"]) > 1]
    if spanning:
        fig.text(0.5, 0.01, f"read by several graphs: {'; '.join(spanning)}: its reduction starts at the site that runs last "
                 "(backward runs the graphs in reverse), its gather is waited by the first forward", ha="center", fontsize=7)  # fmt: skip
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    fig.suptitle(f"fxzero explain: where each bucket's collectives sit in {data['conditions']['model']}'s compiled graphs\n"
                 + _conditions(data, date), fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
