"""What ``model_suite.py`` runs on each rank: one model trained a few steps, by fxzero or by
the reference (DDP + ``torch.compile`` + ``torch.optim``), from the same initial params on the
same batches with the same random streams.

The two runs go to the ranks as separate tasks, so that one failing (its rank pool is then
restarted) leaves the other's result standing; each returns its per-step losses and final
params, compared in the caller.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fxzero
from suite_models import batch, entry, loss

__all__ = ["GLOBAL", "STEPS", "SGD", "build", "train"]

STEPS, GLOBAL = 3, 4
"""Steps per run; examples in the global batch (2 per rank at world 2)."""

SGD = dict(lr=0.05, momentum=0.9)
"""torch.optim.SGD's settings in both runs. SGD, not Adam: Adam turns Inductor's rounding on
gradients that are nearly zero into lr-sized steps, which would hide the errors looked for
(a gradient in another param's slot, a stale param: both move params by lr x gradient)."""

Kind = Literal["fxzero", "reference"]


def build(name: str) -> torch.nn.Module:
    """The model ``name`` from its seeded initial params, in training mode."""
    torch.manual_seed(0)
    return entry(name).build().train()


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Params that train (frozen sinusoidal position tables stay out, as in DDP)."""
    return [p for p in model.parameters() if p.requires_grad]


def _fxzero(model: torch.nn.Module) -> tuple[Any, Any, dict[str, int]]:
    numel = sum(p.numel() for p in trainable(model))
    # ~4 buckets: at the default 4M elements every shrunk model would fit one bucket, where the
    # full-size models (100M+ params) have dozens; bucket boundaries are part of what is tested
    config = fxzero.Config(bucket_size=max(numel // 4, 1))
    opt = fxzero.DistributedOptimizer(trainable(model), torch.optim.SGD, config=config, module=model, **SGD)
    return torch.compile(model, backend="fxzero"), opt, {"buckets": len(opt.runtime.buckets)}


def _reference(model: torch.nn.Module) -> tuple[Any, Any, dict[str, int]]:
    # find_unused_parameters: decoder-only halves of encoder-decoders keep unused cross-attention
    # weights, pooler layers go unused by LM heads; fxzero needs nothing of the kind
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    return torch.compile(ddp), torch.optim.SGD(trainable(model), **SGD), {}


def _local(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    local = GLOBAL // world
    return {k: v[rank * local : (rank + 1) * local] for k, v in b.items()}


def _seed_streams(rank: int) -> None:
    """Each rank draws its own dropout masks, the same in both runs (BigBird's random
    attention blocks come from numpy)."""
    torch.manual_seed(1234 + rank)
    np.random.seed(1234 + rank)
    random.seed(1234 + rank)


def train(name: str, kind: Kind) -> dict[str, Any]:
    """Train model ``name`` ``STEPS`` steps on this rank's half of the global batch."""
    torch._dynamo.reset()
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cmodel, opt, facts = (_fxzero if kind == "fxzero" else _reference)(model)
    data = _local(batch(name, GLOBAL), rank, world)
    # optimize_ddp off: DDPOptimizer splits the graph at bucket boundaries and each piece draws
    # its own Inductor random seeds, so dropout masks would differ from fxzero's one graph
    context = torch._dynamo.config.patch(optimize_ddp=False) if kind == "reference" else contextlib.nullcontext()
    losses = []
    _seed_streams(rank)
    with context:
        for _ in range(STEPS):
            value = loss(cmodel, data)
            value.backward()
            opt.step()
            opt.zero_grad()
            losses.append(value.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max((params[n] - p).abs().max().item() for n, p in initial.items())
    return {"losses": losses, "params": params, "moved": moved, "seconds": time.perf_counter() - start, **facts}
