"""fxzero + TP vs FSDP2 + TP on the same (dp 2 x tp 2) DeviceMesh, in one run.

    python benchmarks/tp.py [--steps 30] [--warmup 3] [--compile]

Both configs train the GPT of ``examples/train_gpt.py`` (3.25M params, dim 256, 4 layers,
4 heads, tied embedding/head; seq 128, 8 sequences per dp rank, the same stdlib-bytes batches
and seed), tensor-parallel over ``mesh["tp"]`` with the example's own plan
(``train_gpt.parallelize``: wqkv and w1 ColwiseParallel, wo and w2 RowwiseParallel; the
embeddings, head and LayerNorms replicated), with AdamW (lr 2e-3, betas 0.9/0.95, weight
decay 0.1 on matrices), no clipping; eager, or with ``--compile`` each under Inductor as its users
compile it:

* **fxzero + TP**: ``fxzero.DistributedOptimizer(..., process_group=mesh["dp"], module=model,
  config=Config(bucket_size=1_000_000))``: ZeRO-1 over dp (reduce-scatter, shard update,
  all-gather inside ``step()``); compiled: ``torch.compile(model, backend="fxzero")``;
* **FSDP2 + TP**: ``fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)`` on
  each block and the root (as ``benchmarks/compare.py``'s FSDP2), ``torch.optim.AdamW``;
  compiled: each block ``torch.compile``-d after TP and before ``fully_shard``, as torchtitan
  does (FSDP2's hooks between blocks stay eager).

World 4 (gloo, 1 CPU thread per rank, :mod:`fxzero.testing` pools). Each config first runs
**alone** in a fresh pool (peak RSS per rank: ``VmHWM`` from just before the model is built,
with ``MALLOC_MMAP_THRESHOLD_`` fixed as in ``benchmarks/memory.py``; optimizer state bytes
per rank; losses), then both run **in turn** in one pool, each step running one step of each
config in an order alternated every step, each timed after a barrier (this machine's speed
drifts over minutes; configs stepping in turn share the drift). A step is forward + backward
+ ``step()`` + ``zero_grad()``; its time is the slower rank's; medians and p10-p90 over
``--steps`` timed steps after ``--warmup`` untimed ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402

import fxzero  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

LR, BETAS, PER_DP_RANK, DP, TP = 2e-3, (0.9, 0.95), 8, 2, 2
CONFIGS = ("fxzero + TP", "FSDP2 + TP")
MMAP_THRESHOLD = 1 << 20  # see benchmarks/memory.py: RSS then follows the tensors held


# ---- on every rank ----------------------------------------------------------------------
def _param_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())  # the tied weight appears once
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _state_nbytes(opt: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    values = (v.to_local() if isinstance(v, DTensor) else v for s in opt.state.values() for v in s.values())
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def _build(config: str, mesh, compiled: bool) -> tuple[object, torch.optim.Optimizer, object]:
    """(what to call, optimizer, () -> optimizer state bytes on this rank), TP over mesh["tp"]."""
    torch.manual_seed(0)
    model = train_gpt.Transformer(train_gpt.ModelArgs())
    train_gpt.parallelize(model, mesh["tp"])
    if config == "fxzero + TP":
        opt = fxzero.DistributedOptimizer(_param_groups(model), torch.optim.AdamW, lr=LR, betas=BETAS, module=model,
                                          process_group=mesh["dp"], config=fxzero.Config(bucket_size=1_000_000))
        return torch.compile(model, backend="fxzero") if compiled else model, opt, lambda: opt.state_bytes
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.layers):
        if compiled:
            block = torch.compile(block)
            model.layers.register_module(str(i), block)
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    opt = torch.optim.AdamW(_param_groups(model), lr=LR, betas=BETAS)
    return model, opt, lambda: _state_nbytes(opt)


def _setup():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    data = torch.frombuffer(bytearray(train_gpt.load_bytes(None)), dtype=torch.uint8).long()
    return mesh, data, types.SimpleNamespace(seq=128, global_batch=PER_DP_RANK * DP)


def _one_step(model, opt, x, y) -> torch.Tensor:
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _vm_kib(key: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1])


def train_alone(config: str, steps: int, compiled: bool) -> dict:
    """``config`` alone in this pool: peak RSS since just before the build, state bytes, losses."""
    mesh, data, batch = _setup()
    baseline = _vm_kib("VmRSS") / 1024
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    model, opt, state_bytes = _build(config, mesh, compiled)
    losses = []
    for step in range(1, steps + 1):
        x, y = train_gpt.get_batch(data, step, batch, mesh["dp"].get_local_rank(), DP, torch.device("cpu"))
        loss = _one_step(model, opt, x, y)
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item() / DP)
    return {"baseline_mib": baseline, "peak_mib": _vm_kib("VmHWM") / 1024, "state_bytes": state_bytes(), "losses": losses}


def train_in_turn(steps: int, warmup: int, compiled: bool) -> dict:
    """Both configs in this one pool, one step of each per training step, the order
    alternated every step; each step timed after a barrier. Returns this rank's times (s)."""
    mesh, data, batch = _setup()
    runs = {config: _build(config, mesh, compiled)[:2] for config in CONFIGS}
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    losses: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for step in range(1, warmup + steps + 1):
        x, y = train_gpt.get_batch(data, step, batch, mesh["dp"].get_local_rank(), DP, torch.device("cpu"))
        for config in CONFIGS if step % 2 else CONFIGS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            loss = _one_step(*runs[config], x, y)
            if step > warmup:
                times[config].append(time.perf_counter() - start)
            losses[config].append(loss.item())
    return {"times": times, "losses": losses}


# ---- in the parent ----------------------------------------------------------------------
def _spread(ms: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(ms, n=10)
    return statistics.median(ms), q[0], q[-1]


def _quarter(ms: list[float], q: int) -> float:
    n = len(ms)
    return statistics.median(ms[q * n // 4 : (q + 1) * n // 4])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps (in turn); the alone runs train as many")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="both under Inductor (fxzero: backend='fxzero'; FSDP2: per block)")
    args = p.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by the ranks' glibc at start
    world = DP * TP
    alone = {}
    for config in CONFIGS:
        try:
            alone[config] = run_ranks(world, train_alone, config, args.warmup + args.steps, args.compile, timeout=1800)
        finally:
            close_pools()
    try:
        paired = run_ranks(world, train_in_turn, args.steps, args.warmup, args.compile, timeout=3600)
    finally:
        close_pools()
    print(f"# fxzero + TP vs FSDP2 + TP: torch {torch.__version__}, cpu, world {world} (dp {DP} x tp {TP}, gloo, "
          f"1 thread/rank), GPT 3.25M (dim 256, 4 layers, seq 128, batch {PER_DP_RANK}/dp rank), AdamW, "
          f"{'compiled (Inductor)' if args.compile else 'eager'}; "
          f"{args.warmup} warm-up + {args.steps} timed steps\n")
    rows, med, ms = [], {}, {}
    for config in CONFIGS:
        ms[config] = [1e3 * max(r["times"][config][i] for r in paired) for i in range(args.steps)]  # the slower rank's
        med[config], p10, p90 = _spread(ms[config])
        runs = alone[config]
        rows.append((config, f"{med[config]:.1f}", f"{p10:.1f}-{p90:.1f}",
                     f"{max(r['peak_mib'] for r in runs):.0f}", f"{max(r['peak_mib'] - r['baseline_mib'] for r in runs):.0f}",
                     f"{max(r['state_bytes'] for r in runs):,}"))  # fmt: skip
    print(tabulate(rows, headers=["config", "median ms", "p10-p90 ms", "peak RSS MiB/rank", "above baseline MiB/rank",
                                  "opt state bytes/rank"], tablefmt="github"))  # fmt: skip
    fx, fs = (alone[c] for c in CONFIGS)
    print(f"\n(step times: the two configs stepping in turn in one pool, the slower rank's; peak RSS (VmHWM, "
          f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}) and state: each config alone in a fresh pool, max over ranks; "
          "above baseline: peak minus the RSS just before the model was built)\n")
    quarters = ", ".join(f"{_quarter(ms[CONFIGS[0]], q) / _quarter(ms[CONFIGS[1]], q):.3f}" for q in range(4))
    print(f"fxzero / FSDP2: step time {med[CONFIGS[0]] / med[CONFIGS[1]]:.3f} (by quarter of the run: {quarters}), "
          f"peak RSS {max(r['peak_mib'] for r in fx) / max(r['peak_mib'] for r in fs):.3f}, "
          f"opt state {max(r['state_bytes'] for r in fx) / max(r['state_bytes'] for r in fs):.3f}")
    gap_alone = max(abs(a - b) for a, b in zip(fx[0]["losses"], fs[0]["losses"]))
    turn = paired[0]["losses"]
    gap_turn = max(abs(a - b) for a, b in zip(*(turn[c] for c in CONFIGS)))
    print(f"losses agree: max |fxzero - FSDP2| over {len(fx[0]['losses'])} steps = {gap_alone:.2e} alone (mean over dp), "
          f"{gap_turn:.2e} in turn (rank 0); step 1 {fx[0]['losses'][0]:.4f}, last {fx[0]['losses'][-1]:.4f} vs "
          f"{fs[0]['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
