"""fp32 param all-gather vs MXFP8 gather (own buffer / reusing the grad buffer), 2 gloo ranks.

    python benchmarks/mxfp8_gather.py [--steps 200] [--compile]

Every config trains the GPT of ``examples/train_gpt.py`` (3.25M params; seq 128, global
batch 16, the example's stdlib-bytes data, seed, AdamW, LR schedule and clip 1.0) with
``fxzero.DistributedOptimizer(..., module=model)`` and the param gathers overlapping the forward (``overlap_param_gather=True``, as when its README rows were measured), in the same run:

1. **fp32 gather**: the params' own fp32 shards are gathered;
2. **MXFP8 gather**: ``Config(mxfp8_param_gather=True)``, rows in a separate byte buffer;
3. **MXFP8 gather + reuse**: also ``reuse_grad_buf_for_mxfp8_param_ag=True``.

Reported per config: bytes every param all-gather of one step moves (the gather outputs,
counted by wrapping ``dist.all_gather_single``; a ring all-gather sends (dp-1)/dp of that
per rank), the runtime's buffer bytes per rank (``runtime_bytes``: flat param + grad
buffers + the gather's own), median step time (forward+backward+step+zero_grad, slower
rank, after 5 warm-up steps), and the loss curve (mean over ranks) at a few steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ModelArgs, Transformer, get_batch, load_bytes, lr_at  # noqa: E402

import fxzero  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

WORLD, WARMUP = 2, 5
CONFIGS = {
    "fp32 gather": {},
    "MXFP8 gather": {"mxfp8_param_gather": True},
    "MXFP8 gather + reuse": {"mxfp8_param_gather": True, "reuse_grad_buf_for_mxfp8_param_ag": True},
}


def _train(flags: dict, steps: int, compile: bool) -> dict:
    rank = dist.get_rank()
    args = types.SimpleNamespace(seq=128, global_batch=16, steps=steps, lr=2e-3)
    data = torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long()
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    config = fxzero.Config(bucket_size=1_000_000, clip_grad=1.0, overlap_param_gather=True, **flags)
    opt = fxzero.DistributedOptimizer(groups, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), config=config, module=model)
    forward = torch.compile(model, backend="fxzero") if compile else model
    gathered: list[int] = []
    real_gather = dist.all_gather_single

    def counting_gather(output, input, *a, **k):
        gathered.append(output.nbytes)
        return real_gather(output, input, *a, **k)

    losses, times = [], []
    with mock.patch.object(dist, "all_gather_single", counting_gather):
        for step in range(1, steps + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            x, y = get_batch(data, step, args, rank, WORLD, torch.device("cpu"))
            dist.barrier()
            start = time.perf_counter()
            if step == WARMUP:
                gathered.clear()  # one steady step: the gathers its forward waits for + its step()
            loss = forward(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / WORLD)
            if step == WARMUP:
                per_step = list(gathered)
    return {
        "losses": losses,
        "times": times[WARMUP:],
        "gathers": per_step,
        "runtime_bytes": opt.runtime_bytes,
        "state_bytes": opt.state_bytes,
        "buckets": len(opt.runtime.buckets),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compile", action="store_true", help="torch.compile(backend='fxzero') (Inductor)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be > {WARMUP} (the warm-up steps)")
    results = {}
    try:
        for name, flags in CONFIGS.items():
            print(f"running {name} ...", flush=True)
            results[name] = run_ranks(WORLD, _train, flags, args.steps, args.compile, timeout=3600)
    finally:
        close_pools()
    base = results["fp32 gather"][0]
    base_ms = statistics.median(max(ts) for ts in zip(*(r["times"] for r in results["fp32 gather"]))) * 1e3
    rows = []
    for name, res in results.items():
        r0 = res[0]
        ms = statistics.median(max(ts) for ts in zip(*(r["times"] for r in res))) * 1e3
        moved = sum(r0["gathers"])
        rows.append([
            name,
            r0["buckets"],
            f"{len(r0['gathers'])} × {moved // max(1, len(r0['gathers'])):,}",
            f"{moved / sum(base['gathers']):.4f}x",
            f"{max(r['runtime_bytes'] for r in res) / 2**20:.2f}",
            f"{max(r['state_bytes'] for r in res) / 2**20:.2f}",
            f"{ms:.1f}",
            f"{ms / base_ms:.3f}x",
            f"{r0['losses'][-1]:.4f}",
            f"{statistics.mean(r0['losses'][-10:]):.4f}",
        ])
    headers = ["config", "buckets", "all-gathers/step × bytes", "gather bytes vs fp32", "runtime buffers MiB/rank",
               "opt state MiB/rank", "median ms/step", "vs fp32", f"loss @ {args.steps}", "mean last 10"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    marks = sorted({1, *range(25, args.steps + 1, 25), args.steps})
    curve = [[name] + [f"{res[0]['losses'][s - 1]:.4f}" for s in marks] for name, res in results.items()]
    print("\nloss curve (mean over ranks)")
    print(tabulate(curve, headers=["step"] + [str(s) for s in marks], tablefmt="github"))
    ratio = sum(results["MXFP8 gather + reuse"][0]["gathers"]) / sum(base["gathers"])
    print(f"\nMXFP8 / fp32 gather bytes = {ratio:.4f}; target <= 0.26: {'PASS' if ratio <= 0.26 else 'FAIL'}")


if __name__ == "__main__":
    main()
