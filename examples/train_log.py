"""The main job's progress report (examples/train_gpt.py), laid out like torchtitan's metrics logger:

    compiling: step 1 runs torch.compile(backend="fxzero", inner compiler inductor); its line follows when it is done
    step    1/150 | loss 5.5318 | lr 1.33e-04 | grad norm 2.031 | first step 22.9 s (compiles) | peak rss 640 MiB | ETA --
    step   10/150 | loss 4.1010 | lr 1.33e-03 | grad norm 0.844 | 2,176 tok/s | 941 ms/step | peak rss 652 MiB | ETA 2m12s

Each line: the step of the run's total; the loss, the mean over every rank and every step since
the previous line; the learning rate and the global gradient norm (``StepResult.grad_norm``,
before clipping) of the step logged; throughput over those steps; the peak memory of this rank
so far (the resident set on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU); and the time
left at the mean step time since the first line (the first step compiles: it would mislead).

``--metrics FILE`` writes the same as JSON lines: the first line describes the run
(``{"run": {...}}``), each further line is one logged step. ``--tensorboard DIR`` writes the
same scalars for TensorBoard (the ``tensorboard`` package: ``pip install -e .[tensorboard]``).
Only rank 0 reports.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Optional

import torch

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' (or pip install tensorboard)"


def tensorboard_missing() -> bool:
    """Whether ``--tensorboard`` cannot work here: checked before training, not after the compile."""
    return importlib.util.find_spec("tensorboard") is None


def machine(device: torch.device) -> str:
    """The hardware a run used: the GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores"


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): this process's peak so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak rss"  # ru_maxrss is KiB on Linux


def duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class TrainLog:
    """Step lines on stdout, and the optional metrics file and TensorBoard events, from rank 0.

    ``run`` describes the run (machine, world, model, setup, ...): the metrics file's first line.
    ``compiles``: the first step of this process compiles (its line says so instead of a tok/s
    that would count the compile)."""

    def __init__(self, steps: int, tokens_per_step: int, device: torch.device, run: dict[str, Any], *, enabled: bool,
                 compiles: bool, metrics: Optional[str] = None, tensorboard: Optional[str] = None):
        self.steps, self.tokens_per_step, self.device, self.enabled = steps, tokens_per_step, device, enabled
        self.compiles = compiles
        self.last_step: Optional[int] = None
        self.first: Optional[tuple[int, float]] = None  # (step, time) of the first line
        self.t_last = time.perf_counter()
        self.metrics = self.writer = None
        if not enabled:
            return
        if metrics:
            Path(metrics).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(metrics, "w")  # noqa: SIM115 - one line per logged step, closed by close()
            self.metrics.write(json.dumps({"run": {**run, "date": datetime.date.today().isoformat(),
                                                   "steps": steps, "tokens_per_step": tokens_per_step}}) + "\n")
        if tensorboard:
            try:  # imported here: an optional package
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # found, but one of its own dependencies missing
                raise SystemExit(f"{TENSORBOARD_MISSING} ({exc})") from exc
            self.writer = SummaryWriter(tensorboard)

    def start(self, step: int, compiler: str) -> None:
        """Before the first step this process runs: the clock starts; a compiled run says it compiles."""
        self.last_step, self.t_last = step - 1, time.perf_counter()
        if self.enabled and self.compiles:
            print(f'compiling: step {step} runs torch.compile(backend="fxzero", inner compiler {compiler}); '
                  "its line follows when it is done", flush=True)

    def step(self, step: int, loss: float, lr: float, grad_norm: float) -> dict[str, Any]:
        """Report step ``step``; ``loss``: the mean over the steps since the previous report."""
        now = time.perf_counter()
        n = step - self.last_step
        ms = 1000 * (now - self.t_last) / n
        compiled = self.compiles and self.first is None
        if self.first is not None:
            eta = (now - self.first[1]) / (step - self.first[0]) * (self.steps - step)
        else:
            eta = None if compiled else ms / 1000 * (self.steps - step)
            self.first = (step, now)
        memory, kind = peak_memory(self.device)
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tok_per_s": self.tokens_per_step / ms * 1000,
            "ms_per_step": ms, "includes_compile": compiled, "memory_mib": memory / 2**20, "memory": kind, "eta_s": eta,
        }  # fmt: skip
        self.last_step, self.t_last = step, now
        if self.enabled:
            self._write(record)
        return record

    def _write(self, r: dict[str, Any]) -> None:
        speed = (f"first step {r['ms_per_step'] / 1000:.1f} s (compiles)" if r["includes_compile"]
                 else f"{r['tok_per_s']:,.0f} tok/s | {r['ms_per_step']:.0f} ms/step")
        print(f"step {r['step']:4d}/{self.steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f} | "
              f"{speed} | {r['memory']} {r['memory_mib']:,.0f} MiB | ETA {duration(r['eta_s'])}", flush=True)
        if self.metrics:
            self.metrics.write(json.dumps(r) + "\n")
            self.metrics.flush()  # a killed run keeps the steps it logged
        if self.writer:
            for key in ("loss", "lr", "grad_norm", "tok_per_s", "memory_mib"):
                self.writer.add_scalar(f"train/{key}", r[key], r["step"])

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.writer:
            self.writer.close()
