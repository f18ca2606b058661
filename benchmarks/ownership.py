"""Whole-param ownership vs fragments vs ZeroRedundancyOptimizer: state balance, padding, bytes, time.

    python benchmarks/ownership.py [--world 2 4] [--steps 20] [--warmup 3] [--bucket-size 1000000]

For each ``--world`` (a :mod:`fxzero.testing` pool: gloo, CPU, 1 thread per rank), every config
below is built in the same ranks on the GPT of ``examples/train_gpt.py`` (3.25M params; seq 128,
batch 8 per rank; the batches, seed and param groups of ``benchmarks/peers.py``) and trained
eagerly (no ``torch.compile``: the layouts are compared, not the compilers), stepping in turn as
``peers.train_paired`` does (each step runs one step of every config, in an order rotated by one
per step, each timed after a barrier, so machine drift slows every config alike):

* **fxzero elementwise AdamW**: ``Config(state_sharding="elementwise")``: every rank owns 1/dp of
  every bucket's elements (params cut into 1-D fragments);
* **fxzero whole_params AdamW**: ``Config(state_sharding="whole_params")``: every param owned
  whole by one rank (``fxzero/optim/layout/ownership.py`` deals params into per-rank regions of each
  bucket; the shard is the largest region, the rest padding);
* **DDP + ZeRO AdamW**: eager ``DDP`` + ``ZeroRedundancyOptimizer(AdamW)`` (``peers.build``);
* **fxzero whole_params Adafactor** and **fxzero Muon (whole) + AdamW (auto)** (Muon, lr 0.02, on
  the blocks' matrices, whole params; AdamW on the embeddings, norms and biases with the default
  ``"auto"``, which gives elementwise AdamW fragments: two ``DistributedOptimizer``\\ s):
  optimizers that need whole params; for their state balance (their step times are not
  comparable with AdamW's).

AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on matrices) is elementwise, so the three
AdamW configs train the same model: the correctness line gives their largest loss difference
over all steps (expected ~1e-6: only summation order differs).

Columns, per config (max/min over ranks where ranks differ):

* **state**: optimizer-state bytes on a rank (``opt.state_bytes``; ZeRO: its local
  optimizer's state tensors); max, min and max/min;
* **buffers**: fxzero's flat param + grad buffers and scratch (``opt.runtime_bytes``);
  **padding**: buffer elements that hold no param, per buffer copy
  (``sum(plan.numel) - params``; under whole_params ``opt.balance.padding``);
* **MiB moved**: bytes a rank receives per step from the gradient and param collectives,
  computed from sizes for bandwidth-optimal algorithms (not measured). fxzero, over its buffers
  of ``S`` elements (padding included): reduce-scatter + all-gather, each rank receiving the
  other ranks' parts of its shard and then their shards: ``(dp-1)/dp * S * (grad bytes + param
  bytes)`` (the same for gloo's chunked all-to-all and per-rank broadcasts fxzero uses there).
  ZeRO on ``N`` param elements, rank ``r`` owning ``n_r``: DDP's ring all-reduce
  ``2 (dp-1)/dp * N * 4`` + the broadcasts of the params it does not own ``(N - n_r) * 4``;
* **median ms** (p10-p90) of a step (forward + backward + step + zero_grad, the slower
  rank's time), and ratios vs DDP + ZeRO AdamW.

What it showed on this GPT (``--world 2 4 --steps 20``, torch 2.13, bucket_size 1,000,000;
layout figures, which do not vary between runs): whole_params AdamW's state max/min is 1.019
at world 2 and 1.081 at world 4 (ZeroRedundancyOptimizer's, which sorts all params by size
before dealing: 1.017 and 1.080; elementwise: 1.000), its most-loaded rank 1.001x and 1.000x
ZeRO's, with 30,720 and 161,280 padding elements per buffer copy (0.9% and 5.0% of the
params) in 3 and 2 buckets (elementwise: 4). Dealt by elements, Adafactor's factored state is
less even (max/min 1.251 and 1.334). Muon over the blocks' matrices (whole) + AdamW over the
rest ("auto": fragments): state max/min 1.000, no padding, at both sizes. Bytes moved: 0.665x
ZeRO's for fragments, 0.671x (world 2) and 0.698x (world 4) for whole params; the three AdamW
configs' losses agree to 0.0 (world 2) and 4.8e-07 (world 4) over 23 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import ModelArgs, Transformer, get_batch  # noqa: E402

import peers  # noqa: E402  (benchmarks/peers.py: the ZeRO peer, batches, param groups)
from compare import _failure, _quantile, _steps_ms  # noqa: E402
from fxzero import Config, DistributedOptimizer  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402
from peers import BETAS, LR  # noqa: E402

ZERO = "DDP + ZeRO AdamW"
ADAMW_CONFIGS = ("fxzero elementwise AdamW", "fxzero whole_params AdamW", ZERO)
CONFIGS = (*ADAMW_CONFIGS, "fxzero whole_params Adafactor", "fxzero Muon (whole) + AdamW (auto)")
MUON_LR = 0.02


# ---- on every rank ----------------------------------------------------------------------
def _fxzero(groups: list[dict], cls: type, sharding: str, bucket_size: int, model: torch.nn.Module | None, **kw) -> DistributedOptimizer:
    cfg = Config(bucket_size=bucket_size, state_sharding=sharding)
    return DistributedOptimizer(groups, cls, config=cfg, module=model, **kw)


def _optimizers(config: str, model: torch.nn.Module, bucket_size: int) -> list[DistributedOptimizer]:
    """fxzero's optimizers for ``config`` (two for Muon+AdamW, each over its own params)."""
    groups = peers.param_groups(model)
    if config.endswith("AdamW") and "Muon" not in config:
        sharding = "elementwise" if "elementwise" in config else "whole_params"
        return [_fxzero(groups, torch.optim.AdamW, sharding, bucket_size, model, lr=LR, betas=BETAS)]
    if config.endswith("Adafactor"):
        return [_fxzero(groups, torch.optim.Adafactor, "whole_params", bucket_size, model, lr=1e-2)]
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = _fxzero([{"params": hidden, "weight_decay": 0.1}], torch.optim.Muon, "whole_params", bucket_size, model, lr=MUON_LR)
    # "auto": AdamW is elementwise, so its half gets fragments (no padding around a few small params)
    adamw = _fxzero([{"params": rest, "weight_decay": 0.0}], torch.optim.AdamW, "auto", bucket_size, None, lr=LR, betas=BETAS)
    return [muon, adamw]


def _fxzero_facts(opts: list[DistributedOptimizer]) -> dict:
    dp = opts[0].dp.size
    buffers = [b for o in opts for b in o.buffers]
    padding = sum(b.plan.numel for b in buffers) - sum(p.numel() for b in buffers for p in b.params)
    moved = sum(b.plan.numel * (b.grad_data.element_size() + b.param_data.element_size()) for b in buffers) * (dp - 1) / dp
    balances = [o.balance.describe() for o in opts if o.balance is not None]
    return {"state": sum(o.state_bytes for o in opts), "buffers": sum(o.runtime_bytes for o in opts), "padding": padding,
            "moved": moved, "buckets": len([b for o in opts for b in o.runtime.buckets]), "balance": "; ".join(balances)}  # fmt: skip


def _zero_facts(opt) -> dict:
    dp = dist.get_world_size()
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    own = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    moved = 4 * (2 * (dp - 1) / dp * total + (total - own))
    return {"state": peers._state_nbytes(opt.optim.state), "buffers": None, "padding": None, "moved": moved, "own": own, "buckets": None}


def _build(config: str, bucket_size: int):
    """(callable model, optimizers to step, () -> facts about this rank's layout and state)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    if config == ZERO:
        ddp, opt, _ = peers.build("DDP + ZeRO", model, bucket_size)
        return ddp, [opt], lambda: _zero_facts(opt)
    opts = _optimizers(config, model, bucket_size)
    return model, opts, lambda: _fxzero_facts(opts)


def train_in_turn(configs: list[str], steps: int, warmup: int, bucket_size: int) -> dict:
    """Every config in this process, stepping in turn (see ``peers.train_paired``); each
    config's step times (s), losses (mean over ranks) and layout/state facts on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data, batch = peers.data_and_batch(world)
    runners = {config: _build(config, bucket_size) for config in configs}
    times: dict[str, list[float]] = {config: [] for config in configs}
    losses = torch.zeros(len(configs), warmup + steps)
    for step in range(1, warmup + steps + 1):
        x, y = get_batch(data, step, batch, rank, world, torch.device("cpu"))
        shift = step % len(configs)
        for config in configs[shift:] + configs[:shift]:
            model, opts, _ = runners[config]
            dist.barrier()
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if step > warmup:
                times[config].append(time.perf_counter() - start)
            losses[configs.index(config), step - 1] = loss.item()
    dist.all_reduce(losses)
    return {"times": times, "losses": dict(zip(configs, (losses / world).tolist())), "facts": {c: r[2]() for c, r in runners.items()}}


# ---- in the parent ----------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _row(config: str, res: list[dict], zero_ms: float | None, zero_state: int | None, zero_moved: float | None) -> list[str]:
    facts = [r["facts"][config] for r in res]
    state = [f["state"] for f in facts]
    ms = _steps_ms([r["times"][config] for r in res])
    median, moved = statistics.median(ms), max(f["moved"] for f in facts)
    ratio = lambda a, b: f"{a / b:.3f}" if b else "n/a"  # noqa: E731
    buffers = "n/a" if facts[0]["buffers"] is None else _mib(max(f["buffers"] for f in facts))
    padding = "n/a" if facts[0]["padding"] is None else f"{facts[0]['padding']:,}"
    buckets = "n/a" if facts[0]["buckets"] is None else str(facts[0]["buckets"])
    return [
        config, _mib(max(state)), _mib(min(state)), f"{max(state) / min(state):.3f}", ratio(max(state), zero_state),
        buffers, padding, buckets, _mib(moved), ratio(moved, zero_moved),
        f"{median:.1f}", f"{_quantile(ms, 0.1):.1f}-{_quantile(ms, 0.9):.1f}", ratio(median, zero_ms),
    ]  # fmt: skip


def _report(world: int, res: list[dict], configs: list[str]) -> None:
    zero_ms = statistics.median(_steps_ms([r["times"][ZERO] for r in res])) if ZERO in configs else None
    zero_state = max(r["facts"][ZERO]["state"] for r in res) if ZERO in configs else None
    zero_moved = max(r["facts"][ZERO]["moved"] for r in res) if ZERO in configs else None
    rows = [_row(c, res, zero_ms, zero_state, zero_moved) for c in configs]
    headers = ["config", "state MiB max", "min", "max/min", "max vs ZeRO", "buffers MiB", "padding elems", "buckets",
               "MiB moved/step", "vs ZeRO", "median ms", "p10-p90", "vs ZeRO"]  # fmt: skip
    print(f"\n## world {world}\n")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    for config in configs:
        balance = res[0]["facts"][config].get("balance")
        if balance:
            print(f"{config}: {balance}")
    if ZERO in configs:
        owned = ", ".join(f"rank {i}: {r['facts'][ZERO]['own']:,}" for i, r in enumerate(res))
        print(f"{ZERO}: param elements owned: {owned}")
    adamw = [c for c in ADAMW_CONFIGS if c in configs]
    losses = {c: res[0]["losses"][c] for c in adamw}
    worst = max((abs(a - b) for i, c in enumerate(adamw) for d in adamw[i + 1 :] for a, b in zip(losses[c], losses[d])), default=0.0)
    last = ", ".join(f"{c} {losses[c][-1]:.6f}" for c in adamw)
    print(f"correctness: loss after {len(losses[adamw[0]])} steps: {last}; max |difference| over all steps {worst:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes, one pool each")
    p.add_argument("--steps", type=int, default=20, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="Config.bucket_size (elements); DDP's stays at its default")
    p.add_argument("--only", nargs="+", default=list(CONFIGS), choices=CONFIGS, metavar="CONFIG", help=f"subset of {CONFIGS}")
    args = p.parse_args()
    if args.steps < 2 or min(args.world) < 2:
        p.error("need --steps >= 2 and every --world >= 2")
    n_params = sum(p.numel() for p in Transformer(ModelArgs()).parameters())
    print(f"# whole-param ownership: torch {torch.__version__}, gloo, CPU, 1 thread per rank, GPT {n_params:,} params, "
          f"seq 128, batch {peers.PER_RANK}/rank, eager, bucket_size {args.bucket_size:,}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, configs stepping in turn")  # fmt: skip
    for world in args.world:
        start = time.perf_counter()
        try:
            res = run_ranks(world, train_in_turn, list(args.only), args.steps, args.warmup, args.bucket_size, timeout=1800)
        except Exception as exc:  # noqa: BLE001 - the next world still runs
            print(f"\n## world {world}\n\nFAILED: {_failure(exc)}")
            continue
        finally:
            close_pools()
        _report(world, res, list(args.only))
        print(f"(world {world}: {time.perf_counter() - start:.0f} s)")
    print("\n(state: optimizer-state bytes per rank; max vs ZeRO: over ZeRO's max. buffers: fxzero's runtime_bytes (ZeRO keeps "
          "none; DDP's grad buckets not counted). padding: elements per buffer copy. MiB moved: received per rank per step by "
          "the gradient and param collectives, from sizes (see the docstring's formula), max over ranks. ms: the slower rank.)")


if __name__ == "__main__":
    main()
