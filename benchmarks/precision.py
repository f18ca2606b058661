"""What each precision option of fxzero costs and saves, against fp32 state in the same run.

Two parts, both on 2 gloo ranks (eager: the options change the optimizer step only; tests/test_precision.py
runs them under Inductor too):

1. **Memory** on the 43M GPT of ``memory.py`` (dim 768, 6 layers): optimizer-state bytes per param
   (this rank's state x ranks / params) against Megatron-LM's table (bf16 params with fp32 grads:
   ``6 + 12/d`` bytes per param; the sharded part, 12, is the fp32 master and two fp32 moments),
   the flat buffers, the peak resident memory per rank during ``step()`` and the step time.
2. **Drift** on the main job's GPT (``examples/train_gpt.py``'s defaults and lr schedule, 3.25M params;
   it has no dropout): the loss of each option over ``--steps`` steps against the fp32 run, beside the
   noise of training itself (the fp32 run again from another init seed: at 2 ranks every summation order
   gives the same bits, so no other order exists to compare with); a PNG of the curves.

    python benchmarks/precision.py                      # both parts (~6 min on 2 cores)
    python benchmarks/precision.py --steps 50 --skip-memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import memory_ranks  # noqa: E402
import peers  # noqa: E402
from train_gpt import ModelArgs, Transformer, get_batch, lr_at  # noqa: E402

import fxzero  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

MASTER_BYTES = {"fp32 params": 0.0, "fp32 masters": 4.0, "remainders": 2.0, "stochastic": 4.0}
"""Bytes per param of the masters each mode keeps (the rest of the state is the two moments)."""
MODES: dict[str, tuple[torch.dtype, dict, float]] = {
    # label: (param dtype, Config options, Megatron-LM's sharded bytes per param for it)
    "fp32 params, fp32 state": (torch.float32, {}, 8.0),
    "bf16 params, fp32 masters + fp32 state": (torch.bfloat16, {}, 12.0),
    "bf16 params, fp32 masters + bf16 state": (torch.bfloat16, {"optimizer_state_dtype": "bf16"}, 8.0),
    "bf16 params, fp32 masters + fp8 state": (torch.bfloat16, {"optimizer_state_dtype": "fp8"}, 6.0),
    "bf16 params, remainders + fp32 state": (torch.bfloat16, {"param_remainders": True}, 10.0),
    "bf16 params, remainders + bf16 state": (torch.bfloat16, {"param_remainders": True, "optimizer_state_dtype": "bf16"}, 6.0),
    "bf16 params, remainders + fp8 state": (torch.bfloat16, {"param_remainders": True, "optimizer_state_dtype": "fp8"}, 4.0),
    "bf16 params, stochastic rounding": (torch.bfloat16, {"param_rounding": "stochastic"}, 12.0),
}
NOISE = "bf16 params, fp32: another init seed (noise)"


def _memory_rank(dtype: torch.dtype, options: dict, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = memory_ranks.Model("GPT 43M", 768, 6, 12)
    meter = memory_ranks.Meter(torch.device("cpu"))
    data = torch.frombuffer(bytearray(peers.load_bytes(None)), dtype=torch.uint8).long()
    batch = types.SimpleNamespace(seq=model.seq, global_batch=model.batch * world)
    torch.manual_seed(0)
    net = Transformer(model.args()).to(dtype)
    opt = fxzero.DistributedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4, module=net, config=fxzero.Config(**options))
    step_peak, times = 0.0, []
    for step in range(1, steps + 1):
        x, y = get_batch(data, step, batch, rank, world, torch.device("cpu"))
        net(x, y).float().backward()
        dist.barrier()
        meter.reset()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        step_peak = max(step_peak, meter.peak())
        opt.zero_grad()
    params = sum(p.numel() for p in net.parameters())
    return {"state": opt.state_bytes, "buffers": sum(b.nbytes for b in opt.buffers), "params": params,
            "peak": step_peak, "step_ms": 1e3 * statistics.median(times[1:])}  # fmt: skip


def _curve_rank(dtype: torch.dtype, options: dict, steps: int, seed: int = 1) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    args = types.SimpleNamespace(seq=128, global_batch=16, lr=2e-3, steps=steps)  # the main job's defaults and schedule
    data = torch.frombuffer(bytearray(peers.load_bytes(None)), dtype=torch.uint8).long()
    torch.manual_seed(seed - 1)  # the init: seed 1 is every mode's, seed 2 the noise run's
    net = Transformer(ModelArgs(vocab_size=256, block_size=128, dim=256, n_layer=4, n_head=4)).to(dtype)
    config = fxzero.Config(bucket_size=1_000_000, **options)
    opt = fxzero.DistributedOptimizer(net.parameters(), torch.optim.AdamW, lr=2e-3, weight_decay=0.1, module=net, config=config)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step + 1, args)
        x, y = get_batch(data, step, args, rank, world, torch.device("cpu"))
        loss = net(x, y).float()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _memory(steps: int) -> list[list[str]]:
    rows = []
    base = None
    for label, (dtype, options, megatron) in MODES.items():
        start = time.perf_counter()
        r = run_ranks(2, _memory_rank, dtype, options, steps, timeout=1800)[0]
        close_pools()
        state_per_param = r["state"] * 2 / r["params"]
        moments = state_per_param - next(v for k, v in MASTER_BYTES.items() if k in label)
        base = base or moments
        rows.append([label, f"{state_per_param:.2f}", f"{megatron:g}", f"{moments:.2f}", f"{moments / base:.3f}",
                     f"{(r['buffers'] + r['state']) / r['params']:.2f}", f"{r['peak']:.0f}", f"{r['step_ms']:.0f}"])  # fmt: skip
        print(f"  {label}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _curves(steps: int) -> dict[str, list[float]]:
    curves = {}
    runs = {label: (dtype, options, 1) for label, (dtype, options, _) in MODES.items() if label != "fp32 params, fp32 state"}
    runs[NOISE] = (torch.bfloat16, {}, 2)  # the fp32 run again from another init: run-to-run variation
    for label, (dtype, options, seed) in runs.items():
        start = time.perf_counter()
        curves[label] = run_ranks(2, _curve_rank, dtype, options, steps, seed, timeout=3600)[0]
        close_pools()
        print(f"  {label}: {time.perf_counter() - start:.0f} s", flush=True)
    return curves


def _drift_rows(curves: dict[str, list[float]]) -> list[list[str]]:
    ref = curves["bf16 params, fp32 masters + fp32 state"]
    rows = []
    for label, losses in curves.items():
        diffs = [abs(a - b) for a, b in zip(losses, ref)]
        tail = statistics.mean(losses[-20:]) - statistics.mean(ref[-20:])
        rows.append([label, f"{losses[-1]:.4f}", f"{max(diffs):.4f}", f"{statistics.mean(diffs):.4f}", f"{tail:+.4f}"])
    return rows


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    ref = curves["bf16 params, fp32 masters + fp32 state"]
    for label, losses in curves.items():
        style = {"linestyle": ":", "color": "grey"} if label == NOISE else {}
        top.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1, **style)
        bottom.plot(range(1, len(losses) + 1), [a - b for a, b in zip(losses, ref)], linewidth=1, **style)
    top.set_ylabel("train loss (mean over 2 ranks)")
    top.set_title("main job GPT (3.25M), 2 gloo ranks: each precision option against fp32 state and masters")
    top.legend(fontsize=7)
    bottom.set_ylabel("loss - fp32 run's loss")
    bottom.set_xlabel("step")
    bottom.axhline(0, color="black", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps of the drift part")
    parser.add_argument("--memory-steps", type=int, default=4)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-curves", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    from tabulate import tabulate

    torch.set_num_threads(1)
    out = Path(args.out)
    print(f"# precision options: torch {torch.__version__}, 2 gloo ranks x 1 thread, {time.strftime('%Y-%m-%d')}\n")
    if not args.skip_memory:
        rows = _memory(args.memory_steps)
        headers = ["mode (43M GPT, world 2)", "opt state B/param", "Megatron-LM B/param", "moments B/param", "moments vs fp32",
                   "buffers + state B/param per rank", "peak MiB/rank in step()", "step() ms"]  # fmt: skip
        print(tabulate(rows, headers=headers, tablefmt="github"))
        print("\n(opt state B/param: this rank's state bytes x 2 ranks / params, before sharding; Megatron-LM's: the sharded part "
              "of its 6 + 12/d table (fp32 masters 4 + moments 8), with its precision-aware options' 2-byte moments, 1-byte fp8 "
              "moments and 2-byte remainders)\n")  # fmt: skip
    if args.skip_curves:
        return
    curves = _curves(args.steps)
    print(tabulate(_drift_rows(curves), headers=["mode (main job GPT, world 2)", f"loss at step {args.steps}", "max |diff| vs fp32",
                                                 "mean |diff|", "last 20 steps, mean diff"], tablefmt="github"))  # fmt: skip
    (out / "precision.json").write_text(json.dumps(curves))
    _plot(curves, out / "precision.png")
    print(f"\nwrote {out / 'precision.png'} and {out / 'precision.json'}")


if __name__ == "__main__":
    main()
