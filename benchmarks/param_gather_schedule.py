"""The picture of one ``opt.step()``'s schedule that ``param_gather_overlap.py`` records.

For "default" (the update bucket by bucket, each gather launched as its shard is done) and
"before" (every shard updated, then the gathers), per rank: when each bucket's update ran,
when its gather was in flight and when ``step()`` blocked waiting for it. Drawn on a bare
matplotlib Figure (no pyplot state), as ``benchmarks/plotting.py`` does.
"""

from __future__ import annotations

import datetime
import platform

import torch

__all__ = ["draw"]

_COLORS = {"update": "tab:blue", "publish": "tab:purple", "gather in flight": "tab:orange", "wait": "tab:red"}


def draw(res: list[dict], path: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    labels = ("default", "before")
    buckets = res[0]["default"]["order"]
    rows = len(buckets) + 1  # the update, then one row per bucket's gather
    fig = Figure(figsize=(11, 2.0 + 0.32 * rows * len(res) * len(labels)))
    axes = fig.subplots(len(labels), 1, sharex=True)
    for ax, label in zip(axes, labels):
        ticks = []
        for rank, r in enumerate(res):
            base = rank * (rows + 0.5)
            ticks.append((base, f"rank {rank} update"))
            ticks += [(base + 1 + k, f"rank {rank} gather {index}") for k, index in enumerate(buckets)]
            for what, index, start, end in r[label]["trace"]:
                if what == "opt.step":
                    ax.plot([end, end], [base - 0.5, base + rows - 0.5], color="grey", linestyle=":", linewidth=1)
                    continue
                y = base if what in ("update", "publish") else base + 1 + buckets.index(index)
                ax.barh(y, end - start, left=start, height=0.75, color=_COLORS[what], edgecolor="black", linewidth=0.3)
                if what == "update" and end - start > 0.25:
                    ax.text((start + end) / 2, y, "all" if index < 0 else str(index), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f'"{label}": ' + ("update bucket by bucket, each gather launched as its shard is done" if label == "default"
                                        else "every shard updated, then the gathers"), fontsize=9, loc="left")
    axes[-1].set_xlim(left=0)
    axes[-1].set_xlabel("ms after backward ended (dotted: step() returns; before the first update: the grad reduce-scatter "
                        "waits, the norm and clipping)", fontsize=8)
    handles = [Patch(color=c, label=k) for k, c in _COLORS.items()]
    fig.legend(handles=handles, loc="lower right", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("One opt.step() of the main job's GPT (3.25M params, 4 buckets), 2 gloo ranks x 1 thread each\n"
                 f"{platform.machine()}, torch {torch.__version__}, {datetime.date.today().isoformat()}; "
                 "update bars: bucket index", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
