"""The update bucket by bucket, each bucket's all-gather launched as its shard is done.

``Config.overlap_param_gather_with_optimizer_step`` (on by default) must give bitwise the
params, losses and norms of updating every shard before the gathers (the step before it),
with overlap_param_gather on and off, clipping, GradScaler skips, params that got no
gradient, MXFP8 gathers, bf16 params, eager and Inductor. Every optim_db configuration at
world 2 is compared too (``test_optim_db.py``), and DTensor params at dp 2 x tp 2
(``test_mesh.py``). Here also: the gathers really start during the update, in the order the
next forward reads buckets, and the plan's pieces behave (group lists restored, a class
fxzero does not know updates whole).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.update.bucketed_update import BucketParts, step_each_bucket, updates_param_by_param
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.testing import run_ranks

from models import batch, build, forward_kwargs, loss_fn, param_groups, runs_from_initial_state

STEPS, GLOBAL, LR = 4, 8, 1e-2


# ---- world 1: the pieces ------------------------------------------------------------------
def test_each_bucket_steps_alone_then_its_after_runs_and_the_group_lists_come_back() -> None:
    a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
    for p in (a, b, c):
        p.grad = torch.ones(3)
    opt = torch.optim.SGD([{"params": [a, c]}, {"params": [b]}], lr=1.0)
    lists = [g["params"] for g in opt.param_groups]
    parts = BucketParts(lists, lambda t: 0 if t is b else 1, 2)
    seen = []

    def after(index: int) -> None:
        seen.append((index, [float(p[0]) for p in (a, b, c)]))

    step_each_bucket(opt.param_groups, parts, (1, 0), opt.step, after)
    assert seen == [(1, [-1.0, 0.0, -1.0]), (0, [-1.0, -1.0, -1.0])]  # bucket 1 (a, c) first, then b
    assert [g["params"] for g in opt.param_groups] == lists and all(g["params"] is x for g, x in zip(opt.param_groups, lists))

    def fail(index: int) -> None:
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        step_each_bucket(opt.param_groups, parts, (1, 0), opt.step, fail)
    assert all(g["params"] is x for g, x in zip(opt.param_groups, lists))  # restored when a step raises


def test_only_classes_that_update_each_param_alone_step_by_bucket() -> None:
    assert updates_param_by_param(torch.optim.AdamW) and updates_param_by_param(torch.optim.Muon)

    class Coupled(torch.optim.AdamW):  # a subclass may couple params (a norm over all of them)
        pass

    assert not updates_param_by_param(Coupled)


def test_the_flag_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="overlap_param_gather_with_optimizer_step must be a bool"):
        fxzero.Config(overlap_param_gather_with_optimizer_step="yes")  # type: ignore[arg-type]


# ---- world 2: bitwise against updating every shard first -------------------------------------
CASES: dict[str, dict[str, Any]] = {
    "adamw": {},
    "clipped, a param without gradient": {"name": "mlp_branch", "clip_grad": 0.05},
    "overlap_param_gather": {"overlap_param_gather": True},
    "mxfp8 gather": {"mxfp8_param_gather": True},
    "mxfp8 gather in the grad buffer": {"mxfp8_param_gather": True, "reuse_grad_buf_for_mxfp8_param_ag": True},
    "bf16 params": {"dtype": torch.bfloat16},
    "GradScaler, step 1 skipped": {"scaler": True},
    "fused AdamW": {"fused": True},
}


def _optimizer(model: torch.nn.Module, case: dict[str, Any], by_bucket: bool) -> fxzero.DistributedOptimizer:
    keys = ("clip_grad", "overlap_param_gather", "mxfp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag")
    config = fxzero.Config(bucket_size=2000, overlap_param_gather_with_optimizer_step=by_bucket, **{k: case[k] for k in keys if k in case})
    extra = {"fused": True} if case.get("fused") else {}
    return fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model, **extra)


def _train(model: torch.nn.Module, forward: Any, case: dict[str, Any], by_bucket: bool) -> dict[str, Any]:
    rank, world, name = dist.get_rank(), dist.get_world_size(), case.get("name", "gpt")
    opt = _optimizer(model, case, by_bucket)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case.get("scaler") else None
    local, steps = GLOBAL // world, []
    torch.manual_seed(rank)  # dropout draws its own masks per rank, alike in both runs
    for step in range(STEPS):
        x, y = batch(name, step, GLOBAL)
        loss = loss_fn(name, forward(x[rank * local : (rank + 1) * local], **forward_kwargs(name, step)), y[rank * local : (rank + 1) * local])
        if scaler is None:
            loss.backward()
            result = opt.step()
        else:
            scaler.scale(loss * (float("inf") if step == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            result = None
        opt.zero_grad()
        steps.append((loss.item(), None if result is None else (result.skipped, result.grad_norm)))
    opt.finish_param_sync()
    return {"steps": steps, "params": [p.detach().clone() for p in model.parameters()]}


def _cases(names: list[str]) -> dict[str, tuple[dict, dict]]:
    out = {}
    for label in names:
        case = CASES[label]
        runs = []
        for by_bucket in (True, False):
            model = build(case.get("name", "gpt")).to(case.get("dtype", torch.float32))
            runs.append(_train(model, model, case, by_bucket))
        out[label] = tuple(runs)
    return out


def _compiled(inner: str) -> tuple[dict, dict]:
    """Both runs through the same compiled graphs (overlap on: the graphs carry the waits)."""
    model = build("gpt")
    forward = torch.compile(model, backend="fxzero", options={"inner_compiler": inner}, dynamic=False)
    case = {"overlap_param_gather": True}
    return tuple(runs_from_initial_state(model, (True, False), lambda by_bucket: _train(model, forward, case, by_bucket)))  # type: ignore[return-value]


def _launch_order() -> list[list[bool]]:
    """For each gather launched in one step: which buckets' own shards were updated by then."""
    rank = dist.get_rank()
    model = build("gpt")
    opt = _optimizer(model, {}, True)
    x, y = batch("gpt", 0, GLOBAL)
    loss_fn("gpt", model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
    before = [b.param_shards[rank].clone() for b in opt.runtime.buckets]
    seen: list[list[bool]] = []
    launched: list[int] = []
    original = DataParallelGroup.all_gather_async

    def record(self: DataParallelGroup, out: torch.Tensor, shards: Any) -> Any:
        seen.append([not torch.equal(b.param_shards[rank], old) for b, old in zip(opt.runtime.buckets, before)])
        launched.append(next(b.index for b in opt.runtime.buckets if b.param_data.data_ptr() == out.data_ptr()))
        return original(self, out, shards)

    with mock.patch.object(DataParallelGroup, "all_gather_async", record):
        opt.step()
    return [seen, launched, list(range(len(opt.runtime.buckets)))]  # type: ignore[list-item]


def _world_2(inner: Optional[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"launches": _launch_order()}
    out["cases"] = _cases(list(CASES)) if inner is None else {f"compiled ({inner})": _compiled(inner)}
    return out


def _assert_bitwise(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for label, (by_bucket, whole) in result["cases"].items():
            assert by_bucket["steps"] == whole["steps"], (rank, label, by_bucket["steps"], whole["steps"])
            assert all(torch.equal(a, b) for a, b in zip(by_bucket["params"], whole["params"])), (rank, label)
            assert by_bucket["params"][0].dtype == whole["params"][0].dtype


@pytest.mark.slow
def test_the_update_bucket_by_bucket_is_bitwise_the_whole_update_at_world_2() -> None:
    results = run_ranks(2, _world_2, None, timeout=300)
    _assert_bitwise(results)
    skipped = [s[1][0] if s[1] else None for s in results[0]["cases"]["clipped, a param without gradient"][0]["steps"]]
    assert skipped == [False] * STEPS
    for seen, launched, buckets in (r["launches"] for r in results):
        assert len(buckets) >= 3 and launched == sorted(buckets, reverse=True)  # the forward reads the last bucket first
        # when bucket k's gather launches, buckets k, k+1, ... are updated and the rest not yet
        assert seen == [[index >= k for index in buckets] for k in launched], seen


@pytest.mark.slow
def test_the_update_bucket_by_bucket_is_bitwise_the_whole_update_through_inductor() -> None:
    _assert_bitwise(run_ranks(2, _world_2, "inductor", timeout=300))


def test_a_class_fxzero_does_not_know_updates_every_shard_before_the_gathers(caplog: pytest.LogCaptureFixture) -> None:
    class Own(torch.optim.SGD):
        pass

    model = build("mlp")
    with caplog.at_level(logging.INFO, logger="fxzero.optim.update.update_plan"), _fake_world_2():
        fxzero.DistributedOptimizer(model.parameters(), Own, lr=LR, config=fxzero.Config(state_sharding="elementwise"))
    assert "Own may couple params in its step: every shard is updated before the gathers start" in caplog.text


@contextlib.contextmanager
def _fake_world_2() -> Any:
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
