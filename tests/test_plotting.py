"""benchmarks/plotting.py and the charts drawn through it: each has a title, its conditions
(machine, world, model, date) and its values; compare.png shows step times as ratios to
DDP + compile; no legend covers a bar; the loss curve is drawn from a train_gpt.py --metrics
file. Drawn from small results written here (no benchmark runs), on matplotlib's Agg backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compare  # noqa: E402
import memory  # noqa: E402
import plotting  # noqa: E402

COND = {"machine": "Test CPU, 2 cores", "world": 2, "model": "GPT 3.25M params", "date": "2026-11-27", "note": "shared machine"}


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the charts save (the PNG is still written)."""
    saved, save = [], plotting.save

    def keep(fig: Any, path: Any, title: str, cond: dict[str, Any]) -> None:
        save(fig, path, title, cond)
        saved.append(fig)

    monkeypatch.setattr(plotting, "save", keep)
    return saved


def _texts(fig: Any) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")))


def _titled(fig: Any, title: str) -> None:
    texts = _texts(fig)
    assert fig.get_suptitle() == title
    assert "Test CPU, 2 cores | world 2 | GPT 3.25M params | 2026-11-27 | shared machine" in texts, texts


def _no_legend_on_a_bar(fig: Any) -> None:
    from matplotlib.patches import Rectangle

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() and p.get_height()]
        assert bars and not any(box.overlaps(bar.get_window_extent(renderer)) for bar in bars), ax


COMPARE_HEADERS = ["config", "median ms", "p10-p90 ms", "vs DDP + compile", "vs limit", "alone ms", "opt state MiB/rank",
                   "peak RSS MiB/rank", "collectives/step", "MiB comm/step", "1st-step extra s", "loss @ step 10 (vs eager)"]


def _compare_row(name: str, ms: float, state: float, rss: float) -> list[str]:
    return [name, f"{ms:.1f}", f"{ms - 5:.1f}-{ms + 5:.1f}", "", "", "", f"{state:.2f}", f"{rss:.0f}", "", "", "", ""]


def test_compare_chart_shows_step_times_as_ratios_to_ddp_compile(tmp_path: Path, figures: list[Any]) -> None:
    """Bars grow from 1.0 (DDP + compile), not from 0, so a 1% difference shows; each is labelled
    with its ratio and time; memory bars carry their values."""
    results = {"title": "compare", "conditions": COND, "headers": COMPARE_HEADERS, "rows": [
        _compare_row("fxzero", 275.0, 12.39, 597), _compare_row("DDP + compile", 272.3, 24.79, 617),
        _compare_row("limit", 249.0, 0.0, 570)]}  # fmt: skip
    compare._plot(results, str(tmp_path / "compare.png"))
    (fig,) = figures
    assert (tmp_path / "compare.png").stat().st_size > 0
    _titled(fig, "compare")
    ratios = fig.axes[0]
    assert [round(p.get_x(), 6) for p in ratios.patches if p.get_height() > 0.5] == [1.0, 1.0, 1.0]
    assert ratios.get_xlim()[0] > 0.8  # the axis is zoomed on the ratios
    texts = _texts(fig)
    for label in ("1.010x (275 ms)", "1.000x (272 ms)", "0.914x (249 ms)", "597", "12.39", "24.79"):
        assert label in texts, (label, texts)
    _no_legend_on_a_bar(fig)


def test_memory_chart_has_values_and_its_legends_cover_no_bar(tmp_path: Path, figures: list[Any]) -> None:
    table = [["DDP gabv", "1081.3", "+0.0", "", "", "", "", "326.0", "2037"],
             ["FSDP2", "874.1", "-207.2", "", "", "", "", "163.0", "2048"],
             ["fxzero", "977.4", "-104.0", "", "", "", "", "163.0", "1038"]]
    sweep = [["43M", "42.7M", "2", "977.2", "1144.3", "", "", "", "", ""], ["43M", "42.7M", "4", "904.1", "1144.6", "", "", "", "", ""]]
    results = {"title": "memory", "conditions": COND, "table_model": "GPT 43M", "measure": "peak RSS", "table": table, "sweep": sweep}
    memory._plot(results, str(tmp_path / "memory.png"))
    (fig,) = figures
    _titled(fig, "memory")
    texts = _texts(fig)
    for label in ("1081", "874", "977", "163.0", "326.0", "1144", "904", "43M, world 4"):
        assert label in texts, (label, texts)
    _no_legend_on_a_bar(fig)


def test_loss_curve_from_a_metrics_file(tmp_path: Path, figures: list[Any]) -> None:
    """``plotting.py loss FILE -o PNG``: the run's conditions from the file's first line, the
    loss per logged step, its first and last values written on the curve."""
    run = {"machine": "Test CPU, 2 cores", "world": 2, "model": "GPT 3.25M params", "date": "2026-11-27",
           "setup": "AdamW, compile inductor", "steps": 20, "tokens_per_step": 2048, "device": "cpu"}
    steps = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3} for s in (1, 10, 20)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(line) for line in [{"run": run}, *steps]) + "\n")
    plotting.main(["loss", str(metrics), "-o", str(tmp_path / "out" / "loss.png")])
    (fig,) = figures
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0
    assert fig.get_suptitle() == "examples/train_gpt.py: training loss (AdamW, compile inductor)"
    texts = _texts(fig)
    assert "Test CPU, 2 cores | world 2 | GPT 3.25M params | 2026-11-27" in texts and "4.900" in texts and "3.000" in texts
    line = fig.axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [1, 10, 20] and list(line.get_ydata()) == pytest.approx([4.9, 4.0, 3.0])
