"""fxzero vs its peers on one small GPT, all in one run (CPU/gloo or CUDA/NCCL, 2 ranks).

    python benchmarks/compare.py [--world 2] [--steps 20] [--warmup 5] [--rounds 1] [--only CONFIG ...] [--png FILE]

Every config trains the GPT of ``examples/train_gpt.py`` (3.25M params, vocab 256, dim 256,
4 layers, 4 heads, tied embedding/head; seq 128, batch 8 per rank, the same stdlib-bytes
batches and seed) with AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on matrices):

* **fxzero**: ``DistributedOptimizer(..., Config(bucket_size=--bucket-size), module=model)``
  + ``torch.compile(model, backend="fxzero")`` (Inductor inside); **fxzero eager-inner**:
  the same with ``options={"inner_compiler": "eager"}``;
* **DDP eager**, **DDP + compile** (``torch.compile(DDP(model))``, DDPOptimizer), full AdamW;
* **DDP + ZeRO**: eager ``DDP`` + ``ZeroRedundancyOptimizer(AdamW)``;
* **FSDP2** / **FSDP2 + compile**: ``fully_shard`` on each block and the root,
  ``reshard_after_forward=False``, eager or ``torch.compile(model)``;
* **limit**: the compiled (Inductor) model's forward + backward alone, no communication,
  no optimizer: the physical floor fxzero's step is compared with.

Each config runs in a fresh pool of ranks (``fxzero.testing``; 1 CPU thread per rank) so
peak RSS is its own; every pool first compiles a tiny function (Inductor's start-up), and
every config compiles into a fresh Inductor cache (cold compile). A step is forward +
backward + optimizer step + zero_grad, timed on each rank after a barrier; a step's time
is the slower rank's. The table shows the median over ``--steps`` timed steps after
``--warmup`` untimed ones, and the spread (p10-p90). The machine may be shared: ``--rounds
3`` reruns every config in rotated order and prints each round's ratio; trust a verdict
only if it holds in every round. Collectives and their bytes are counted with
``torch.profiler`` (``c10d::*`` ops, including those DDP's C++ reducer issues) over one
steady cycle (from after a warm-up forward to after the next forward, untimed); bytes are payload sizes (all-reduce and reduce-scatter input, all-gather
output; tensor lists are counted as fp32). The parity column is the loss after the last
step minus a single-process eager run of the same global batches.
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

LR, BETAS, PER_RANK = 2e-3, (0.9, 0.95), 8
CONFIGS = ("fxzero", "fxzero eager-inner", "DDP eager", "DDP + compile", "DDP + ZeRO", "FSDP2", "FSDP2 + compile", "limit")
BASELINE = "DDP + compile"


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


class _NoOptimizer:
    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _build(config: str, model: torch.nn.Module, bucket_size: int):
    """(callable model, optimizer, () -> optimizer-state bytes on this rank)."""
    AdamW = torch.optim.AdamW
    if config.startswith("fxzero"):
        cfg = fxzero.Config(bucket_size=bucket_size)
        opt = fxzero.DistributedOptimizer(_param_groups(model), AdamW, lr=LR, betas=BETAS, config=cfg, module=model)
        options = {"inner_compiler": "eager"} if config == "fxzero eager-inner" else {}
        return torch.compile(model, backend="fxzero", options=options), opt, lambda: opt.state_bytes
    if config == "limit":
        return torch.compile(model), _NoOptimizer(), lambda: 0
    if config.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = AdamW(_param_groups(model), lr=LR, betas=BETAS)
        return (torch.compile(model) if "compile" in config else model), opt, lambda: _state_nbytes(opt.state)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if config.startswith("DDP + ZeRO"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(_param_groups(model), optimizer_class=AdamW, lr=LR, betas=BETAS)
        return ddp, opt, lambda: _state_nbytes(opt.optim.state)
    opt = AdamW(_param_groups(model), lr=LR, betas=BETAS)
    return (torch.compile(ddp) if "compile" in config else ddp), opt, lambda: _state_nbytes(opt.state)


def _payload(event) -> int:
    """Bytes of a c10d op's payload: its largest tensor among the first two arguments."""
    sizes = []
    for shape, dtype in zip(event.structured_input_shapes[:2], event.input_dtypes[:2]):
        shapes = shape if shape and isinstance(shape[0], list) else [shape]
        itemsize = 4 if dtype in ("TensorList", "") else torch.empty(0, dtype=_DTYPES.get(dtype, torch.float32)).element_size()
        sizes.append(sum(itemsize * _numel(s) for s in shapes if s))
    return max(sizes, default=0)


_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "unsigned char": torch.uint8, "double": torch.float64}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@contextlib.contextmanager
def _count_collectives(out: dict):
    """Count c10d ops and their bytes (the profiler's start/stop banners on fd 2 are muted)."""
    from torch.profiler import ProfilerActivity, profile

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(devnull)
    for event in prof.events():
        if event.name.startswith("c10d::") and "barrier" not in event.name:
            op = event.name[len("c10d::"):].strip("_").replace("_base", "")
            out["collectives"][op] += 1
            out["bytes"] += _payload(event)


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


def _instrument_fxzero(stack: contextlib.ExitStack, out: dict, launches: list) -> None:
    """Time fxzero's passes vs Inductor's compile_fx_inner; record reduce-scatter launch times."""
    for name, key in (("run_forward_passes", "passes"), ("run_backward_passes", "passes"), ("_inner_compile", "inductor")):
        stack.enter_context(_patched(fxzero.backend, name, _timer(out["compile"], key)))
    record = lambda launch: lambda sync, i: launches.append((i, time.perf_counter())) or launch(sync, i)  # noqa: E731
    stack.enter_context(_patched(GradSync, "_launch", record))


def _prewarm() -> None:
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        torch.compile(lambda x: (x * 2).sum())(torch.randn(8))


def _train(config: str, steps: int, warmup: int, bucket_size: int) -> dict:
    from torch._inductor.utils import fresh_cache

    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    batch = types.SimpleNamespace(seq=128, global_batch=PER_RANK * world)
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    out = {"times": [], "losses": [], "collectives": collections.Counter(), "bytes": 0, "compile": {}, "rooms": []}
    launches: list = []
    with fresh_cache(), contextlib.ExitStack() as patches:
        if config == "fxzero":
            _instrument_fxzero(patches, out, launches)
        cmodel, opt, state_bytes = _build(config, model, bucket_size)
        with contextlib.ExitStack() as counting:
            for step in range(1, warmup + steps + 2):
                x, y = get_batch(data, step, batch, rank, world, torch.device("cpu"))
                dist.barrier()
                launches.clear()
                start = time.perf_counter()
                loss = cmodel(x, y)
                backward_start = time.perf_counter()
                if step == warmup + 1:  # a whole steady cycle: backward, step, zero_grad, next forward
                    counting.close()
                elif step == warmup:
                    counting.enter_context(_count_collectives(out))
                loss.backward()
                backward_end = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                if step > warmup + 1:  # share of backward still ahead when each bucket launched
                    out["rooms"].append({i: (backward_end - at) / (backward_end - backward_start) for i, at in launches})
                if step == 1:
                    out["first"] = elapsed
                if step > warmup + 1:  # the profiled steps are not timed
                    out["times"].append(elapsed)
                total = loss.detach().clone()
                dist.all_reduce(total)
                out["losses"].append(total.item() / world)
    out["state_bytes"] = state_bytes()
    if config == "fxzero":
        names = {id(p): n for n, p in model.named_parameters()}
        out["buckets"] = [(b.index, len(b.params), b.grad_data.numel(), _span([names[id(p)] for p in b.params])) for b in opt.buckets]
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return out


def _span(names: list[str]) -> str:
    """Which parts of the model a bucket's params come from, e.g. 'blocks 0,1,2,3 + norm'."""
    blocks = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    other = sorted({n.split(".")[0] for n in names if not n.startswith("layers.")})
    return " + ".join(([f"blocks {','.join(map(str, blocks))}"] if blocks else []) + other)


# ---- in the parent ----------------------------------------------------------------------
def _reference_losses(steps: int, world: int) -> list[float]:
    """Single-process eager AdamW on the same global batches (the parity column)."""
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    batch = types.SimpleNamespace(seq=128, global_batch=PER_RANK * world)
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    opt = torch.optim.AdamW(_param_groups(model), lr=LR, betas=BETAS)
    losses = []
    for step in range(1, steps + 1):
        x, y = get_batch(data, step, batch, 0, 1, torch.device("cpu"))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _steps_ms(res: list[dict]) -> list[float]:
    """Per step, the slower rank's time (a step ends when its last rank does), in ms."""
    return [1e3 * max(values) for values in zip(*(r["times"] for r in res))]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_all(args: argparse.Namespace) -> tuple[dict, dict]:
    results: dict[str, object] = {}
    per_round: dict[str, list[float]] = {c: [] for c in args.only}
    for round_ in range(args.rounds):
        shift = round_ % len(args.only)
        for config in args.only[shift:] + args.only[:shift]:
            if isinstance(results.get(config), str):
                continue
            start = time.perf_counter()
            try:
                run_ranks(args.world, _prewarm, timeout=600)
                res = run_ranks(args.world, _train, config, args.steps, args.warmup, args.bucket_size, timeout=1800)
                per_round[config].append(statistics.median(_steps_ms(res)))
                if config in results:
                    for old, new in zip(results[config], res):
                        old["times"] += new["times"]
                        old["rooms"] += new["rooms"]
                        old["rss_mib"] = max(old["rss_mib"], new["rss_mib"])
                else:
                    results[config] = res
            except Exception as exc:  # noqa: BLE001 - a config that cannot run still gets its row
                lines = [line for line in str(exc).splitlines() if line.strip()]
                results[config] = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
            finally:
                close_pools()
            print(f"  round {round_ + 1}: {config} took {time.perf_counter() - start:.0f} s", flush=True)
    return {c: results[c] for c in args.only}, per_round


def _rows(results: dict, reference: list[float]) -> tuple[list[list[str]], dict[str, float]]:
    medians = {c: statistics.median(_steps_ms(r)) for c, r in results.items() if not isinstance(r, str)}
    base, floor = medians.get(BASELINE), medians.get("limit")
    rows = []
    for config, res in results.items():
        if isinstance(res, str):
            rows.append([config, f"FAILED: {res}"] + [""] * 10)
            continue
        ms = _steps_ms(res)
        counts = res[0]["collectives"]
        coll = f"{sum(counts.values())} (" + " + ".join(f"{n} {op}" for op, n in sorted(counts.items())) + ")" if counts else "0"
        loss = res[0]["losses"][-1]
        rows.append([
            config, f"{medians[config]:.1f}", f"{_quantile(ms, 0.1):.1f}-{_quantile(ms, 0.9):.1f}",
            f"{medians[config] / base:.3f}" if base else "n/a", f"{medians[config] / floor:.3f}" if floor else "n/a",
            f"{max(r['state_bytes'] for r in res) / 2**20:.2f}", f"{max(r['rss_mib'] for r in res):.0f}", coll,
            f"{res[0]['bytes'] / 2**20:.2f}", f"{max(r['first'] for r in res) - medians[config] / 1e3:.1f}",
            "n/a (no optimizer)" if config == "limit" else f"{loss:.4f} ({loss - reference[-1]:+.1e})",
        ])
    return rows, medians


def _targets(results: dict, medians: dict, per_round: dict, world: int) -> None:
    if "fxzero" not in medians:
        print("\nfxzero did not run: no targets checked.")
        return
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print("\n## targets\n")
    for other, limit in ((BASELINE, 0.95), ("DDP + ZeRO", 0.9), ("limit", 1.15)):
        if other not in medians:
            print(f"fxzero vs {other}: {other} did not run")
            continue
        ratio = medians["fxzero"] / medians[other]
        rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(per_round["fxzero"], per_round[other]))
        print(f"fxzero step time = {ratio:.3f}x {other} (target <= {limit}x): {verdict(ratio <= limit)}  [per round: {rounds}]")
    if BASELINE in medians:
        plain = max(r["state_bytes"] for r in results[BASELINE])
        ratio = max(r["state_bytes"] for r in results["fxzero"]) / (plain / world)
        print(f"fxzero optimizer state = {ratio:.6f} x (plain AdamW / {world}) (target <= 1.01): {verdict(ratio <= 1.01)}")
    fx = results["fxzero"]
    comp = {k: max(r["compile"].get(k, 0.0) for r in fx) for k in ("passes", "inductor")}
    share = comp["passes"] / max(1e-9, comp["inductor"])
    print(f"fxzero passes: {1e3 * comp['passes']:.1f} ms vs {1e3 * comp['inductor']:.0f} ms in Inductor's compile_fx_inner "
          f"= +{share:.2%} compile time (target < 10%): {verdict(share < 0.10)}")
    _overlap_room(fx, world)


def _overlap_room(fx: list[dict], world: int) -> None:
    print("\n## fxzero overlap room per bucket (share of backward still ahead when its reduce-scatter launches)\n")
    rows = []
    for index, n_params, numel, span in fx[0]["buckets"]:
        rooms = [step[index] for r in fx for step in r["rooms"] if index in step]
        tail = [f"{statistics.median(rooms):.1%}", f"{min(rooms):.1%}", f"{max(rooms):.1%}"] if rooms else ["never in backward", "", ""]
        rows.append([index, n_params, f"{numel:,}", span, *tail])
    print(tabulate(rows, headers=["bucket", "params", "elements", "params from", "median room", "min", "max"],
                   tablefmt="github", disable_numparse=True))
    print(f"\n(over {len(fx[0]['rooms'])} timed steps x {world} ranks; ~0% = launched at the end of backward: no overlap.)")


def _plot(rows: list[list[str]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib not installed: no {path}; `pip install -e .[bench]`)")
        return
    ok = [r for r in rows if not r[1].startswith("FAILED")]
    names = [r[0] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.barh(names, [float(r[1]) for r in ok], color="tab:blue")
    ax1.set_xlabel("median step time (ms)")
    ax2.barh(names, [float(r[6]) for r in ok], color="tab:orange", label="peak RSS")
    ax2.barh(names, [float(r[5]) for r in ok], color="tab:green", label="optimizer state")
    ax2.set_xlabel("MiB per rank")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (>= 3; the last one is profiled)")
    p.add_argument("--rounds", type=int, default=1, help="run every config this many times (order rotated)")
    p.add_argument("--only", nargs="+", default=list(CONFIGS), choices=CONFIGS, metavar="CONFIG", help=f"subset of {CONFIGS}")
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="fxzero's Config.bucket_size (elements)")
    p.add_argument("--png", default="compare.png", help="where to write the chart (needs matplotlib)")
    args = p.parse_args()
    if args.warmup < 3 or args.steps < 1 or args.rounds < 1 or args.world < 2:
        p.error("need --warmup >= 3, --steps >= 1, --rounds >= 1 and --world >= 2")
    n_params = sum(p.numel() for p in Transformer(ModelArgs()).parameters())
    print(f"# fxzero vs peers: torch {torch.__version__}, gloo, {args.world} ranks x 1 thread, GPT {n_params:,} params, "
          f"seq 128, batch {PER_RANK}/rank, fxzero bucket_size {args.bucket_size:,}; {args.rounds} round(s) x ({args.warmup} warm-up + {args.steps} timed steps)\n")
    results, per_round = _run_all(args)
    reference = _reference_losses(args.warmup + args.steps + 1, args.world)
    rows, medians = _rows(results, reference)
    headers = ["config", "median ms", "p10-p90 ms", f"vs {BASELINE}", "vs limit", "opt state MiB/rank", "peak RSS MiB/rank",
               "collectives/step", "MiB comm/step", "1st-step extra s", "final loss (vs eager)"]
    print()
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    print(f"\n(final loss after {args.warmup + args.steps + 1} steps, mean over ranks; in parentheses minus single-process "
          f"eager AdamW on the same global batches, {reference[-1]:.4f}. 1st-step extra: step 1 minus the median step, "
          "mostly compile. MiB comm: collective payloads of rank 0 in one step. Peak RSS: whole process.)")
    _targets(results, medians, per_round, args.world)
    _plot(rows, args.png)


if __name__ == "__main__":
    main()
