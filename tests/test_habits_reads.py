"""Reading params right after ``step()``, and reading them on one rank only.

Under DDP every param is current when ``opt.step()`` returns, so training loops read
them there: an EMA, logged norms, ``parameters_to_vector``, a sub-module's
``state_dict()``, another module or ``functional_call`` over the same Parameters, a second
compiled model for eval; and rank 0 alone saves ``model.state_dict()`` (or the optimizer's)
before a barrier. With the default ``Config`` each of these reads the new values on every
rank, and a rank-0-only read never waits for its peers. The gathers here are *deferred*
(their data lands only when waited for, :mod:`doubles`), so a read that the step did not
wait for would see last step's values at once.
"""

from __future__ import annotations

import io
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

import fxzero
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.testing import run_ranks

from doubles import deferred_all_gather
from models import batch, build, loss_fn, param_groups

STEPS, GLOBAL = 2, 8

_READERS: dict[str, Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = {
    "parameters_to_vector": lambda model, x: parameters_to_vector(model.parameters()).clone(),
    "named_parameters": lambda model, x: torch.cat([p.detach().flatten().clone() for _, p in model.named_parameters()]),
    "param norms": lambda model, x: torch.stack([p.detach().norm() for p in model.parameters()]),
    "sub-module state_dict": lambda model, x: torch.cat([v.flatten() for v in model.blocks[1].state_dict().values()]),
    "functional_call": lambda model, x: torch.func.functional_call(build("gpt", seed=5), dict(model.named_parameters()), (x,)),
    "second torch.compile": lambda model, x: _second_compile(model)(x),
}


def _second_compile(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Another ``torch.compile`` of the managed model (for eval), built once per model."""
    if not hasattr(model, "_eval_compiled"):
        model._eval_compiled = torch.compile(model, backend="eager")  # type: ignore[assignment]
    return model._eval_compiled  # type: ignore[return-value]


def _reads_after_each_step(config: fxzero.Config) -> dict[str, list[torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, config=config, module=model)
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    reads: dict[str, list[torch.Tensor]] = {name: [] for name in _READERS}
    reads["truth"] = []
    size = GLOBAL // world
    with mock.patch.object(DataParallelGroup, "all_gather_async", deferred_all_gather):
        for step in range(STEPS):
            x, y = batch("gpt", step, GLOBAL)
            loss_fn("gpt", cmodel(x[rank * size : (rank + 1) * size]), y[rank * size : (rank + 1) * size]).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for name, read in _READERS.items():
                    reads[name].append(read(model, x[:2]).detach())
                opt.finish_param_sync()  # the truth: every gather waited for
                for name, read in _READERS.items():
                    reads.setdefault(name + " (truth)", []).append(read(model, x[:2]).detach())
    return reads


def test_reads_right_after_step_see_the_new_params_on_every_rank() -> None:
    ranks = run_ranks(2, _reads_after_each_step, fxzero.Config(bucket_size=2000), timeout=300)
    for reads in ranks:
        for name in _READERS:
            for step, (read, truth) in enumerate(zip(reads[name], reads[name + " (truth)"])):
                assert torch.equal(read, truth), f"{name}: stale read after step {step + 1}"
    for name in _READERS:  # and the ranks agree
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][name], ranks[1][name])), name


def test_with_overlap_on_the_same_reads_need_finish_param_sync() -> None:
    """The opt-in mode keeps its documented contract: reads outside the forward call
    ``opt.finish_param_sync()`` first (the test above's "truth"); without it they are stale,
    which is why it is not the default."""
    ranks = run_ranks(2, _reads_after_each_step, fxzero.Config(bucket_size=2000, overlap_param_gather=True), timeout=300)
    stale = [name for name in _READERS if not torch.equal(ranks[0][name][0], ranks[0][name + " (truth)"][0])]
    assert "parameters_to_vector" in stale and "functional_call" in stale, stale


# ---- reads on rank 0 only, then a collective ------------------------------------------
def _rank0_reads(overlap: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    config = fxzero.Config(bucket_size=2000, overlap_param_gather=overlap)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, config=config, module=model)
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    size = GLOBAL // world
    for step, what in enumerate(("model", "optimizer", "eval")):
        x, y = batch("gpt", step, GLOBAL)
        loss = loss_fn("gpt", cmodel(x[rank * size : (rank + 1) * size]), y[rank * size : (rank + 1) * size])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:  # the DDP checkpoint habit, or an eval on rank 0 only
            if what == "eval":
                with torch.no_grad():
                    model(x[:2])
            else:
                torch.save(model.state_dict() if what == "model" else opt.rank_state_dict(), io.BytesIO())
        dist.barrier() if step % 2 == 0 else dist.all_reduce(loss.detach())
    opt.finish_param_sync()
    return float(parameters_to_vector(model.parameters()).sum())


@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlap"])
def test_rank0_only_reads_then_a_collective_do_not_hang(overlap: bool) -> None:
    """Rank 0 saves ``model.state_dict()`` / ``opt.rank_state_dict()`` or evaluates alone while the
    other rank goes on to a barrier / all-reduce: both finish (with overlap on too: the step
    launched every gather on every rank, so rank 0's wait needs nothing more from its peer)."""
    sums = run_ranks(2, _rank0_reads, overlap, timeout=60)
    assert sums[0] == sums[1]


def _resume_every_rank_from_rank0s_file() -> str:
    rank = dist.get_rank()
    model = build("gpt")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, config=fxzero.Config(bucket_size=2000))
    x, y = batch("gpt", 0, 4)
    loss_fn("gpt", model(x), y).backward()
    opt.step()
    saved = [opt.rank_state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, group_src=0)  # what every rank reads back from rank 0's file
    try:
        opt.load_state_dict(saved[0])
    except ValueError as err:
        return str(err)
    return "loaded"


def test_resuming_every_rank_from_a_rank0_only_optimizer_file_fails_on_every_rank() -> None:
    """Rank 1 cannot take rank 0's shard; rank 0 could, but must not go on to gather params its
    peer will never send: both raise, rank 0 naming rank 1's problem."""
    errors = run_ranks(2, _resume_every_rank_from_rank0s_file, timeout=60)
    assert "saved on rank 0 of 2, loading on rank 1 of 2" in errors[1] and "save_checkpoint" in errors[1]
    assert errors[0].startswith("load_state_dict failed on rank(s) [1]") and "saved on rank 0" in errors[0]
