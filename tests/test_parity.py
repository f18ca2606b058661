"""N-rank DistributedOptimizer training vs plain single-process eager training.

Every rank takes its slice of the same global batch; the reference trains one model on
the whole batch with ``torch.optim.AdamW`` and ``clip_grad_norm_``. Averaged gradients
make the two mathematically identical, so only float rounding may differ.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.gradients import grad_exchange
from fxzero.testing import run_ranks

from models import batch, build, loss_fn, param_groups

STEPS = 10
GLOBAL_BATCH = 8
LR = 1e-2
CLIP = 0.5
BUCKET = 2000  # elements: several buckets for both models


def _train_distributed(
    name: str, bucket_size: int, steps: int = STEPS, grad_collective: str = "auto", chunk_bytes: int | None = None
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(name)
    config = fxzero.Config(bucket_size=bucket_size, clip_grad=CLIP, grad_collective=grad_collective)
    with contextlib.ExitStack() as small:
        if chunk_bytes is not None:  # chunks of a few elements: every bucket turns the receive slots many times
            small.enter_context(mock.patch.object(grad_exchange, "CHUNK_BYTES", chunk_bytes))
            small.enter_context(mock.patch.object(grad_exchange, "SLOTS", 2))
        opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model)
    retired = _count_retires_in_backward(opt)
    losses, local = [], GLOBAL_BATCH // world
    for step in range(steps):
        x, y = batch(name, step, GLOBAL_BATCH)
        loss = loss_fn(name, model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local])
        loss.backward()
        result = opt.step()
        opt.zero_grad()
        assert not result.skipped
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "params": {n: v.clone() for n, v in model.state_dict().items()},  # waits for gathers
        "state_bytes": opt.state_bytes,
        "buckets": len(opt.runtime.buckets),
        "collective": opt.dp.grad_collective,
        "retired_in_backward": retired[0],
        "chunks": sum(map(len, exchange.chunks)) if (exchange := _exchange(opt)) is not None else 0,
    }


def _exchange(opt: fxzero.DistributedOptimizer) -> "grad_exchange.GradExchange | None":
    """The chunked all-to-all reduction, or ``None`` where another transport reduces."""
    reduction = opt.runtime.reductions.reduction
    return reduction if isinstance(reduction, grad_exchange.GradExchange) else None


def _count_retires_in_backward(opt: fxzero.DistributedOptimizer) -> list[int]:
    """How many exchange chunks were finished while a backward ran (the exchange keeping up)."""
    count = [0]
    exchange = _exchange(opt)
    if exchange is not None:
        retire = exchange._retire

        def counted() -> None:
            count[0] += torch._C._current_graph_task_id() != -1
            retire()

        exchange._retire = counted
    return count


def _train_reference(name: str, steps: int = STEPS) -> dict:
    model = build(name)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(name, step, GLOBAL_BATCH)
        loss = loss_fn(name, model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize(
    ("name", "world", "grad_collective"),
    [(n, w, "auto") for n in ("mlp", "gpt") for w in (1, 2, 4)]
    + [("gpt", w, c) for c in ("reduce_scatter", "all_reduce") for w in (2, 4)],
)
def test_parity_with_single_process_eager(name: str, world: int, grad_collective: str) -> None:
    """"auto" is the all-to-all reduction on gloo (with more buckets than receive
    buffers, so buckets wait for their buffer); the reduce-scatter into the shard view
    and the in-place all-reduce run too."""
    reference = _train_reference(name)
    results = run_ranks(world, _train_distributed, name, BUCKET, grad_collective=grad_collective)
    assert results[0]["buckets"] >= 2
    if world > 1:
        assert results[0]["collective"] == ("all_to_all" if grad_collective == "auto" else grad_collective)
    for rank_result in results:
        torch.testing.assert_close(rank_result["losses"], reference["losses"], atol=1e-5, rtol=0)
        assert rank_result["params"].keys() >= reference["params"].keys()
        for key, value in reference["params"].items():
            torch.testing.assert_close(rank_result["params"][key], value, atol=1e-4, rtol=0, msg=key)
    # The loss must actually move, or parity would be vacuous.
    assert reference["losses"][-1] < reference["losses"][0]


def test_optimizer_state_is_sharded() -> None:
    """Each rank's optimizer state is ~1/N of plain AdamW's (fp32 params alias the mains)."""
    model = build("gpt")
    full = 2 * 4 * sum(p.numel() for p in model.parameters())  # exp_avg + exp_avg_sq
    for world in (2, 4):
        results = run_ranks(world, _train_distributed, "gpt", BUCKET, steps=1)
        for r in results:
            assert r["state_bytes"] <= full / world * 1.10, (world, r["state_bytes"], full)
        assert sum(r["state_bytes"] for r in results) >= full


def _train_unused(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)})
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fxzero.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.5, config=fxzero.Config(bucket_size=64)
    )
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        model["used"](x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.detach().clone(), initial[n]) for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2])
def test_unused_param_with_weight_decay_is_untouched(world: int) -> None:
    for per_rank in run_ranks(world, _train_unused, STEPS):
        for name, (final, initial) in per_rank.items():
            if name.startswith("unused"):
                assert torch.equal(final, initial), name
            else:
                assert not torch.equal(final, initial), name


def _accumulate(microbatches: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("mlp")
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=BUCKET))
    x, y = batch("mlp", 0, GLOBAL_BATCH * microbatches)
    chunks = list(zip(x.chunk(world * microbatches), y.chunk(world * microbatches)))[rank::world]
    launched = []
    for i, (xc, yc) in enumerate(chunks):
        last = i == len(chunks) - 1
        with opt.no_sync() if not last else contextlib.nullcontext():
            (loss_fn("mlp", model(xc), yc) / microbatches).backward()
        launched.append(opt.runtime.reductions.in_flight or all(opt.runtime.ledger.launched))
    opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "launched": launched}


def test_gradient_accumulation_no_sync_matches_big_batch() -> None:
    microbatches = 4
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch("mlp", 0, GLOBAL_BATCH * microbatches)
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    for result in run_ranks(2, _accumulate, microbatches):
        assert result["launched"] == [False] * (microbatches - 1) + [True]
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_exchange_is_bitwise_the_whole_bucket_sum(world: int) -> None:
    """Chunks of 16 elements through 2 receive slots: many chunks per bucket, retired while
    backward runs; every chunk sums in rank order, so the run is bitwise the one with
    one chunk per bucket, and at 2 ranks bitwise the in-place all-reduce's (a + b == b + a)."""
    tiny = run_ranks(world, _train_distributed, "gpt", BUCKET, steps=4, chunk_bytes=64)
    whole = run_ranks(world, _train_distributed, "gpt", BUCKET, steps=4)
    others = [whole] + ([run_ranks(2, _train_distributed, "gpt", BUCKET, steps=4, grad_collective="all_reduce")] if world == 2 else [])
    assert tiny[0]["chunks"] > 20 * tiny[0]["buckets"] and whole[0]["chunks"] == whole[0]["buckets"]
    assert all(r["retired_in_backward"] > 0 for r in tiny)
    for other in others:
        for a, b in zip(tiny, other):
            assert a["losses"] == b["losses"]
            for key, value in a["params"].items():
                assert torch.equal(value, b["params"][key]), key
