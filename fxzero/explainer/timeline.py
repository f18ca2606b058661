"""The bucket timeline picture of :func:`fxzero.explain` (``timeline_file=`` / ``--timeline FILE.png``).

Why a picture: overlap is a matter of position. A row per bucket and a panel per compiled
graph, forward then backward on one axis of node positions, show at a glance whether the
gradient reductions launch early in backward (markers spread to the left of the backward
span) or bunch at its end, and whether the gathers are waited late in forward.

matplotlib is optional (``pip install 'fxzero[bench]'``) and imported only when a picture is asked for.
"""

from __future__ import annotations

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


def _spans(graph: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``(part, first x, nodes)`` of each part, laid end to end in the order a step runs them."""
    spans, x = [], 0
    for kind, part in graph["parts"].items():
        spans.append((kind, x, part["nodes"]))
        x += part["nodes"]
    return spans


def _events(ax: Any, part: dict[str, Any], start: int, rows: dict[int, int]) -> None:
    for what, color, marker, size in (("waits", _WAIT, "v", 90), ("launches", _LAUNCH, "^", 90), ("handoffs", _HANDOFF, "o", 25)):
        for e in part[what]:
            x, y = start + e["node"], rows[e["bucket"]]
            ax.scatter([x], [y], color=color, marker=marker, s=size, zorder=3)
            if what != "handoffs":
                ax.annotate(f"{e['node']}/{part['nodes']}", (x, y), textcoords="offset points", xytext=(0, 8),
                            ha="center", fontsize=7, color=color)  # fmt: skip


def _panel(ax: Any, graph: dict[str, Any], overlap: bool) -> None:
    buckets = sorted(graph["buckets"])
    rows = {b: i for i, b in enumerate(buckets)}
    for n, (kind, start, nodes) in enumerate(_spans(graph)):
        ax.axvspan(start - 0.5, start + nodes - 0.5, color="0.93" if n % 2 == 0 else "0.85", zorder=0)
        ax.text(start + nodes / 2, len(buckets) - 0.35, f"{kind} ({nodes} nodes)", ha="center", va="bottom", fontsize=8)
        _events(ax, graph["parts"][kind], start, rows)
    params = ", ".join(p["name"] for p in graph["params"][:3]) + (", …" if len(graph["params"]) > 3 else "")
    ax.set_title(f"graph {graph['id']}: {len(graph['params'])} params ({params})", fontsize=9, loc="left")
    ax.set_yticks(range(len(buckets)), [f"bucket {b}" for b in buckets], fontsize=8)
    ax.set_ylim(-0.6, len(buckets) + 0.1)
    total = sum(nodes for _, _, nodes in _spans(graph))
    ax.set_xlim(-1, total)
    if not overlap:
        ax.text(0, -0.5, "no waits: gathers finish inside step() (overlap_param_gather off)", fontsize=7, va="bottom")


def draw_timeline(data: dict[str, Any], path: Union[str, "os.PathLike[str]"], date: str = "") -> None:
    """Draw ``data`` (:func:`fxzero.explainer.data.as_data`) into the PNG at ``path``."""
    Figure, Line2D = matplotlib_parts()
    graphs = data["graphs"] or [{"id": "none", "params": [], "buckets": [], "parts": {}}]
    heights = [0.55 * max(len(g["buckets"]), 1) + 0.9 for g in graphs]
    fig = Figure(figsize=(11, sum(heights) + 1.6))
    axes = fig.subplots(len(graphs), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, graph in zip(axes[:, 0], graphs):
        _panel(ax, graph, data["conditions"]["overlap_param_gather"])
    axes[-1, 0].set_xlabel("node position in the compiled graph, not time (forward, then backward; k/N: node k of the part's N nodes)")
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
