"""The rank side of ``memory.py``: build one config, train a few steps, measure each phase.

Memory is measured per phase of every step: the peak reached *during* model and
optimizer construction, each forward, each backward and each ``step()`` + ``zero_grad()``
(on CPU the resident-set high-water mark, reset at the start of each phase through
``/proc/self/clear_refs``; on a GPU ``torch.cuda.max_memory_allocated``, reset the same
way). The process's own baseline (interpreter, torch, gloo) is included, as in RSS.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ModelArgs, Transformer, get_batch  # noqa: E402

import peers  # noqa: E402

PHASES = ("build", "forward", "backward", "step")


@dataclasses.dataclass(frozen=True)
class Model:
    """A GPT of ``examples/train_gpt.py`` and the batch it trains on (per rank)."""

    name: str
    dim: int
    n_layer: int
    n_head: int
    seq: int = 64
    batch: int = 2
    vocab: int = 256

    def args(self) -> ModelArgs:
        return ModelArgs(vocab_size=self.vocab, block_size=self.seq, dim=self.dim, n_layer=self.n_layer, n_head=self.n_head)


class Meter:
    """Peak memory of the phase since :meth:`reset`, in MiB."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return _status_kib("VmHWM") / 1024

    def now(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / 2**20
        return _status_kib("VmRSS") / 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _setup(device_type: str) -> tuple[torch.device, object, object]:
    """This rank's device, the process group to train over (NCCL on a GPU) and DDP's device_ids."""
    if device_type != "cuda":
        return torch.device("cpu"), None, None
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank), dist.new_group(backend="nccl"), [rank]


def measure(config: str, model: Model, steps: int, device_type: str = "cpu", bucket_size: object = "auto") -> dict:
    """Train ``config`` for ``steps`` steps; peak MiB per phase, state bytes, step times."""
    device, group, device_ids = _setup(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    meter = Meter(device)
    data = torch.frombuffer(bytearray(peers.load_bytes(None)), dtype=torch.uint8).long()
    batch = types.SimpleNamespace(seq=model.seq, global_batch=model.batch * world)
    baseline = meter.now()
    meter.reset()
    torch.manual_seed(0)
    net = Transformer(model.args()).to(device)
    cmodel, opt, state_bytes = peers.build(config, net, bucket_size, group=group, device_ids=device_ids)
    peaks = {"build": meter.peak()}
    times = []
    for step in range(1, steps + 1):
        x, y = get_batch(data, step, batch, rank, world, device)
        dist.barrier()
        start = time.perf_counter()
        for phase, run in (("forward", lambda: cmodel(x, y)), ("backward", lambda: loss.backward()), ("step", lambda: _step(opt))):
            meter.reset()
            result = run()
            if phase == "forward":
                loss = result
            peaks[phase] = max(peaks.get(phase, 0.0), meter.peak())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "baseline": baseline,
        "peaks": peaks,
        "peak": max(peaks.values()),
        "state_bytes": state_bytes(),
        "step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else float("nan"),
        "params": sum(p.numel() for p in net.parameters()),
        "buckets": len(opt.runtime.buckets) if hasattr(opt, "buckets") else None,
    }


def _step(opt) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)
