"""Per-graph overhead: a model whose forward graph-breaks in every block.

Run it from the repository root (one process, world size 1, CPU, Inductor; ~2 minutes):

    python benchmarks/graph_overhead.py [--blocks 8] [--steps 60] [--device cpu|cuda [--sync-phases]] [--breakdown] [--timers] [--ops]

A toy of ``--blocks`` small residual blocks with a graph break after each: Dynamo compiles
``Block.forward`` once and calls that graph once per block, so any Python the backend adds
per graph call (binding lookups, op dispatch, counting) is paid ``blocks`` times per
forward and again per backward. Two configurations step in turn in the same process, so
the machine's drift hits both alike:

* ``plain``: ``torch.compile(model)`` (Inductor) + ``torch.optim.AdamW``;
* ``fxzero``: ``fxzero.DistributedOptimizer(AdamW)`` + ``torch.compile(backend="fxzero")``.

It prints median step times, their ratio, how many AOT compiles each made, the extra
microseconds per graph call (from the forward and backward phases' medians: ``step()`` is
compared apart, since fxzero's flat update makes it faster than plain AdamW's and would
hide the graphs' cost in the whole step's), each phase's median (forward, backward, ``step()``,
``zero_grad()``) for both configs, and (``--breakdown``) where fxzero's per-graph time goes:
a cProfile of the fxzero steps, inclusive time of each runtime entry point per graph call
(the profiler slows Python down, so read the shares, not the absolute values), (``--timers``)
the wall-clock microseconds per step spent in each entry point, both configs stepping in turn
again (``perf_counter`` around each call, ~0.2 µs of its own per call), and (``--ops``) the
ops and CUDA runtime calls one config makes more often than the other.
Target: fxzero <= 1.15x plain.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from typing import Callable
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim.adam as torch_adam
from tabulate import tabulate

import fxzero
from fxzero.graph_compiler import GraphCompiler
from fxzero.optim.gradients import grad_sync
from fxzero.compiled.binding import GraphBinding
from fxzero.optim.gradients.grad_views import GradViews
from fxzero.optim.gradients.ledger import Ledger
from fxzero.optim.params.param_watch import ParamWatch
from fxzero.optim.gradients.reduced_grads import ReducedGrads
from fxzero.runtime import Runtime


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, blocks: int, dim: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x


PHASES = ("forward", "backward", "step", "zero_grad")


def _configs(
    blocks: int, phases: dict[str, dict[str, list[float]]], device: str, sync_phases: bool = False
) -> dict[str, Callable[[torch.Tensor], float]]:
    """Each config: a function running one training step on a batch, appending each
    phase's seconds to ``phases[config][phase]``. On a GPU these are the host's launch
    times (the step's ``loss.item()`` waits for the kernels, and fxzero's ``step()`` syncs
    once for its norm, so it waits for queued backward kernels) unless ``sync_phases``
    synchronizes the device at each phase's end."""
    torch.manual_seed(0)
    plain_model, fx_model = Toy(blocks).to(device), Toy(blocks).to(device)
    fx_model.load_state_dict(plain_model.state_dict())
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    fx_opt = fxzero.DistributedOptimizer(fx_model.parameters(), torch.optim.AdamW, lr=1e-3, module=fx_model)
    plain, fx = torch.compile(plain_model), torch.compile(fx_model, backend="fxzero")

    sync = torch.cuda.synchronize if sync_phases and device == "cuda" else (lambda: None)

    def clock() -> float:
        sync()
        return time.perf_counter()

    def step(model: Callable, opt: torch.optim.Optimizer, x: torch.Tensor, times: dict[str, list[float]]) -> float:
        t0 = clock()
        loss = model(x).square().mean()
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        t3 = clock()
        opt.zero_grad()
        t4 = clock()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[phase].append(seconds)
        return loss.item()

    return {
        "plain": lambda x: step(plain, plain_opt, x, phases["plain"]),
        "fxzero": lambda x: step(fx, fx_opt, x, phases["fxzero"]),
    }


def phase_extra(phases: dict[str, dict[str, list[float]]], phase: str, skip: int) -> float:
    """fxzero's median microseconds in ``phase`` minus plain's."""
    plain, fx = (1e6 * statistics.median(phases[c][phase][skip:]) for c in ("plain", "fxzero"))
    return fx - plain


def phase_rows(phases: dict[str, dict[str, list[float]]], skip: int, graph_calls: dict[str, int]) -> list[list[str]]:
    """Median microseconds of each phase per step, both configs, and fxzero's extra per graph call."""
    rows = []
    for phase in PHASES:
        plain, fx = (1e6 * statistics.median(phases[c][phase][skip:]) for c in ("plain", "fxzero"))
        per_graph = f"{(fx - plain) / graph_calls[phase]:.1f}" if graph_calls.get(phase) else "n/a"
        rows.append([phase, f"{plain:.1f}", f"{fx:.1f}", f"{fx - plain:+.1f}", per_graph])
    return rows


# (category, file suffix, function name): inclusive time of these entry points
ENTRY_POINTS = (
    ("pre-hook (eager module entry)", "optim/params/param_sync.py", "__call__"),
    ("fxzero::wait_params (binding + wait)", "fxzero/compiled/ops.py", "wait_params"),
    ("fxzero::grads_ready (binding + add + report)", "fxzero/compiled/ops.py", "grads_ready"),
    ("  of which add into main_grad + report", "optim/gradients/grad_sync.py", "add_compiled"),
    ("    of which the ledger", "optim/gradients/ledger.py", "compiled_grads"),
    ("    of which launching", "optim/gradients/grad_sync.py", "_launch"),
    ("forward counting: the ledger's count", "compiled/binding.py", "forward_ran"),
    ("forward counting: finding the autograd node", "compiled/binding.py", "backward_node"),
    ("eager post-accumulate hooks (no gradient: handed off)", "optim/gradients/grad_sync.py", "hook"),
    ("end of backward (launch rest + grad views)", "optim/gradients/grad_sync.py", "_end_of_backward"),
    ("  of which the .grad views", "optim/gradients/grad_views.py", "install"),
    ("step()", "fxzero/distributed_optimizer.py", "step"),
    ("  of which the global grad norm", "optim/gradients/reduced_grads.py", "total_norm"),
)


def breakdown(step: Callable[[torch.Tensor], float], x: torch.Tensor, steps: int, graph_calls: int) -> list[list[str]]:
    """Profile ``steps`` fxzero steps; each entry point's inclusive microseconds per graph call."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step(x)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    rows = []
    for label, suffix, name in ENTRY_POINTS:
        found = [v for (f, _, n), v in stats.items() if f.endswith(suffix) and n == name]
        calls, cum = sum(v[1] for v in found), sum(v[3] for v in found)
        rows.append([label, str(calls // steps), f"{1e6 * cum / (steps * graph_calls):.1f}"])
    return rows


TIMED = (
    ("forward counting (the ledger's count)", GraphBinding, "forward_ran"),
    ("fxzero::grads_ready's Python (lookup, add, report)", GraphBinding, "grads_ready"),
    ("> adding into main_grad (_foreach_add_)", grad_sync, "foreach_add_"),
    ("> the ledger", Ledger, "compiled_grads"),
    ("> launching", grad_sync.GradSync, "_launch"),
    ("end of backward (launch rest + .grad views)", grad_sync.GradSync, "_end_of_backward"),
    ("> the .grad views", GradViews, "install"),
    ("step()", fxzero.DistributedOptimizer, "step"),
    ("> the update (torch.optim.adam.adam; plain: in its step)", torch_adam, "adam"),
    ("> the global grad norm", ReducedGrads, "total_norm"),
    ("> the checks of the params", ParamWatch, "check"),
    ("> collecting the .grad views", GradViews, "collect"),
    ("ending the step: the grad buffer zeroed, the ledger's next step (in step() and zero_grad())", Runtime, "end_step"),
    ("zero_grad()", fxzero.DistributedOptimizer, "zero_grad"),
)
"""(label, owner, attribute): the calls ``--timers`` clocks; ``>`` marks a part of the row above."""


def timers(blocks: int, steps: int, warmup: int, device: str) -> list[list[str]]:
    """Microseconds per step inside each entry point of :data:`TIMED`, per config, from
    fresh configs stepping in turn (what a call's own clock costs is ~0.2 µs)."""
    totals: dict[tuple[str, str], float] = {}
    current = ["plain"]

    def timed(label: str, fn: Callable) -> Callable:
        def run(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (current[0], label)
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

        return run

    with contextlib.ExitStack() as stack:
        for label, owner, name in TIMED:
            stack.enter_context(mock.patch.object(owner, name, timed(label, getattr(owner, name))))
        configs = _configs(blocks, {c: {p: [] for p in PHASES} for c in ("plain", "fxzero")}, device)
        x = torch.randn(8, 16, 64, device=device)
        for i in range(warmup + steps):
            if i == warmup:
                totals.clear()
            for name, step in configs.items():
                current[0] = name
                step(x)
    return [[label, *(f"{1e6 * totals.get((c, label), 0.0) / steps:.1f}" for c in ("plain", "fxzero"))] for label, *_ in TIMED]


def op_counts(step: Callable[[torch.Tensor], float], x: torch.Tensor) -> dict[str, tuple[int, float]]:
    """Each op's (and, on a GPU, each CUDA runtime call's) calls and self CPU µs in one step,
    from ``torch.profiler``: what a config dispatches or launches that the other does not."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if x.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(x)
    return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}


def op_rows(plain: dict[str, tuple[int, float]], fx: dict[str, tuple[int, float]]) -> list[list[str]]:
    """The ops whose call counts differ between the configs, most extra calls first."""
    per_graph = ("## Call CompiledFxGraph", "Torch-Compiled Region")  # named per compile: never equal
    none = (0, 0.0)
    both = {n: (plain.get(n, none)[0], *fx.get(n, none)) for n in {*plain, *fx} if not n.startswith(per_graph)}
    differ = sorted((n for n, (p, f, _) in both.items() if p != f), key=lambda n: (both[n][0] - both[n][1], n))
    return [[n[:60], str(both[n][0]), str(both[n][1]), f"{both[n][2]:.0f}"] for n in differ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true", help="profile the fxzero steps by runtime entry point")
    parser.add_argument("--timers", action="store_true", help="wall-clock time per step inside each fxzero entry point")
    parser.add_argument("--sync-phases", action="store_true", help="on a GPU, synchronize at each phase's end (device time per phase)")
    parser.add_argument("--ops", action="store_true", help="profile one step of each config: the ops whose counts differ")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and batch live")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.compiler.reset()
    with mock.patch.object(GraphCompiler, "__init__", autospec=True, side_effect=GraphCompiler.__init__) as compiles:
        phases: dict[str, dict[str, list[float]]] = {c: {p: [] for p in PHASES} for c in ("plain", "fxzero")}
        configs = _configs(args.blocks, phases, args.device, args.sync_phases)
        x = torch.randn(8, 16, 64, device=args.device)
        times: dict[str, list[float]] = {name: [] for name in configs}
        losses: dict[str, float] = {}
        for i in range(args.warmup + args.steps):
            for name, step in configs.items():  # in turn: drift hits both alike
                start = time.perf_counter()
                losses[name] = step(x)
                if i >= args.warmup:
                    times[name].append(1e3 * (time.perf_counter() - start))
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [
        [name, f"{medians[name]:.2f}", f"{statistics.quantiles(t, n=10)[0]:.2f}-{statistics.quantiles(t, n=10)[-1]:.2f}",
         f"{medians[name] / medians['plain']:.3f}", f"{losses[name]:.6f}"]
        for name, t in times.items()
    ]  # fmt: skip
    print(tabulate(rows, headers=["config", "median ms/step", "p10-p90 ms", "vs plain", "last loss"], tablefmt="github"))
    print(f"\n{args.blocks} blocks, one graph break per block; fxzero AOT compiles: {compiles.call_count} "
          "(Dynamo graphs: one Block.forward graph serves every block)")  # fmt: skip
    graph_calls = 2 * args.blocks  # each block's forward graph and its backward
    extra = {p: phase_extra(phases, p, args.warmup) for p in PHASES}
    print(f"fxzero adds {(extra['forward'] + extra['backward']) / graph_calls:.1f} us per graph call in forward and backward "
          f"({graph_calls} graph calls per step); its step() takes {extra['step']:+.1f} us against plain AdamW's "
          "(the flat update: fxzero/optim/update/flat_update.py)")  # fmt: skip
    ratio = medians["fxzero"] / medians["plain"]
    print(f"fxzero step time = {ratio:.3f}x plain torch.compile (target <= 1.15x): {'PASS' if ratio <= 1.15 else 'FAIL'}")
    per_phase = {"forward": args.blocks, "backward": args.blocks}  # graph calls in each phase
    print("\nwhere the time goes, per phase (median us per step, the same steps as above):")
    print(tabulate(phase_rows(phases, args.warmup, per_phase), headers=["phase", "plain", "fxzero", "fxzero extra", "extra per graph call"], tablefmt="github"))
    if args.breakdown:
        rows = breakdown(configs["fxzero"], x, args.steps, graph_calls)
        print("\nwhere fxzero's per-graph time goes (cProfile, inclusive; the profiler inflates Python time):")
        print(tabulate(rows, headers=["entry point", "calls/step", "us per graph call"], tablefmt="github"))
    if args.timers:
        rows = timers(args.blocks, args.steps, args.warmup, args.device)
        print("\nwall-clock us per step inside each entry point (perf_counter around each call; fresh configs, in turn):")
        print(tabulate(rows, headers=["entry point", "plain", "fxzero"], tablefmt="github"))
    if args.ops:
        counts = {name: op_counts(step, x) for name, step in configs.items()}
        print("\nops and runtime calls whose counts differ in one step (torch.profiler; self CPU us of fxzero's):")
        print(tabulate(op_rows(counts["plain"], counts["fxzero"]), headers=["op", "plain calls", "fxzero calls", "fxzero self us"], tablefmt="github"))


if __name__ == "__main__":
    main()
