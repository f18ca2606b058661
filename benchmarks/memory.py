"""Peak memory per rank: fxzero vs DDP, ZeroRedundancyOptimizer and FSDP2, and how it scales.

    python benchmarks/memory.py [--steps 4] [--only CONFIG ...] [--sweep] [--png FILE] [--device cpu|cuda]
    python benchmarks/memory.py --replot benchmarks/results/memory.json   # redraw the chart only

Writes benchmarks/results/memory.json (the tables) and benchmarks/results/memory.png (the chart)
by default.

**The table** (always): the 43M-param GPT of ``examples/train_gpt.py`` at dim 768, 6 layers,
vocab 256, seq 64, batch 2 per rank, fp32, AdamW (the issue's setup), at 2 ranks, every
config in fresh processes (a ``fxzero.testing`` pool of its own, gloo, 1 thread per rank;
with ``--device cuda`` each rank trains on its GPU over NCCL). Every config uses its
defaults: fxzero ``Config()``, DDP's 25 MB buckets. Columns: the peak per rank (max over
ranks) and where it was reached (the peak *during* model/optimizer construction and during
each forward, backward and ``step()`` + ``zero_grad()``, over all steps), the optimizer
state, the median step time (steps 2+; one run on a shared machine: indicative; compare.py
times steps). ``--repeat N`` runs each config N times and shows the run with the median peak. On CPU
memory is the resident set (``VmHWM``, whole process: interpreter, torch and compiled
code included), with glibc's mmap threshold fixed at 1 MiB for every config (see
:data:`MMAP_THRESHOLD`; ``--malloc-default`` keeps glibc's); on a GPU
``torch.cuda.max_memory_allocated``.

* **fxzero eager**: ``DistributedOptimizer`` without ``torch.compile``; **fxzero
  eager-inner** / **fxzero**: ``torch.compile(model, backend="fxzero")`` with the eager /
  Inductor inner compiler;
* **DDP eager** (defaults), **DDP gabv** (``gradient_as_bucket_view=True``), **DDP +
  compile**, **DDP gabv + compile** / **DDP gabv + aot_eager** (the peers of fxzero with
  the Inductor / eager inner compiler: the same compiler's memory, see :data:`PEERS`);
  **DDP + ZeRO** (``ZeroRedundancyOptimizer``); **FSDP2** (``fully_shard`` per
  block and root, ``reshard_after_forward=False``);
* **floor**: the eager model's forward and backward alone, no optimizer.

**The sweep** (``--sweep``): fxzero (Inductor) vs DDP gabv + compile at ~3M / ~43M / ~150M
params (world 2; 3 steps for the largest) and at world 1 / 2 / 4 (43M): peak, optimizer
state, step time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_ranks  # noqa: E402  (what runs on every rank)
import plotting  # noqa: E402
from memory_ranks import PHASES, Model  # noqa: E402

from fxzero.testing import close_pools, run_ranks  # noqa: E402

CONFIGS = (
    "DDP eager", "DDP gabv", "DDP + compile", "DDP gabv + compile", "DDP gabv + aot_eager", "DDP + ZeRO", "FSDP2",
    "fxzero eager", "fxzero eager-inner", "fxzero", "floor",
)  # fmt: skip
BASELINE = "DDP gabv"
PEERS = {"fxzero eager": BASELINE, "fxzero eager-inner": "DDP gabv + aot_eager", "fxzero": "DDP gabv + compile"}
"""Each fxzero row's peer: DDP gabv run through the same compiler stack, whose own memory
in the process (dynamo, AOTAutograd, Inductor's modules, compiled code and compile-time
caches: 20-60 MiB here) any compiled config pays. Compiled rows are shown against the
uncompiled DDP gabv too."""
MMAP_THRESHOLD = 1 << 20
"""glibc's mmap threshold for the ranks (``MALLOC_MMAP_THRESHOLD_``), unless ``--malloc-default``:
fixed, so every tensor over 1 MiB is its own mapping, returned to the system when freed. By
default glibc raises the threshold each time such a block is freed, after which large
tensors come from the heap, whose freed space stays resident: the peak RSS then depends on
the order of earlier frees (30-40 MiB between two runs of the same config), not on the
memory the program holds. The fixed threshold makes RSS follow the tensors held, as
``max_memory_allocated`` does on a GPU."""
MODELS = {
    "3M": Model("3M", dim=256, n_layer=4, n_head=4),
    "43M": Model("43M", dim=768, n_layer=6, n_head=12),
    "150M": Model("150M", dim=1024, n_layer=12, n_head=16),
}
SWEEP = [("3M", 2), ("43M", 2), ("150M", 2), ("43M", 1), ("43M", 4)]
SWEEP_CONFIGS = ("fxzero", "DDP gabv + compile")


def _median_run(config: str, model: Model, world: int, steps: int, device: str, repeat: int) -> list[dict] | str:
    """``repeat`` runs of one config, each in a fresh pool: the run with the median peak."""
    runs = [_run(config, model, world, steps, device) for _ in range(repeat)]
    failed = [r for r in runs if isinstance(r, str)]
    if failed:
        return failed[0]
    if repeat > 1:
        print(f"    {config} peaks: {', '.join(f'{_peak(r):.1f}' for r in runs)}", flush=True)
    return sorted(runs, key=_peak)[len(runs) // 2]


def _run(config: str, model: Model, world: int, steps: int, device: str) -> list[dict] | str:
    """One config in a fresh pool: per-rank results, or why it failed."""
    start = time.perf_counter()
    try:
        return run_ranks(world, memory_ranks.measure, config, model, steps, device, timeout=3600)
    except Exception as exc:  # noqa: BLE001 - a config that cannot run still gets its row
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {lines[-1] if lines else exc}"
    finally:
        close_pools()
        print(f"  {config} ({model.name}, world {world}): {time.perf_counter() - start:.0f} s", flush=True)


def _peak(res: list[dict]) -> float:
    return max(r["peak"] for r in res)


def _state_mib(res: list[dict]) -> float:
    return max(r["state_bytes"] for r in res) / 2**20


def _table(results: dict) -> list[list[str]]:
    base = results.get(BASELINE)
    rows = []
    for config, res in results.items():
        if isinstance(res, str):
            rows.append([config, f"FAILED: {res}"] + [""] * (len(PHASES) + 4))
            continue
        versus = f"{_peak(res) - _peak(base):+.1f}" if isinstance(base, list) else "n/a"
        phases = [f"{max(r['peaks'][p] for r in res):.1f}" for p in PHASES]
        ms = max(r["step_ms"] for r in res)
        rows.append([config, f"{_peak(res):.1f}", versus, *phases, f"{_state_mib(res):.1f}", f"{ms:.0f}"])
    return rows


def _targets(results: dict, world: int) -> None:
    """The bar: at least 90% of the ideal saving ((1 - 1/world) of the AdamW state) below
    its peer in :data:`PEERS`, and below ZeroRedundancyOptimizer's peak."""
    base, zero = results.get(BASELINE), results.get("DDP + ZeRO")
    if not isinstance(base, list) or world < 2:
        print(f"\n{BASELINE} did not run (or world 1): no targets checked.")
        return
    ideal = _state_mib(base) * (1 - 1 / world)
    print(f"\n## targets (ideal ZeRO-1 saving: {1 - 1 / world:.2f} of {BASELINE}'s AdamW state = {ideal:.1f} MiB per rank)\n")
    for config, peer in PEERS.items():
        res, peer_res = results.get(config), results.get(peer)
        if not isinstance(res, list) or not isinstance(peer_res, list):
            continue
        saving = _peak(peer_res) - _peak(res)
        ok = saving >= 0.9 * ideal
        line = f"{config}: {saving:.1f} MiB below {peer} = {saving / ideal:.2f}x the ideal (target >= 0.9x): {'PASS' if ok else 'FAIL'}"
        if isinstance(zero, list):
            below = _peak(zero) - _peak(res)
            line += f"; {below:+.1f} MiB vs DDP + ZeRO (target > 0): {'PASS' if below > 0 else 'FAIL'}"
        print(line)
    for config, peer in PEERS.items():
        res, peer_res = results.get(config), results.get(peer)
        if peer != BASELINE and isinstance(res, list) and isinstance(peer_res, list):
            print(f"{config} vs uncompiled {BASELINE}: {_peak(base) - _peak(res):.1f} MiB below; the compiler's own memory "
                  f"({peer} - {BASELINE}) is {_peak(peer_res) - _peak(base):.1f} MiB")  # fmt: skip


def _sweep(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for name, world in SWEEP:
        model = MODELS[name]
        steps = 3 if name == "150M" else args.steps
        got = {config: _run(config, model, world, steps, args.device) for config in SWEEP_CONFIGS}
        fx, ddp = got["fxzero"], got["DDP gabv + compile"]
        if isinstance(fx, str) or isinstance(ddp, str):
            rows.append([name, "", world, f"FAILED: {fx if isinstance(fx, str) else ddp}"] + [""] * 6)
            continue
        ideal = _state_mib(ddp) * (1 - 1 / world)
        saving = _peak(ddp) - _peak(fx)
        rows.append([
            name, f"{fx[0]['params'] / 1e6:.1f}M", world, f"{_peak(fx):.1f}", f"{_peak(ddp):.1f}",
            f"{saving:.1f} ({saving / ideal:.2f}x)" if ideal else f"{saving:.1f} (ideal 0)",
            f"{_state_mib(fx):.1f} / {_state_mib(ddp):.1f}",
            f"{max(r['step_ms'] for r in fx):.0f}", f"{max(r['step_ms'] for r in ddp):.0f}",
            f"{max(r['step_ms'] for r in fx) / max(r['step_ms'] for r in ddp):.2f}",
        ])  # fmt: skip
    return rows


def _plot(results: dict, path: str) -> None:
    """Per config, the peak and the optimizer state side by side (left); the sweep's peaks, fxzero
    beside DDP gabv + compile (right). Values on every bar; legends above the axes, off the bars."""
    plt = plotting.pyplot(path)
    if plt is None:
        return
    ok = [r for r in results["table"] if not r[1].startswith("FAILED")]
    done = [r for r in results["sweep"] if not r[3].startswith("FAILED")]
    fig, axes = plt.subplots(1, 2 if done else 1, figsize=(15 if done else 8, 0.5 * len(ok) + 2.6), squeeze=False)
    ax, y, h = axes[0][0], list(range(len(ok))), 0.4
    for column, offset, color, label, fmt in ((1, -h / 2, "tab:orange", "peak per rank (whole process)", ".0f"),
                                              (-2, h / 2, "tab:green", "optimizer state per rank", ".1f")):
        drawn = ax.barh([i + offset for i in y], [float(r[column]) for r in ok], height=h, color=color, label=label)
        ax.bar_label(drawn, labels=[format(float(r[column]), fmt) for r in ok], padding=3, fontsize=8)
    ax.set_yticks(y, [r[0] for r in ok])
    ax.set_xlim(0, 1.15 * max(float(r[1]) for r in ok))
    ax.set_xlabel(f"MiB per rank, max over ranks ({results['measure']})")
    ax.invert_yaxis()
    ax.set_title(f"every config: {results['table_model']}, world {results['conditions']['world']}", fontsize=10, pad=26)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2, fontsize=8, frameon=False)
    if done:
        ax, xs = axes[0][1], range(len(done))
        for column, offset, label, color in ((3, -0.2, "fxzero", "tab:blue"), (4, 0.2, "DDP gabv + compile", "0.6")):
            drawn = ax.bar([x + offset for x in xs], [float(r[column]) for r in done], width=0.4, label=label, color=color)
            ax.bar_label(drawn, labels=[f"{float(r[column]):.0f}" for r in done], padding=2, fontsize=8)
        ax.set_xticks(list(xs), [f"{r[0]}, world {r[2]}" for r in done])
        ax.set_ylim(0, 1.12 * max(float(r[4]) for r in done))
        ax.set_ylabel("peak MiB per rank")
        ax.set_title("scale sweep: model size and world", fontsize=10, pad=26)
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2, fontsize=8, frameon=False)
    plotting.save(fig, path, results["title"], results["conditions"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--world", type=int, default=2, help="ranks for the table")
    p.add_argument("--only", nargs="+", default=list(CONFIGS), choices=CONFIGS, metavar="CONFIG", help=f"subset of {CONFIGS}")
    p.add_argument("--model", default="43M", choices=sorted(MODELS), help="the table's model")
    p.add_argument("--sweep", action="store_true", help="also run the scale sweep (fxzero vs DDP gabv + compile)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--png", default=str(plotting.RESULTS / "memory.png"), help="where to write the chart (needs matplotlib)")
    p.add_argument("--results", help="where to write the tables the chart is drawn from (default: --png's path, .json)")
    p.add_argument("--note", default="", help="shown under the chart's title with the conditions (e.g. 'shared machine')")
    p.add_argument("--replot", metavar="RESULTS", help="only redraw the chart from a results file this script wrote")
    p.add_argument("--repeat", type=int, default=1, help="runs per config of the table (fresh processes each); the median peak's run is shown")
    p.add_argument("--malloc-default", action="store_true", help="keep glibc's dynamic mmap threshold (see MMAP_THRESHOLD)")
    args = p.parse_args()
    if args.replot:
        _plot(plotting.read_results(args.replot), args.png)
        return
    malloc = "glibc default"
    if args.device == "cpu" and not args.malloc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by the ranks' glibc at start
        malloc = f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    if args.steps < 2:
        p.error("need --steps >= 2 (the step time is the median of steps 2+)")
    model = MODELS[args.model]
    unit = "torch.cuda.max_memory_allocated" if args.device == "cuda" else f"peak RSS (VmHWM), {malloc}"
    print(f"# peak memory per rank: torch {torch.__version__}, {args.device}, {args.world} ranks, GPT {model.name} "
          f"(dim {model.dim}, {model.n_layer} layers, seq {model.seq}, batch {model.batch}/rank), AdamW, {args.steps} steps; {unit}\n")  # fmt: skip
    results = {config: _median_run(config, model, args.world, args.steps, args.device, args.repeat) for config in args.only}
    table = _table(results)
    headers = ["config", "peak MiB/rank", f"vs {BASELINE}", *(f"{p} peak" for p in PHASES), "opt state MiB/rank", "ms/step"]
    print()
    print(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
    print("\n(max over ranks; phase peaks: the highest the process reached during that phase, over all steps.)")
    _targets(results, args.world)
    sweep = _sweep(args) if args.sweep else []
    sweep_headers = ["model", "params", "world", "fxzero peak", "DDP gabv + compile peak", "saving MiB (vs ideal)",
                     "opt state fxzero / DDP", "fxzero ms", "DDP gabv + compile ms", "time ratio"]  # fmt: skip
    if sweep:
        print("\n## scale sweep: fxzero (Inductor) vs DDP gabv + compile\n")
        print(tabulate(sweep, headers=sweep_headers, tablefmt="github", disable_numparse=True))
        print("\n(ideal saving: (1 - 1/world) of DDP's AdamW state; ms: median step time of the slower rank, steps 2+, one run.)")
    table_model = f"GPT {model.name} (dim {model.dim}, {model.n_layer} layers)"
    cond = plotting.conditions(args.world, f"{table_model}, seq {model.seq}, batch {model.batch}/rank, AdamW",
                               device=args.device, note=args.note)
    title = "Peak memory per rank: fxzero vs DDP, ZeroRedundancyOptimizer and FSDP2"
    results_path = Path(args.results or Path(args.png).with_suffix(".json"))
    plotting.write_results(results_path, title, cond, table_model=table_model, measure=unit, headers=headers, table=table,
                           sweep_headers=sweep_headers, sweep=sweep)
    _plot(plotting.read_results(results_path), args.png)


if __name__ == "__main__":
    main()
