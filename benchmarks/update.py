"""What each optimizer update costs, against the memory bandwidth, and how far each narrow state drifts.

Two parts, both on this machine's CPU with one thread per rank:

1. **Speed**: ``step()`` of every fxzero precision mode, of ``torch.optim.AdamW`` (foreach and fused)
   and of torchao's ``AdamW8bit`` / ``AdamWFp8`` over one bias-free MLP (5.2M params), with gradients
   from a real backward, in paired rounds (every mode once a round, the order alternating; medians).
   Each row gives the achieved bandwidth (the bytes a single fused pass must read and write per param,
   its *bound bytes*, over the time) and the time over the bound (bound bytes / ``torch.add_``'s
   bandwidth, measured in the same rounds). World 1 in this process, world 2 on 2 gloo ranks
   (``step()`` then includes the gradient reduce-scatter and the param all-gather). Each target of
   issue 54 is the median of its ratios taken round by round (the two rows ran in the same round),
   with the middle half of those ratios beside it.
2. **Drift**: the loss and the params of fp8 and bf16 state (fxzero) and of torchao's 8-bit AdamWs
   after 100 and 300 steps, against ``torch.optim.AdamW`` with fp32 state from the same init and
   batches, on two models (a bias-free MLP 128-512-512-128 on a teacher's targets; a 2-layer byte
   GPT), at lr 1e-3 and 3e-4. The param distance is ``|p - p_fp32| / |p_fp32 - p_init|`` (L2 over
   all params): the drift relative to the update itself.

    python benchmarks/update.py                  # both parts (~15 min on 2 cores)
    python benchmarks/update.py --skip-drift --rounds 5
    python benchmarks/update.py --device cuda --skip-drift --skip-world-2   # world 1 on a GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
from train_gpt import ModelArgs, Transformer, load_bytes  # noqa: E402

import fxzero  # noqa: E402
from fxzero.inductor_function import compile_stats  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

_FP8_M, _FP8_V = 1 + 1 / 32, 1 + 2 / 32
_AO_8BIT = 1 + 4 / 256
SPEED_MODES: dict[str, tuple[str, torch.dtype, dict[str, Any], float]] = {
    # label: (who steps, param dtype, options, bound bytes per param: grad read + param/master/state read and written)
    "torch AdamW foreach=True (fp32)": ("torch", torch.float32, {"foreach": True}, 4 + 3 * 8),
    "torch AdamW fused=True (fp32)": ("torch", torch.float32, {"fused": True}, 4 + 3 * 8),
    "torch AdamW fused=True + grad norm": ("torch+", torch.float32, {"fused": True}, 4 + 3 * 8),
    "fxzero fp32 state, fp32 params": ("fxzero", torch.float32, {}, 4 + 3 * 8),
    "fxzero fp32 state, fp32 params, fused=True": ("fxzero", torch.float32, {"fused": True}, 4 + 3 * 8),
    "fxzero fp32 state, fp32 params, fused=True, measure_grad_norm=False": ("fxzero", torch.float32, {"fused": True, "measure_grad_norm": False},
                                                                           4 + 3 * 8),
    "fxzero fp32 state, fp32 params, fused=True, buffers zeroed": ("fxzero", torch.float32, {"fused": True, "zeroed_buffers": True}, 4 + 3 * 8),
    # every fxzero row compiles its own per-run work (Config.compiled_update=None, the default) unless it says compiled_update=False
    "fxzero fp32 state, bf16 params + fp32 masters": ("fxzero", torch.bfloat16, {}, 4 + 3 * 8 + 2),
    "fxzero fp32 state, bf16 params + fp32 masters, compiled_update=False": ("fxzero", torch.bfloat16, {"compiled_update": False}, 4 + 3 * 8 + 2),
    "fxzero fp32 state, bf16 params + fp32 masters, fused=True": ("fxzero", torch.bfloat16, {"fused": True}, 4 + 3 * 8 + 2),
    "fxzero fp32 state, bf16 params + fp32 masters, fused=True, compiled_update=False": ("fxzero", torch.bfloat16, {"fused": True, "compiled_update": False},
                                                                                        4 + 3 * 8 + 2),
    "fxzero bf16 state": ("fxzero", torch.float32, {"optimizer_state_dtype": "bf16"}, 4 + 8 + 2 * 4),
    "fxzero bf16 state, compiled_update=False": ("fxzero", torch.float32, {"optimizer_state_dtype": "bf16", "compiled_update": False}, 4 + 8 + 2 * 4),
    "fxzero bf16 state, buffers zeroed": ("fxzero", torch.float32, {"optimizer_state_dtype": "bf16", "zeroed_buffers": True}, 4 + 8 + 2 * 4),
    "fxzero bf16 state, measure_grad_norm=False": ("fxzero", torch.float32, {"optimizer_state_dtype": "bf16", "measure_grad_norm": False}, 4 + 8 + 2 * 4),
    "fxzero fp8 state": ("fxzero", torch.float32, {"optimizer_state_dtype": "fp8"}, 4 + 8 + 2 * (_FP8_M + _FP8_V)),
    "fxzero fp8 state, compiled_update=False": ("fxzero", torch.float32, {"optimizer_state_dtype": "fp8", "compiled_update": False},
                                                4 + 8 + 2 * (_FP8_M + _FP8_V)),
    "fxzero fp8 state, measure_grad_norm=False": ("fxzero", torch.float32, {"optimizer_state_dtype": "fp8", "measure_grad_norm": False},
                                                  4 + 8 + 2 * (_FP8_M + _FP8_V)),
    "fxzero bf16 state + remainders": ("fxzero", torch.bfloat16, {"optimizer_state_dtype": "bf16", "param_remainders": True}, 4 + 4 + 4 + 2 * 4),
    "fxzero remainders": ("fxzero", torch.bfloat16, {"param_remainders": True}, 4 + 4 + 4 + 16),
    "fxzero remainders, compiled_update=False": ("fxzero", torch.bfloat16, {"param_remainders": True, "compiled_update": False}, 4 + 4 + 4 + 16),
    "fxzero remainders, fused=True": ("fxzero", torch.bfloat16, {"param_remainders": True, "fused": True}, 4 + 4 + 4 + 16),
    "fxzero stochastic rounding": ("fxzero", torch.bfloat16, {"param_rounding": "stochastic"}, 4 + 3 * 8 + 2),
    "fxzero stochastic rounding, compiled_update=False": ("fxzero", torch.bfloat16, {"param_rounding": "stochastic", "compiled_update": False},
                                                          4 + 3 * 8 + 2),
    "fxzero stochastic rounding, fused=True": ("fxzero", torch.bfloat16, {"param_rounding": "stochastic", "fused": True}, 4 + 3 * 8 + 2),
    "torchao AdamW8bit": ("AdamW8bit", torch.float32, {}, 4 + 8 + 4 * _AO_8BIT),
    "torchao AdamWFp8": ("AdamWFp8", torch.float32, {}, 4 + 8 + 4 * _AO_8BIT),
}
_FXZERO_OPTIONS = ("compiled_update", "measure_grad_norm", "optimizer_state_dtype", "param_remainders", "param_rounding", "exp_avg_dtype", "exp_avg_sq_dtype")


def _speed_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False), torch.nn.GELU(), torch.nn.Linear(2048, 1024, bias=False),
                               torch.nn.GELU(), torch.nn.Linear(1024, 1024, bias=False)).to(dtype)  # fmt: skip


class _SameWork:
    """torch's AdamW doing the pass over the gradients fxzero's ``step()`` makes besides the
    update: the global norm (fxzero reports it, clips by it and skips a non-finite step on it).
    The peer that does the same work. (Until stale gradients, fxzero's ``step()`` also zeroed its
    flat grad buffer, and this peer zeroed its gradients too; now the next backward overwrites
    fxzero's, as it writes torch's fresh ones after ``zero_grad()``.)"""

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(self.params, **options)

    def step(self) -> None:
        torch.nn.utils.get_total_norm([p.grad for p in self.params], foreach=True)  # clip_grad_norm_ without the scaling
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()


def _optimizer(who: str, model: torch.nn.Module, options: dict[str, Any], lr: float) -> Any:
    if who == "torch":
        return torch.optim.AdamW(model.parameters(), lr=lr, **options)
    if who == "torch+":
        return _SameWork(model, lr=lr, **options)
    if who == "fxzero":
        config = {k: v for k, v in options.items() if k in _FXZERO_OPTIONS}
        flags = {k: v for k, v in options.items() if k not in _FXZERO_OPTIONS and k != "zeroed_buffers"}
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, module=model,
                                          config=fxzero.Config(bucket_size=None, **config), **flags)  # fmt: skip
        if options.get("zeroed_buffers"):
            _zero_buffers_in_step(opt)
        return opt
    import torchao.optim

    return getattr(torchao.optim, who)(model.parameters(), lr=lr)


def _zero_buffers_in_step(opt: fxzero.DistributedOptimizer) -> None:
    """What ``step()`` did before stale gradients (``fxzero/optim/gradients/stale_grads.py``): zero the
    flat grad buffers at its end, so the next backward adds onto zeros. Nothing is then ever stale.
    The same-run measure of what leaving them stale saves."""
    buckets = opt.runtime.buckets
    opt.runtime.stale.consumed = lambda present: [b.grad_data.zero_() for b in buckets]


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA step returns before its kernels end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _add_bandwidth(device: torch.device) -> float:
    """Bytes per second of ``a.add_(b)`` over 64 MiB operands (two reads and a write per element)."""
    a, b = torch.ones(16 << 20, device=device), torch.ones(16 << 20, device=device)
    a.add_(b)
    _sync(device)
    start = time.perf_counter()
    a.add_(b)
    _sync(device)
    return 3 * a.nbytes / (time.perf_counter() - start)


def _steady_malloc() -> None:
    """Keep glibc from giving freed memory back to the OS (``--steady-malloc``). torch's foreach AdamW
    allocates temporaries of its params' size every step (``_foreach_sqrt``, ``_foreach_div``); by
    default glibc may map or trim them away again, and a step then faults their pages back in. That cost
    lands on rows stepping with foreach (torch's, and fxzero's at the default flags, where it wraps
    torch's) as the process's heap happens to lie: in two full runs of 2026-11-29, stochastic rounding
    against nearest at the default flags read 24.6 / 17.9 ms (paired 1.42) by default and 18.2 / 18.0 ms
    (0.99) with these settings. jemalloc or tcmalloc keep such memory too."""
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("--steady-malloc: glibc's mallopt refused the settings")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h); 32 MiB is the largest mmap threshold it takes on 64-bit."""


def _speed_rank(rounds: int, labels: list[str], device: str = "cpu", steady_malloc: bool = False) -> dict[str, Any]:
    if steady_malloc:
        _steady_malloc()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = torch.device(device)
    setups = {}
    for label in labels:
        who, dtype, options, _ = SPEED_MODES[label]
        if not who.startswith("fxzero") and world > 1:
            continue
        model = _speed_model(dtype).to(where)
        setups[label] = (model, _optimizer(who, model, options, 1e-4))
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank)).to(where)
    times: dict[str, list[float]] = {label: [] for label in setups}
    bandwidth = []
    for r in range(rounds + 1):  # round 0 warms up (torchao compiles its step there)
        order = list(setups) if r % 2 == 0 else list(reversed(setups))
        for label in order:
            model, opt = setups[label]
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            if world > 1:
                dist.barrier()
            _sync(where)
            start = time.perf_counter()
            opt.step()
            _sync(where)
            if r:
                times[label].append(time.perf_counter() - start)
            opt.zero_grad()
        bandwidth.append(_add_bandwidth(where))
    params = sum(p.numel() for p in _speed_model(torch.float32).parameters())
    compiles, seconds = compile_stats()
    return {"compiles": compiles, "compile_s": seconds, "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "bandwidth": statistics.median(bandwidth), "params": params,
            "rounds": {k: [1e3 * t for t in v] for k, v in times.items()}, "round_bandwidth": bandwidth[1:]}  # fmt: skip


def _speed_rows(result: dict[str, Any], world: int) -> list[list[str]]:
    rows, bw, n = [], result["bandwidth"], result["params"] / world
    fused = result["ms"].get("torch AdamW fused=True (fp32)")
    for label, ms in result["ms"].items():
        bound_bytes = SPEED_MODES[label][3] * n
        rows.append([label, f"{ms:.1f}", f"{bound_bytes / ms / 1e6:.2f}", f"{ms / (1e3 * bound_bytes / bw):.1f}",
                     f"{ms / fused:.2f}" if fused else "-"])  # fmt: skip
    return rows


TARGETS: tuple[tuple[str, str, str, float], ...] = (
    # (what, the row measured, the row it is held against, the most the ratio may be); "bound": the row's own bound
    ("fp32 fused=True vs torch fused", "fxzero fp32 state, fp32 params, fused=True", "torch AdamW fused=True (fp32)", 1.2),
    ("fp32 fused=True, no norm, vs torch fused", "fxzero fp32 state, fp32 params, fused=True, measure_grad_norm=False",
     "torch AdamW fused=True (fp32)", 1.2),
    ("fp32 fused=True vs torch fused doing the same work", "fxzero fp32 state, fp32 params, fused=True",
     "torch AdamW fused=True + grad norm", 1.2),
    ("bf16 state vs fxzero fp32 fused", "fxzero bf16 state", "fxzero fp32 state, fp32 params, fused=True", 1.0),
    ("bf16 state vs its bound", "fxzero bf16 state", "bound", 1.5),
    ("bf16 state, no norm, vs fp32 fused, no norm", "fxzero bf16 state, measure_grad_norm=False",
     "fxzero fp32 state, fp32 params, fused=True, measure_grad_norm=False", 1.0),
    ("bf16 state, no norm, vs its bound", "fxzero bf16 state, measure_grad_norm=False", "bound", 1.5),
    ("fp8 state vs fxzero fp32 fused", "fxzero fp8 state", "fxzero fp32 state, fp32 params, fused=True", 1.0),
    ("fp8 state vs its bound", "fxzero fp8 state", "bound", 1.5),
    ("fp8 state, no norm, vs its bound", "fxzero fp8 state, measure_grad_norm=False", "bound", 1.5),
    ("remainders vs fp32-master fused", "fxzero remainders", "fxzero fp32 state, bf16 params + fp32 masters, fused=True", 1.3),
    ("remainders vs fp32-master, both fused=True", "fxzero remainders, fused=True", "fxzero fp32 state, bf16 params + fp32 masters, fused=True", 1.3),
    ("remainders vs fp32-master (same flags)", "fxzero remainders", "fxzero fp32 state, bf16 params + fp32 masters", 1.3),
    ("remainders vs fp32-master, both compiled_update=False", "fxzero remainders, compiled_update=False",
     "fxzero fp32 state, bf16 params + fp32 masters, compiled_update=False", 1.3),
    ("stochastic vs nearest (same flags)", "fxzero stochastic rounding", "fxzero fp32 state, bf16 params + fp32 masters", 1.2),
    ("stochastic vs nearest, fused=True", "fxzero stochastic rounding, fused=True", "fxzero fp32 state, bf16 params + fp32 masters, fused=True", 1.2),
    ("stochastic vs nearest, both compiled_update=False", "fxzero stochastic rounding, compiled_update=False",
     "fxzero fp32 state, bf16 params + fp32 masters, compiled_update=False", 1.2),
)


def _paired_ratios(result: dict[str, Any], world: int, row: str, against: str) -> list[float]:
    """``row``'s time over ``against``'s (or over its bound at that round's ``torch.add_`` bandwidth),
    round by round. Why per round: the two ran seconds apart in one round, so each ratio compares them
    on the machine as it was then (its bandwidth drifts between rounds); the ratio of two medians may
    take each median from another round."""
    times = result["rounds"][row]
    if against == "bound":
        bound_bytes = SPEED_MODES[row][3] * result["params"] / world
        return [t / (1e3 * bound_bytes / bw) for t, bw in zip(times, result["round_bandwidth"])]
    return [t / base for t, base in zip(times, result["rounds"][against])]


def _target_rows(result: dict[str, Any], world: int) -> list[list[str]]:
    """Each target of issue 54 as the median of its paired per-round ratios (the middle half of
    them beside it: the run's noise), and whether it is met."""
    rows, ms = [], result["ms"]
    for what, row, against, most in TARGETS:
        if row not in ms or (against != "bound" and against not in ms):
            continue
        base = 1e3 * SPEED_MODES[row][3] * result["params"] / world / result["bandwidth"] if against == "bound" else ms[against]
        ratios = sorted(_paired_ratios(result, world, row, against))
        ratio, low, high = statistics.median(ratios), ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        rows.append([what, f"{ms[row]:.1f} / {base:.1f}", f"{ratio:.2f}", f"{low:.2f}-{high:.2f}", f"<= {most}", "yes" if ratio <= most else "no"])
    return rows


# ---- drift -------------------------------------------------------------------------------------
DRIFT_RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "torchao AdamW8bit": ("AdamW8bit", {}),
    "torchao AdamWFp8": ("AdamWFp8", {}),
    "fxzero bf16 state": ("fxzero", {"optimizer_state_dtype": "bf16"}),
    "fxzero fp8 state": ("fxzero", {"optimizer_state_dtype": "fp8"}),
    "fxzero bf16 state, compiled_update=False": ("fxzero", {"optimizer_state_dtype": "bf16", "compiled_update": False}),
    "fxzero fp8 state, compiled_update=False": ("fxzero", {"optimizer_state_dtype": "fp8", "compiled_update": False}),
}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 512, bias=False), torch.nn.GELU(), torch.nn.Linear(512, 512, bias=False),
                               torch.nn.GELU(), torch.nn.Linear(512, 128, bias=False))  # fmt: skip


def _mlp_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1000 + step))
    teacher = torch.randn(128, 128, generator=torch.Generator().manual_seed(123)) / 128**0.5
    return torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=256, block_size=64, dim=128, n_layer=2, n_head=4))


_DATA: list[torch.Tensor] = []


def _gpt_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    if not _DATA:
        _DATA.append(torch.frombuffer(bytearray(load_bytes(None)), dtype=torch.uint8).long())
    data = _DATA[0]
    starts = torch.randint(0, data.numel() - 65, (16,), generator=torch.Generator().manual_seed(step)).tolist()
    windows = torch.stack([data[i : i + 65] for i in starts])
    return model(windows[:, :-1], windows[:, 1:])


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module, int], torch.Tensor]]] = {
    "MLP 128-512-512-128": (_mlp, _mlp_loss),
    "GPT 2x128": (_gpt, _gpt_loss),
}


def _train(model_name: str, who: str, options: dict[str, Any], lr: float, checkpoints: tuple[int, ...]) -> dict[int, tuple[float, list]]:
    build, loss_of = MODELS[model_name]
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr) if who == "torch" else _optimizer(who, model, options, lr)
    seen = {}
    for step in range(1, max(checkpoints) + 1):
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in checkpoints:
            seen[step] = (loss.item(), [p.detach().clone() for p in model.parameters()])
    return seen


def _distance(a: list, b: list, start: list) -> float:
    moved = math.sqrt(sum(float((x - s).square().sum()) for x, s in zip(b, start)))
    return math.sqrt(sum(float((x - y).square().sum()) for x, y in zip(a, b))) / moved


def _drift(checkpoints: tuple[int, ...], lrs: tuple[float, ...], labels: list[str]) -> list[list[str]]:
    rows = []
    for model_name, (build, _) in MODELS.items():
        start = [p.detach().clone() for p in build().parameters()]
        for lr in lrs:
            ref = _train(model_name, "torch", {}, lr, checkpoints)
            runs = {label: _train(model_name, *DRIFT_RUNS[label], lr, checkpoints) for label in labels}
            for step in checkpoints:
                ref_loss, ref_params = ref[step]
                row = [model_name, f"{lr:g}", str(step), f"{ref_loss:.4f}"]
                for label in labels:
                    loss, params = runs[label][step]
                    row.append(f"{loss:.4f} ({loss / ref_loss - 1:+.1%}), {_distance(params, ref_params, start):.3f}")
                rows.append(row)
            print(f"  drift {model_name} lr {lr:g} done", flush=True)
    return rows


def _picked(labels: Any, only: str) -> list[str]:
    """The labels ``--only`` names a part of (every label without it)."""
    return [label for label in labels if not only or any(part in label for part in only.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-world-2", action="store_true")
    parser.add_argument("--skip-drift", action="store_true")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="keep glibc from returning freed memory to the OS in the speed part (see _steady_malloc)")
    parser.add_argument("--steps", default="100,300", help="drift checkpoints")
    parser.add_argument("--only", default="", help="comma-separated parts of the labels of the rows to run, speed and drift (default: every row)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the speed part's world 1 runs (cuda: the first GPU; world 2 and the drift stay on the CPU)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    from tabulate import tabulate

    torch.set_num_threads(1)
    where = "1 thread per rank" if args.device == "cpu" else f"world 1 on {torch.cuda.get_device_name()}"
    malloc = ", glibc kept from returning memory (--steady-malloc)" if args.steady_malloc else ""
    print(f"# optimizer update: torch {torch.__version__}, {where}{malloc}, {time.strftime('%Y-%m-%d')}\n")
    headers = ["update", "step() ms", "achieved GB/s", "x its bound", "x torch fused"]
    if not args.skip_speed:
        started = time.perf_counter()
        one = _speed_rank(args.rounds, _picked(SPEED_MODES, args.only), args.device, args.steady_malloc)
        print(f"World 1, {one['params'] / 1e6:.2f}M params, torch.add_ {one['bandwidth'] / 1e9:.1f} GB/s in the same rounds, "
              f"median of {args.rounds} paired rounds ({time.perf_counter() - started:.0f} s; compiled_update's Inductor compiles "
              f"{one['compile_s']:.0f} s, once, in round 0, {'cold' if one['compile_s'] > 20 else 'warm (Inductor cache)'}):\n")  # fmt: skip
        print(tabulate(_speed_rows(one, 1), headers=headers, tablefmt="github"), flush=True)
        print(f"\nTargets at world 1 ({one['compiles']} Inductor graphs, {one['compile_s']:.0f} s):\n")
        print(tabulate(_target_rows(one, 1), headers=["target", "median ms / ms", "paired ratio", "middle half", "target", "met"],
                       tablefmt="github"), flush=True)  # fmt: skip
    if not args.skip_speed and not args.skip_world_2:
        two = run_ranks(2, _speed_rank, args.rounds, _picked(SPEED_MODES, args.only), "cpu", args.steady_malloc, timeout=3600)[0]
        close_pools()
        print(f"\nWorld 2 (gloo; step() includes the reduce-scatter and all-gather; rank 0's times), torch.add_ "
              f"{two['bandwidth'] / 1e9:.1f} GB/s; bound bytes are the rank's half:\n")  # fmt: skip
        print(tabulate(_speed_rows(two, 2), headers=headers, tablefmt="github"), flush=True)
    if not args.skip_drift:
        checkpoints = tuple(int(s) for s in args.steps.split(","))
        labels = _picked(DRIFT_RUNS, args.only)
        rows = _drift(checkpoints, (1e-3, 3e-4), labels)
        print("\nDrift against torch.optim.AdamW with fp32 state (loss (its difference), param distance / the fp32 run's update):\n")
        print(tabulate(rows, headers=["model", "lr", "step", "fp32 loss", *labels], tablefmt="github"))


if __name__ == "__main__":
    main()
