"""The MXFP8 param all-gather and its reuse of the grad buffer.

Parity: N ranks gathering MXFP8 vs a single-process eager reference that keeps fp32
masters and, after every AdamW step, sets the model's params to the masters' MXFP8
round trip (32-element blocks of each flattened param: fxzero's layout starts every
param on a multiple of 32 elements and pads with zeros, which do not change a block's
amax, so its blocks are exactly these).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fxzero
from fxzero import mxfp8
from fxzero.optim import plan_buckets
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.testing import run_ranks

from doubles import deferred_all_gather
from models import batch, build, loss_fn, param_groups
from test_checkpoint import _train as _train_steps

LR, CLIP, BUCKET, STEPS = 1e-2, 0.5, 2000, 10


# ---- config and layout (no ranks) ---------------------------------------------------
def test_reuse_without_mxfp8_gather_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="reuse_grad_buf_for_mxfp8_param_ag=True needs mxfp8_param_gather=True"):
        fxzero.Config(reuse_grad_buf_for_mxfp8_param_ag=True)


@pytest.mark.parametrize("flag", ["mxfp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag"])
def test_mxfp8_flags_must_be_bools(flag: str) -> None:
    with pytest.raises(TypeError, match=f"Config.{flag} must be a bool, got 'yes'"):
        fxzero.Config(**{flag: "yes"})


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8, 16, 64, 128, 256])
@pytest.mark.parametrize("busbw", [False, True])
def test_mxfp8_layout_gives_every_rank_whole_blocks(dp: int, busbw: bool) -> None:
    params = [torch.empty(n, device="meta") for n in (1000, 77, 4096, 5)]
    plan = plan_buckets(params, dp_size=dp, bucket_size=3000, pad_for_high_busbw=busbw, shard_multiple=32)
    for bucket in plan.buckets:
        assert (bucket.end - bucket.start) % (32 * dp) == 0, bucket
        assert bucket.start % 32 == 0
    for start, _, _ in plan.param_ranges:
        assert start % 32 == 0  # a block never holds two params


# ---- multi-rank helpers -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    name: str = "gpt"
    reuse: bool = True
    prefetch: bool = True
    compiled: bool = False
    accum: int = 1
    steps: int = STEPS
    mxfp8: bool = True
    inner: str = "eager"
    deferred: bool = False
    """Gathers whose data lands only when waited for (:func:`doubles.deferred_all_gather`):
    a read before its wait sees last step's params and fails the parity."""


def _optimizer(model: torch.nn.Module, run: Run) -> fxzero.DistributedOptimizer:
    config = fxzero.Config(
        bucket_size=BUCKET,
        clip_grad=CLIP,
        mxfp8_param_gather=run.mxfp8,
        reuse_grad_buf_for_mxfp8_param_ag=run.reuse,
        overlap_param_gather=run.prefetch,
    )
    return fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model)


def _train(run: Run, capture_grads_at: int = -1) -> dict:
    gather = deferred_all_gather if run.deferred else DataParallelGroup.all_gather_async
    with mock.patch.object(DataParallelGroup, "all_gather_async", gather):
        return _train_steps_of(run, capture_grads_at)


def _train_steps_of(run: Run, capture_grads_at: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(run.name)
    opt = _optimizer(model, run)
    forward = torch.compile(model, backend="fxzero", options={"inner_compiler": run.inner}) if run.compiled else model
    losses, grads = [], None
    local = 8 // world
    for step in range(run.steps):
        x, y = batch(run.name, step, 8)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        total = torch.zeros(())
        for micro, (xm, ym) in enumerate(zip(x.chunk(run.accum), y.chunk(run.accum))):
            with opt.no_sync() if micro < run.accum - 1 else contextlib.nullcontext():
                loss = loss_fn(run.name, forward(xm), ym) / run.accum
                loss.backward()
            total += loss.detach()
        if step == capture_grads_at:
            opt.runtime.reductions.finish_launched()
            grads = [b.grad_data.clone() for b in opt.buffers]
        assert not opt.step().skipped
        opt.zero_grad()  # gathers are in flight here (prefetch): must not disturb them
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "params": {n: v.clone() for n, v in model.state_dict().items()},
        "grads": grads,
        "buckets": len(opt.runtime.buckets),
    }


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 32))
    return mxfp8.dequantize(*mxfp8.quantize(padded))[: flat.numel()].view(t.shape).to(t.dtype)


def _train_reference(name: str, steps: int = STEPS, round_trip: bool = True) -> dict:
    """fp32 masters updated by AdamW; the model computes on their MXFP8 round trip."""
    model = build(name)
    groups = param_groups(model)
    masters = {id(p): p.detach().clone().requires_grad_() for g in groups for p in g["params"]}
    opt = torch.optim.AdamW([{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups], lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(name, step, 8)
        loss = loss_fn(name, model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for p in model.parameters():
                masters[id(p)].grad = p.grad
            opt.step()
            for p in model.parameters():
                p.copy_(_round_trip(masters[id(p)]) if round_trip else masters[id(p)])
                p.grad = None
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---- parity ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("run", "world"),
    [
        (Run("gpt"), 2),  # eager, prefetch on, gather lands in the grad buffer
        (Run("mlp", reuse=False, prefetch=False), 2),
        (Run("gpt", compiled=True), 2),
        (Run("mlp", compiled=True, accum=4), 2),  # 4 microbatches under no_sync
        (Run("gpt"), 1),  # no collective, still MXFP8 weights
        (Run("mlp", compiled=True, prefetch=False), 4),
        pytest.param(  # the wait op lands buckets inside Inductor code (a 2-rank Inductor compile: slow tier),
            # the data of each gather only at its wait: no kernel may read a LayerNorm weight or the tied
            # embedding before it (the read-order check for LayerNorm and MXFP8 gathers)
            Run("gpt", compiled=True, inner="inductor", deferred=True), 2, marks=pytest.mark.slow
        ),
    ],
    ids=lambda v: v if isinstance(v, int) else f"{v.name}-reuse{int(v.reuse)}-prefetch{int(v.prefetch)}-{v.inner if v.compiled else 'uncompiled'}-accum{v.accum}"
    + ("-deferred" if v.deferred else ""),
)
def test_mxfp8_gather_matches_eager_round_trip_reference(run: Run, world: int) -> None:
    reference = _train_reference(run.name)
    results = run_ranks(world, _train, run, timeout=300)
    assert results[0]["buckets"] >= 2
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=1e-5, rtol=0)
    for key, value in reference["params"].items():
        got = results[0]["params"][key]
        assert torch.equal(_round_trip(got), got), f"{key} is not MXFP8-representable"
        # equal, or one E4M3 step apart where a master sat on a rounding edge
        torch.testing.assert_close(got, value, atol=2e-3, rtol=0, msg=key)
    assert reference["losses"][-1] < reference["losses"][0]
    # the round trip matters: training without it ends elsewhere
    plain = _train_reference(run.name, round_trip=False)
    assert max(abs(a - b) for a, b in zip(plain["losses"], reference["losses"])) > 1e-4


def test_grads_with_reuse_equal_grads_without_reuse() -> None:
    """No gradient is ever added onto leftover gather bytes, and zero_grad() right after
    step() (gathers in flight) does not corrupt the gathers: grads and losses are bitwise
    equal to the run whose gather has its own buffer."""
    runs = [Run("gpt", reuse=reuse, steps=4) for reuse in (True, False)]
    with_reuse, without = (run_ranks(2, _train, run, capture_grads_at=3) for run in runs)
    for a, b in zip(with_reuse, without):
        assert a["buckets"] >= 2
        assert a["losses"] == b["losses"]
        for ga, gb in zip(a["grads"], b["grads"]):
            assert torch.equal(ga, gb)
            assert ga.abs().sum() > 0


# ---- aliasing and allocation ----------------------------------------------------------
class _DoneWork:
    def wait(self) -> bool:
        return True


def _no_op_collective(*args: object, **kwargs: object) -> _DoneWork:
    return _DoneWork()


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.nbytes


def _aliasing(reuse: bool) -> dict:
    model = build("gpt")
    opt = _optimizer(model, Run(reuse=reuse))
    x, y = batch("gpt", 0, 4)
    loss_fn("gpt", model(x), y).backward()
    opt.step()
    opt.finish_param_sync()
    inside = []
    for bucket, views in zip(opt.runtime.buckets, opt.runtime.gather.views):
        lo, hi = _span(bucket.grad_data)
        d_lo, d_hi = _span(views.dest)
        inside.append(lo <= d_lo and d_hi <= hi and views.dest.untyped_storage().data_ptr() == bucket.grad_data.untyped_storage().data_ptr())

    def land_path() -> None:  # publish every bucket, launch and land it (the step's gather)
        with opt.runtime.sharded_state.replacing():
            pass

    with mock.patch.object(dist, "all_gather_single", _no_op_collective):
        land_path()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.start_param_sync()  # under a profiler: launch, wait and land every bucket
    landing = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    payload = sum(v.dest.nbytes for v in opt.runtime.gather.views)
    return {
        "inside": inside,
        "buffer": opt.runtime.gather.buffer is not None,
        "runtime_bytes": opt.runtime_bytes,
        "payload": payload,
        "kept": opt.runtime.gather.kept.nbytes if opt.runtime.gather.kept is not None else 0,
        "landing_allocated": landing,
        "buckets": len(opt.runtime.buckets),
    }


def test_gather_lands_in_the_grad_buffer_and_allocates_no_gather_buffer() -> None:
    with_reuse, without = (run_ranks(2, _aliasing, reuse) for reuse in (True, False))
    for a, b in zip(with_reuse, without):
        assert a["buckets"] >= 2
        assert all(a["inside"]) and not a["buffer"], "every bucket's gather must land in its own grad memory"
        assert not any(b["inside"]) and b["buffer"]
        # with reuse the only gather memory is the kept copy of this rank's row: 1/dp of the payload
        assert a["kept"] == a["payload"] // 2 and b["kept"] == 0
        assert b["runtime_bytes"] - a["runtime_bytes"] == b["payload"] - a["kept"] and a["payload"] == b["payload"]
        assert a["landing_allocated"] == 0, a  # launch + wait + dequantize + zero: no allocation


# ---- checkpoints ----------------------------------------------------------------------
def _mxfp8_resume(ckpt_dir: str) -> dict:
    model = build("gpt")
    opt = _optimizer(model, Run())
    _train_steps("gpt", model, opt, range(0, 3))
    fxzero.save_checkpoint(ckpt_dir, model, opt, step=3)  # gathers are in flight: it lands them first
    continued = _train_steps("gpt", model, opt, range(3, 6))
    other = build("gpt", seed=1)
    other_opt = _optimizer(other, Run())
    fxzero.load_checkpoint(fxzero.latest_checkpoint(ckpt_dir), other, other_opt)
    return {"continued": continued, "resumed": _train_steps("gpt", other, other_opt, range(3, 6))}


def test_checkpoint_resume_with_mxfp8_gather_in_the_grad_buffer(tmp_path) -> None:
    """Loading publishes the fp32 masters through the MXFP8 gather: the resumed run
    computes on the same MXFP8 weights as the one that went on."""
    for result in run_ranks(2, _mxfp8_resume, str(tmp_path)):
        torch.testing.assert_close(result["resumed"], result["continued"], atol=1e-6, rtol=0)
