"""Draw docs/layout.png: how fxzero lays a model's params out, from a real plan.

    python docs/diagrams/layout.py            # writes docs/layout.png (needs matplotlib)

The picture is not drawn by hand: :func:`plan` asks ``fxzero.optim.plan_buckets`` for the
layout of a small model at data-parallel size 2 (what ``DistributedOptimizer`` plans at
construction) and ``fxzero.optim.shard_fragments`` for each rank's pieces, and :func:`draw`
draws exactly those ranges. If the layout rules change, rerunning the script redraws the
picture; ``tests/test_readme.py`` checks that the README's caption still matches :func:`plan`.
"""


import dataclasses
import textwrap
from pathlib import Path

import torch

from fxzero.optim import BufferPlan, Fragment, plan_buckets, shard_fragments

DP = 2
BUCKET_SIZE = 4_000
"""Elements: small enough that the tiny model gets three buckets (fxzero's gloo default is 4M)."""
OUT = Path(__file__).resolve().parents[1] / "layout.png"


class TinyLM(torch.nn.Module):
    """A two-block MLP language model: 15 params from 32 to 2,048 elements; a vocabulary of 50 leaves padding."""

    def __init__(self, dim: int = 32, hidden: int = 64, vocab: int = 50) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(dim), "up": torch.nn.Linear(dim, hidden),
                                 "down": torch.nn.Linear(hidden, dim)})
            for _ in range(2)
        )  # fmt: skip
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + b["down"](torch.nn.functional.gelu(b["up"](b["norm"](x))))
        return self.head(x)


@dataclasses.dataclass(frozen=True)
class Layout:
    names: tuple[str, ...]
    plan: BufferPlan
    fragments: tuple[tuple[Fragment, ...], ...]
    """Per rank: its pieces of the params, in buffer order."""


def plan() -> Layout:
    """The plan ``DistributedOptimizer(model().parameters(), ..., bucket_size=BUCKET_SIZE)``
    makes at data-parallel size ``DP`` (fp32 params, fp32 grad buffer)."""
    named = list(TinyLM().named_parameters())
    layout = plan_buckets([p for _, p in named], dp_size=DP, bucket_size=BUCKET_SIZE)
    return Layout(tuple(n for n, _ in named), layout, tuple(shard_fragments(layout, r) for r in range(DP)))


def caption(layout: Layout) -> str:
    """The sentence the README prints under the picture (a test compares the two)."""
    p = layout.plan
    params = sum(end - start for start, end, _ in p.param_ranges)
    owned = ", ".join(f"rank {r} {sum(f.numel for f in frags):,}" for r, frags in enumerate(layout.fragments))
    return (
        f"{len(layout.names)} params ({params:,} elements) in {len(p.buckets)} buckets: one flat buffer of "
        f"{p.numel:,} elements ({p.padding_fraction:.1%} padding); each rank keeps the optimizer state of "
        f"the param elements in its shards ({owned})."
    )


def draw(layout: Layout, out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    p = layout.plan
    colors = plt.get_cmap("tab20").colors
    rank_colors = ("#4C72B0", "#DD8452")
    fig, ax = plt.subplots(figsize=(13, 5.0))
    rows = {"params": 3.0, "buckets": 2.0, "shards": 1.0}

    def box(x0: int, x1: int, y: float, color, label: str = "", hatch: str | None = None, text_color="black") -> None:
        ax.add_patch(Rectangle((x0, y - 0.35), x1 - x0, 0.7, facecolor=color, edgecolor="black", linewidth=0.6, hatch=hatch))
        if label and (x1 - x0) > 0.045 * p.numel:
            ax.text((x0 + x1) / 2, y, label, ha="center", va="center", fontsize=7.5, color=text_color)

    for index, (start, end, _) in enumerate(p.param_ranges):
        box(start, end, rows["params"], colors[index % len(colors)], layout.names[index].replace(".", ".\n", 1))
    for b, bucket in enumerate(p.buckets):
        used_end = bucket.start + bucket.numel_unpadded
        box(bucket.start, used_end, rows["buckets"], "#e8e8e8", f"bucket {b}\n{bucket.numel:,} elements")
        if bucket.end > used_end:
            box(used_end, bucket.end, rows["buckets"], "white", hatch="////")
        shard = bucket.shard_numel(DP)
        for r in range(DP):
            lo = bucket.start + r * shard
            box(lo, lo + shard, rows["shards"], rank_colors[r], f"b{b}: rank {r}\n{shard:,}", text_color="white")
    for rank, frags in enumerate(layout.fragments):  # where a param is cut between the ranks
        for f in frags:
            start = p.param_ranges[f.param_index][0]
            if f.param_offset > 0:
                ax.plot([start + f.param_offset] * 2, [rows["shards"] + 0.35, rows["params"] - 0.35],
                        color="black", linestyle=":", linewidth=0.9)
    ax.set_xlim(0, p.numel)
    ax.set_ylim(0.55, 3.45)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels([
        "params\n(reverse registration\norder, aligned starts)",
        "buckets\n(padded to lcm(dp, 128);\nhatched: padding)",
        f"per-rank shards\n(dp = {DP}: state, fp32\nmasters, grad shard)",
    ])
    ax.set_xlabel("offset in the flat param buffer (elements; the grad buffer has the same layout)")
    ax.set_title(
        f"fxzero layout from fxzero.optim.plan_buckets: {len(layout.names)}-param TinyLM, dp={DP}, "
        f"bucket_size={BUCKET_SIZE:,}, fp32\n{textwrap.fill(caption(layout), 150)}\n"
        "Backward fills the buckets left to right; each launches its reduce-scatter once its grads are in. "
        "Dotted: a param cut between two ranks' shards.\nGenerated by docs/diagrams/layout.py",
        fontsize=9,
    )
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    layout = plan()
    print(caption(layout))
    print(f"wrote {draw(layout)}")
