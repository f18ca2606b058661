"""What the benchmarks' charts share, and the main job's loss curve.

    python benchmarks/plotting.py loss METRICS.jsonl [-o FILE.png]   # default: a new METRICS-loss.png

matplotlib is optional (``pip install -e .[bench]``) and imported only to draw. Every chart
carries a title, its conditions (machine, world, model, date: a chart without them cannot
be compared with the next run's) and the values it shows. The benchmarks keep the numbers
a chart is drawn from in a JSON results file beside it (:func:`write_results`), so a chart
can be redrawn, or checked, without rerunning a benchmark that takes minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_log import machine  # noqa: E402  (the main job's: its metrics file names the machine too)

RESULTS = Path(__file__).resolve().parent / "results"
"""Where benchmarks write their charts and results files by default."""


def conditions(world: int, model: str, device: str = "cpu", note: str = "") -> dict[str, Any]:
    """The conditions a chart shows under its title (``note``: e.g. that the machine was shared)."""
    out = {"machine": machine(torch.device(device)), "world": world, "model": model, "date": datetime.date.today().isoformat()}
    if note:
        out["note"] = note
    return out


def caption(cond: dict[str, Any]) -> str:
    text = f"{cond['machine']} | world {cond['world']} | {cond['model']} | {cond['date']}"
    return f"{text} | {cond['note']}" if cond.get("note") else text


def write_results(path: Path, title: str, cond: dict[str, Any], **data: Any) -> None:
    """The numbers a chart is drawn from, as JSON: :func:`read_results` redraws the chart."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"title": title, "conditions": cond, **data}, indent=1) + "\n")
    print(f"wrote {path}")


def read_results(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def pyplot(path: Path | str) -> Optional[Any]:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (saying so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib not installed: no {path}; `pip install -e .[bench]`)")
        return None
    return plt


def save(fig: Any, path: Path | str, title: str, cond: dict[str, Any]) -> None:
    """Title on top, conditions underneath, then the file (its folder made if missing)."""
    fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.text(0.5, 0.005, caption(cond), ha="center", va="bottom", fontsize=8, color="0.3")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


# ---- the main job's loss curve -------------------------------------------------------------
def read_metrics(path: Path | str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run, the logged steps) of a ``examples/train_gpt.py --metrics`` file: its first
    line describes the run, each further line one logged step."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or "run" not in lines[0]:
        raise SystemExit(f"{path}: not a train_gpt.py --metrics file (its first line holds the run)")
    return lines[0]["run"], lines[1:]


def plot_loss(metrics: Path | str, out: Path | str) -> None:
    """Loss per logged step (each point the mean over the steps since the previous one), and the
    learning rate on a second axis; the last loss written at its point."""
    run, steps = read_metrics(metrics)
    plt = pyplot(out)
    if plt is None or not steps:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs, losses = [s["step"] for s in steps], [s["loss"] for s in steps]
    ax.plot(xs, losses, marker="o", markersize=3, color="tab:blue", label="train loss (mean since the previous point)")
    for x, y, dx, dy, align in ((xs[0], losses[0], 6, 0, "left"), (xs[-1], losses[-1], -4, -14, "right")):  # inside the axes
        ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(dx, dy), ha=align, fontsize=9, color="tab:blue")
    ax.margins(y=0.1)
    ax.set_xlabel(f"step (of {run['steps']}; {run['tokens_per_step']:,} tokens/step)")
    ax.set_ylabel("loss (nats/byte)")
    lr_ax = ax.twinx()
    lr_ax.plot(xs, [s["lr"] for s in steps], color="0.6", linewidth=1, linestyle="--", label="learning rate (right axis)")
    lr_ax.set_ylabel("learning rate", color="0.4")
    handles = [h for a in (ax, lr_ax) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    cond = {"machine": run["machine"], "world": run["world"], "model": run["model"], "date": run["date"]}
    save(fig, out, f"examples/train_gpt.py: training loss ({run['setup']})", cond)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="chart", required=True)
    loss = sub.add_parser("loss", help="the loss curve of a train_gpt.py --metrics file")
    loss.add_argument("metrics", help="the JSON-lines file train_gpt.py --metrics wrote")
    loss.add_argument("-o", "--out", default=None,
                      help="the PNG to write (default: a new file beside METRICS, METRICS-loss.png, then -loss-2.png, ...; "
                           "the committed benchmarks/results/loss_curve.png only when named)")  # fmt: skip
    args = p.parse_args(argv)
    plot_loss(args.metrics, args.out or str(new_file(Path(args.metrics))))


def new_file(metrics: Path) -> Path:
    """A PNG path beside ``metrics`` that does not exist yet: a plot never overwrites one unless named."""
    for n in range(1, 10_000):
        out = metrics.with_name(f"{metrics.stem}-loss{'' if n == 1 else f'-{n}'}.png")
        if not out.exists():
            return out
    raise FileExistsError(f"plotting: {metrics.stem}-loss-*.png: 9,999 files exist; name one with -o")


if __name__ == "__main__":
    sys.exit(main())
