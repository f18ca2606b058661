"""benchmarks/size_check.py: predicted (``fxzero explain --size --transport gloo`` with the batch) vs
measured per rank: buffers, optimizer state and the peak of torch's allocated bytes in a training
step (benchmarks/allocated_peak.py: every tensor from before the model is built; the step's
forward, backward and ``opt.step()`` of 2 eager steps, batch 2 x 64, gloo). Also the peak resident
set growth, which adds the libraries' pages and the C allocator's cache. 4 ranks of the 43M GPT
need about 2.5 GB."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import torch.distributed as dist

import fxzero
from allocated_peak import AllocatedPeak
from fxzero.explainer.activations import estimate_activations
from fxzero.explainer.sizing import size_run
from fxzero.testing import run_ranks

MODELS = {"main job GPT (train_gpt.py defaults)": {}, "43M GPT": dict(dim=768, n_layer=6, n_head=12, block_size=64)}
BATCH, STEPS = (2, 64), 2


def _vm(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def work(args: dict, batch: tuple = BATCH, steps: int = STEPS) -> dict:
    """One rank: build, wrap and train ``steps`` eager steps, the allocator tracked throughout."""
    from train_gpt import ModelArgs, Transformer

    torch.set_num_threads(1)
    base = _vm("VmRSS:")
    with AllocatedPeak() as tracker:
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**args))
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model)
        ids = torch.randint(0, 256, batch)
        for step in range(steps):
            with tracker.phase(f"forward {step}"):
                loss = model(ids, ids)
            with tracker.phase(f"backward {step}"):
                loss.backward()
                del loss
            with tracker.phase(f"step {step}"):
                opt.step()
                opt.zero_grad()
    peaks = tracker.peaks()
    where = max(peaks, key=peaks.get)
    buffers = sum(b.nbytes for b in opt.buffers)
    return {"rank": dist.get_rank(), "buffers": buffers, "state": opt.state_bytes, "runtime": opt.runtime_bytes,
            "peak": peaks[where], "where": where, "rss": _vm("VmHWM:") - base}  # fmt: skip


def predicted(args: dict, world: int, rank: int, batch: tuple = BATCH):
    """``fxzero explain --size --world-size W --transport gloo`` on the meta device, this rank's batch."""
    from train_gpt import ModelArgs, Transformer

    with torch.device("meta"):
        model = Transformer(ModelArgs(**args))
    ids = torch.empty(batch, dtype=torch.long, device="meta")
    return size_run(model, world, transport="gloo", rank=rank, activations=estimate_activations(model, (ids, ids)))


if __name__ == "__main__":
    print("| model | world | rank | predicted buffers | measured buffers | predicted state | measured state "
          "| predicted peak | measured peak (allocated) | in | measured / predicted | peak RSS growth |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, args in MODELS.items():
        for world in (2, 4):
            for m in run_ranks(world, work, args, timeout=1500):
                p = predicted(args, world, m["rank"])
                row = [p.param_bytes + p.grad_bytes, m["buffers"], p.state_bytes + p.master_bytes, m["state"], p.peak_bytes, m["peak"]]
                print(f"| {name} | {world} | {m['rank']} | " + " | ".join(f"{v:,}" for v in row)
                      + f" | {m['where']} | {m['peak'] / p.peak_bytes:.4f} | {m['rss']:,} |", flush=True)  # fmt: skip
