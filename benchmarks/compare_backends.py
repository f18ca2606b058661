"""fxzero vs DDP + torch.compile, DDP + ZeRO and FSDP2 on one small GPT (CPU, gloo, 2 ranks).

    python benchmarks/compare_backends.py [--steps N] [--warmup W] [--rounds R] [--warm-cache]

Every config trains the GPT of ``examples/train_gpt.py`` (3.25M params, vocab 256, dim 256,
4 layers, 4 heads, tied embedding/head; seq 128, batch 8 per rank, the same stdlib-bytes
batches and seed) with AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on matrices):

1. **fxzero**: ``fxzero.DistributedOptimizer(..., Config(bucket_size=1_000_000))`` and
   ``torch.compile(model, backend="fxzero")`` (Inductor inside);
2. **DDP + compile**: ``torch.compile(DDP(model))`` (Inductor, DDPOptimizer), full AdamW;
3. **DDP + ZeRO**: eager ``DDP(model)`` and ``ZeroRedundancyOptimizer(AdamW)``, no overlap;
4. **FSDP2**: eager ``fully_shard`` on each block and the root, ``reshard_after_forward=False``.

Each config runs in a fresh pool of 2 gloo ranks (``fxzero.testing``; 1 thread per rank):
``ru_maxrss`` is a per-process high-water mark, so sharing processes would hand one row's
peak to the next. Each pool first compiles a tiny function (imports Inductor and starts
its compile workers, for every row alike). By default every config compiles into its own
fresh, empty Inductor cache (cold compile); ``--warm-cache`` uses the default cache dir.

A step is forward + backward + optimizer step + zero_grad, timed on each rank after a
barrier; a step's time is the slower rank's, and the table shows the **median over the
timed steps** after ``--warmup`` untimed ones (the machine may be shared: medians and
warm-up keep other load out of the numbers as far as possible, not entirely; load drifts
between configs too, so ``--rounds 3`` reruns every config in rotated order, pools the steps
and prints each round's ratio: trust a verdict only if it holds in every round).
Collectives per step are counted with ``torch.profiler`` (``c10d::*`` ops, which include
the ones DDP's C++ reducer issues) on the last warm-up step. For fxzero it also reports
the time in fxzero's graph passes vs Inductor's compile, and per bucket the "overlap
room": the fraction of backward still ahead when the bucket's reduce-scatter launches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import resource
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ModelArgs, Transformer, get_batch, load_bytes  # noqa: E402

import fxzero  # noqa: E402
import fxzero.backend  # noqa: E402
from fxzero.runtime.grad_sync import GradSync  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

WORLD, LR, BETAS, BUCKET = 2, 2e-3, (0.9, 0.95), 1_000_000
BATCH = types.SimpleNamespace(seq=128, global_batch=8 * WORLD)  # what get_batch reads
CONFIGS = ("fxzero", "DDP + compile", "DDP + ZeRO", "FSDP2")
BASELINE = "DDP + compile"
PHASES = ("forward", "backward", "opt.step", "zero_grad")


# ---- on every rank ----------------------------------------------------------------------
def _param_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())  # the tied weight appears once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _state_nbytes(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    values = (v.to_local() if isinstance(v, DTensor) else v for s in state.values() for v in s.values())
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def _build(config: str, model: torch.nn.Module):
    """(callable model, optimizer, () -> optimizer-state bytes on this rank)."""
    AdamW = torch.optim.AdamW
    if config == "fxzero":
        opt = fxzero.DistributedOptimizer(
            _param_groups(model), AdamW, lr=LR, betas=BETAS, config=fxzero.Config(bucket_size=BUCKET), module=model
        )
        return torch.compile(model, backend="fxzero"), opt, lambda: opt.state_bytes
    if config == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = AdamW(_param_groups(model), lr=LR, betas=BETAS)
        return model, opt, lambda: _state_nbytes(opt.state)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if config == "DDP + compile":
        opt = AdamW(_param_groups(model), lr=LR, betas=BETAS)
        return torch.compile(ddp), opt, lambda: _state_nbytes(opt.state)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(_param_groups(model), optimizer_class=AdamW, lr=LR, betas=BETAS, overlap_with_ddp=False)
    return ddp, opt, lambda: _state_nbytes(opt.optim.state)


@contextlib.contextmanager
def _patched(owner, name: str, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _timer(acc: dict, key: str):
    def make(fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - start

        return timed

    return make


@contextlib.contextmanager
def _count_collectives(counts: collections.Counter):
    """Count c10d ops issued inside (the profiler's start/stop banners on fd 2 are muted)."""
    from torch.profiler import ProfilerActivity, profile

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(devnull)
    for event in prof.events():
        if event.name.startswith("c10d::"):
            counts[event.name[len("c10d::"):].strip("_").replace("_base", "")] += 1


def _prewarm() -> None:
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        torch.compile(lambda x: (x * 2).sum())(torch.randn(8))


def _train(config: str, steps: int, warmup: int, cold: bool) -> dict:
    from torch._inductor.utils import fresh_cache

    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    torch.manual_seed(0)
    model = Transformer(ModelArgs())  # vocab 256, seq 128, dim 256, 4 layers, 4 heads, tied
    out = {"times": [], "phases": [], "losses": [], "compile": {}, "rooms": [], "collectives": collections.Counter()}
    launches: list = []
    with contextlib.ExitStack() as stack:
        if cold:
            stack.enter_context(fresh_cache())
        if config == "fxzero":  # time fxzero's passes and Inductor; record bucket launches
            for name, key in (("run_forward_passes", "passes"), ("run_backward_passes", "passes"), ("_inner_compile", "inductor")):
                stack.enter_context(_patched(fxzero.backend, name, _timer(out["compile"], key)))
            record = lambda launch: lambda sync, i: launches.append((i, time.perf_counter())) or launch(sync, i)  # noqa: E731
            stack.enter_context(_patched(GradSync, "_launch", record))
        cmodel, opt, state_bytes = _build(config, model)
        for step in range(1, warmup + steps + 1):
            x, y = get_batch(data, step, BATCH, rank, world, torch.device("cpu"))
            dist.barrier()
            launches.clear()
            with _count_collectives(out["collectives"]) if step == warmup else contextlib.nullcontext():
                t = [time.perf_counter()]
                loss = cmodel(x, y)
                t.append(time.perf_counter())
                loss.backward()
                t.append(time.perf_counter())
                opt.step()
                t.append(time.perf_counter())
                opt.zero_grad(set_to_none=True)
                t.append(time.perf_counter())
            if step == 1:
                out["first"] = [t[-1] - t[0]]
            if step > warmup:
                out["times"].append(t[-1] - t[0])
                out["phases"].append([b - a for a, b in zip(t, t[1:])])
                out["losses"].append(loss.item())
                out["rooms"].append({i: (t[2] - at) / (t[2] - t[1]) for i, at in launches})
        out["state_bytes"] = state_bytes()
        if config == "fxzero":
            names = {id(p): n for n, p in model.named_parameters()}
            out["buckets"] = [(b.index, len(b.params), b.grad_data.numel(), _span([names[id(p)] for p in b.params]))
                              for b in opt.buckets]
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return out


def _span(names: list[str]) -> str:
    """Which parts of the model a bucket's params come from, e.g. 'blocks 0,1,2,3 + norm'."""
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    other = sorted({n.split(".")[0] for n in names if not n.startswith("layers.")})
    return " + ".join(([f"blocks {','.join(map(str, blocks))}"] if blocks else []) + other)


# ---- in the parent ----------------------------------------------------------------------
def _worst_rank(results: list[dict], key: str) -> list:
    """Per step, the slower rank's value (a step ends when its last rank does)."""
    return [max(values) for values in zip(*(r[key] for r in results))]


def _median_ms(values) -> float:
    return 1e3 * statistics.median(values)


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    """Pool another round's timed steps into the first round's per-rank results."""
    for o, n in zip(old, new):
        for key in ("times", "phases", "losses", "rooms", "first"):
            o[key] += n[key]
        o["rss_mib"] = max(o["rss_mib"], n["rss_mib"])
    return old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (>= 3: compile, DDP bucket rebuild; the last one is profiled)")
    p.add_argument("--rounds", type=int, default=1, help="run every config this many times (order rotated); steps are pooled")
    p.add_argument("--warm-cache", action="store_true", help="use the default Inductor cache instead of a fresh one")
    args = p.parse_args()
    if args.warmup < 3 or args.steps < 1 or args.rounds < 1:
        p.error("need --warmup >= 3, --steps >= 1 and --rounds >= 1")

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache = Path(cache_dir())
    entries = len(list(cache.iterdir())) if cache.is_dir() else 0
    cache_note = (f"default cache {cache} ({entries} entries: {'warm' if entries else 'cold'})" if args.warm_cache else
                  f"a fresh empty cache per config: cold compile (the default cache {cache} has {entries} entries, unused)")
    n_params = sum(p.numel() for p in Transformer(ModelArgs()).parameters())
    print(f"# fxzero vs DDP+compile / DDP+ZeRO / FSDP2 — torch {torch.__version__}, gloo, {WORLD} ranks x 1 thread")
    print(f"GPT {n_params:,} params, seq {BATCH.seq}, batch {BATCH.global_batch // WORLD}/rank; "
          f"{args.rounds} round(s) x ({args.warmup} warm-up + {args.steps} timed steps) per config; Inductor: {cache_note}.\n")

    results: dict[str, object] = {}
    per_round: dict[str, list[float]] = {c: [] for c in CONFIGS}  # each round's median step (ms)
    for round_ in range(args.rounds):
        for config in CONFIGS[round_ % len(CONFIGS):] + CONFIGS[: round_ % len(CONFIGS)]:
            if isinstance(results.get(config), str):
                continue
            start = time.perf_counter()
            try:
                run_ranks(WORLD, _prewarm, timeout=600)
                res = run_ranks(WORLD, _train, config, args.steps, args.warmup, not args.warm_cache, timeout=1800)
                per_round[config].append(_median_ms(_worst_rank(res, "times")))
                results[config] = _merge(results[config], res) if config in results else res
            except Exception as exc:  # noqa: BLE001 - a config that cannot run still gets its row
                lines = [line for line in str(exc).splitlines() if line.strip()]
                results[config] = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
            finally:
                close_pools()
            print(f"  round {round_ + 1}: ran {config} in {time.perf_counter() - start:.0f} s", flush=True)
    results = {c: results[c] for c in CONFIGS}

    medians = {c: _median_ms(_worst_rank(r, "times")) for c, r in results.items() if not isinstance(r, str)}
    base = medians.get(BASELINE)
    rows, phase_rows = [], []
    for config, res in results.items():
        if isinstance(res, str):
            rows.append([config, f"FAILED: {res}"] + [""] * 8)
            continue
        steps = _worst_rank(res, "times")
        counts = res[0]["collectives"]
        coll = f"{sum(counts.values())} (" + " + ".join(f"{n} {op}" for op, n in sorted(counts.items())) + ")"
        first = statistics.median(map(max, zip(*(r["first"] for r in res))))  # slower rank, median over rounds
        rows.append([config, f"{medians[config]:.1f}", f"{1e3 * min(steps):.1f}", f"{medians[config] / base:.3f}" if base else "n/a",
                     f"{max(r['state_bytes'] for r in res) / 2**20:.2f}", f"{max(r['rss_mib'] for r in res):.0f}", coll,
                     f"{first - medians[config] / 1e3:.1f}", f"{statistics.mean(r['losses'][-1] for r in res):.4f}"])
        phases = list(zip(*[[max(v) for v in zip(*ph)] for ph in zip(*(r["phases"] for r in res))]))
        phase_rows.append([config] + [f"{_median_ms(ph):.1f}" for ph in phases])
    headers = ["config", "median step ms", "min ms", f"vs {BASELINE}", "opt state MiB/rank", "peak RSS MiB",
               "collectives/step", "1st-step overhead s", "final loss"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    print("\n(collectives: c10d ops on rank 0 counted by torch.profiler in one step; DDP's are issued by its C++ "
          "reducer; gloo runs reduce-scatter as all-reduce. Peak RSS: max over ranks, whole process incl. "
          "torch + Inductor; 1st-step overhead: step 1 wall time minus the median step, i.e. mostly compile.)\n")
    print("## median per-phase time (ms, slower rank per step)\n")
    print(tabulate(phase_rows, headers=["config", *PHASES], tablefmt="github", disable_numparse=True))

    fx = results.get("fxzero")
    if isinstance(fx, str) or fx is None:
        print("\nfxzero did not run: no targets checked.")
        return
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print("\n## targets\n")
    for other, limit in ((BASELINE, 0.95), ("DDP + ZeRO", 0.9)):
        if other in medians:
            ratio = medians["fxzero"] / medians[other]
            rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(per_round["fxzero"], per_round[other]))
            print(f"fxzero step time = {ratio:.3f}x {other} (target <= {limit}x): {verdict(ratio <= limit)}  [per round: {rounds}]")
        else:
            print(f"fxzero vs {other}: {other} did not run")
    plain = max(r["state_bytes"] for r in results[BASELINE]) if BASELINE in medians else None
    if plain:
        ratio = max(r["state_bytes"] for r in fx) / (plain / WORLD)
        print(f"fxzero optimizer state = {ratio:.6f} x (plain AdamW / {WORLD}) (target <= 1.01): {verdict(ratio <= 1.01)}")
    comp = {k: max(r["compile"].get(k, 0.0) for r in fx) for k in ("passes", "inductor")}
    total = max(r["first"][0] for r in fx) - medians["fxzero"] / 1e3  # round 1, whose compile was timed
    share = comp["passes"] / (comp["passes"] + comp["inductor"])
    print(f"fxzero passes' share of compile time = {1e3 * comp['passes']:.1f} ms / ({1e3 * comp['passes']:.1f} ms + "
          f"{1e3 * comp['inductor']:.0f} ms in Inductor compile_fx_inner) = {share:.2%} "
          f"({comp['passes'] / total:.2%} of the whole {total:.1f} s first-step overhead) (target < 10%): {verdict(share < 0.10)}")
    losses = {c: statistics.mean(r["losses"][-1] for r in res) for c, res in results.items() if not isinstance(res, str)}
    print(f"final losses agree within {max(losses.values()) - min(losses.values()):.4f} (max - min over configs)")

    print("\n## fxzero overlap room per bucket (share of backward still ahead at the reduce-scatter launch)\n")
    room_rows = []
    for index, n_params_b, numel, span in fx[0]["buckets"]:
        rooms = [step[index] for r in fx for step in r["rooms"] if index in step]
        if not rooms:
            room_rows.append([index, n_params_b, f"{numel:,}", span, "never launched in backward", "", ""])
            continue
        room_rows.append([index, n_params_b, f"{numel:,}", span, f"{statistics.median(rooms):.1%}", f"{min(rooms):.1%}", f"{max(rooms):.1%}"])
    print(tabulate(room_rows, headers=["bucket", "params", "elements", "params from", "median room", "min", "max"],
                   tablefmt="github", disable_numparse=True))
    print(f"\n(over {len(fx[0]['rooms'])} timed steps x {WORLD} ranks; room = (backward end - launch) / (backward end - backward start);"
          " ~0% means launched at the end of backward, i.e. no overlap.)")


if __name__ == "__main__":
    main()
