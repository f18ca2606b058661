"""Habits around copies of the model and its buffers, next to DDP + the same torch.optim.

Each rank trains a fxzero model (compiled with ``backend="fxzero"``) and a DDP model over
the same process group on its own slice of the data; with two ranks the averaged
gradients are bitwise DDP's, so everything here is compared with ``torch.equal``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.profiler import ProfilerActivity, profile

import fxzero
from fxzero.compiled.binding import manager_of
from fxzero.testing import run_ranks

warnings.filterwarnings("ignore", message="fxzero: this compiled graph")

LR, STEPS = 1e-2, 4


class _Tiny(torch.nn.Module):
    """A layer and params of the root itself, over three buckets: ``deepcopy`` copies the
    root's own params before it reaches any hook, and with overlap on the step leaves the
    third bucket's gather for the next forward to launch."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(16, 8) / 3), torch.nn.Parameter(torch.zeros(16))
        self.w2, self.b2 = torch.nn.Parameter(torch.randn(4, 16) / 4), torch.nn.Parameter(torch.zeros(4))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.linear(x, self.w1, self.b1).relu()
        return self.out(torch.nn.functional.linear(hidden, self.w2, self.b2))


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Tiny()


def _local(step: int, shape: tuple[int, ...] = (8,)) -> torch.Tensor:
    """This rank's slice of step ``step``'s global batch (ranks see different data)."""
    x = torch.randn(2 * dist.get_world_size(), *shape, generator=torch.Generator().manual_seed(step))
    return x[2 * dist.get_rank() : 2 * dist.get_rank() + 2]


def _pair(build, config: fxzero.Config) -> tuple:
    """(model, its compiled form, fxzero optimizer), (DDP's own copy, DDP, AdamW)."""
    torch._dynamo.reset()
    model, reference = build(), build()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=config)
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    ddp = DDP(reference, forward_sync_buffers=config.broadcast_buffers)  # torch 2.13 names broadcast_buffers so
    return (model, compiled, opt), (reference, ddp, torch.optim.AdamW(reference.parameters(), lr=LR))


def _train(run: tuple, x: torch.Tensor) -> None:
    _, forward, opt = run
    forward(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _values(module: torch.nn.Module) -> dict:
    return {n: v.detach().clone() for n, v in module.state_dict().items()}


def _assert_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


# ---- 1. EMA / teacher copies: deepcopy, AveragedModel, torch.save(model) --------------------
def _copies(overlap: bool) -> dict:
    ours, ref = _pair(_tiny, fxzero.Config(bucket_size=16, overlap_param_gather=overlap))
    ema_fn = get_ema_multi_avg_fn(0.9)
    emas = [AveragedModel(ours[0], multi_avg_fn=ema_fn)], [AveragedModel(ref[0], multi_avg_fn=ema_fn)]
    out: dict = {"buckets": len(ours[2].runtime.buckets)}
    for step in range(STEPS):
        _train(ours, _local(step))
        _train(ref, _local(step))
        # right after a step: with overlap on, its gathers are in flight
        if step == 1:
            saved = io.BytesIO()
            torch.save(ours[0], saved)
            out["saved"] = _values(torch.load(io.BytesIO(saved.getvalue()), weights_only=False)), _values(ref[0])
        if step == 2:
            copied, ref_copied = copy.deepcopy(ours[0]), copy.deepcopy(ref[0])
            emas[0].append(AveragedModel(ours[0], multi_avg_fn=ema_fn))
            emas[1].append(AveragedModel(ref[0], multi_avg_fn=ema_fn))
            out["copied"] = _values(copied), _values(ref_copied)
        ours[2].finish_param_sync()  # reading the params by hand after step() (a no-op without overlap)
        for mine, theirs in zip(*emas):
            mine.update_parameters(ours[0])
            theirs.update_parameters(ref[0])
    x = _local(STEPS)
    out["ema"] = [(_values(m), m(x).detach(), _values(t), t(x).detach()) for m, t in zip(*emas)]
    out["plain"] = _plain_copy(copied, ref_copied, ours[2], x)
    return out


def _plain_copy(copied: torch.nn.Module, reference: torch.nn.Module, opt: fxzero.DistributedOptimizer, x: torch.Tensor) -> dict:
    """The copy trains as a plain module: its own grads, no fxzero hook, nothing reaches ``opt``."""
    before = [b.grad_data.clone() for b in opt.runtime.buckets]
    for module in (copied, reference):
        module(x).square().mean().backward()
    return {
        "grads": [torch.equal(p.grad, q.grad) for p, q in zip(copied.parameters(), reference.parameters())],
        "managers": [manager_of(p) for p in copied.parameters()],
        "opt_grads_untouched": all(map(torch.equal, before, [b.grad_data for b in opt.runtime.buckets])),
    }


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_deepcopy_averaged_model_and_torch_save_of_a_managed_model_are_plain_current_copies(overlap: bool) -> None:
    for result in run_ranks(2, _copies, overlap):
        assert result["buckets"] == 4
        _assert_equal(*result["copied"])
        _assert_equal(*result["saved"])
        for ours, ours_out, theirs, theirs_out in result["ema"]:  # made before step 1, and after step 3
            _assert_equal(ours, theirs)
            assert torch.equal(ours_out, theirs_out)
        assert all(result["plain"]["grads"]), result["plain"]
        assert result["plain"]["managers"] == [None] * 6
        assert result["plain"]["opt_grads_untouched"]



def _mxfp8_copies() -> dict:
    model = _tiny()
    config = fxzero.Config(bucket_size=16, overlap_param_gather=True, mxfp8_param_gather=True)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=config)
    _train((model, model, opt), _local(0))
    pending, copied = sum(opt.runtime.param_sync.pending), copy.deepcopy(model)  # its buckets land only when waited
    out = {"pending": pending, "copied": (_values(copied), _values(model))}
    _train((model, model, opt), _local(1))
    saved = io.BytesIO()
    torch.save(model, saved)
    out["saved"] = _values(torch.load(io.BytesIO(saved.getvalue()), weights_only=False)), _values(model)
    return out


def test_copies_right_after_step_hold_landed_params_with_the_mxfp8_gather() -> None:
    """With overlap on, MXFP8 buckets are dequantized into the params only when waited:
    a copy or a save right after step() lands them first (params the copy took before
    reaching a hook, the root's own, are copied again)."""
    for result in run_ranks(2, _mxfp8_copies):
        assert result["pending"] == 4
        _assert_equal(*result["copied"])
        _assert_equal(*result["saved"])

# ---- 2. BatchNorm buffers: rank 0's, once per step, as DDP's broadcast_buffers ----------------
def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _buffers(module: torch.nn.Module) -> dict:
    return {n: b.clone() for n, b in module.named_buffers()}


_LOOP = ("plain", "accumulate", "accumulate", "plain")
"""Each step's loop: one batch, or two microbatches, the first under ``no_sync()``; an eval
forward follows step 0."""


def _bn_step(run: tuple, step: int, seen: list) -> None:
    """Step ``step`` of :data:`_LOOP`. ``seen`` gets the buffers each training forward
    starts from (DDP's: from a hook inside its forward, after its broadcast)."""
    model, forward, opt = run
    is_ddp = isinstance(forward, DDP)
    batches = [_local(100 + step), _local(step)] if _LOOP[step] == "accumulate" else [_local(step)]
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else (forward.no_sync() if is_ddp else opt.no_sync()):
            if not is_ddp:
                seen.append(_buffers(model))
            forward(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _evaluate(run: tuple) -> torch.Tensor:
    run[0].eval()
    with torch.no_grad():
        out = run[1](_local(99))
    run[0].train()
    return out


def _bn_runs(broadcast_buffers: bool) -> dict:
    config = fxzero.Config(bucket_size=64, overlap_param_gather=False, broadcast_buffers=broadcast_buffers)
    runs = dict(zip(("ours", "ddp"), _pair(_bn_net, config)))
    seen: dict = {name: {"forwards": [], "evals": []} for name in runs}

    def record(module: torch.nn.Module, args: object) -> None:  # inside DDP's forward, after its broadcast
        if module.training:
            seen["ddp"]["forwards"].append(_buffers(module))

    runs["ddp"][0].register_forward_pre_hook(record)
    for step in range(len(_LOOP)):
        for name, run in runs.items():
            _bn_step(run, step, seen[name]["forwards"])
            if step == 0:
                seen[name]["evals"].append(_evaluate(run))
    for name, run in runs.items():
        seen[name]["evals"].append(_evaluate(run))  # DDP broadcasts the buffers before it
        seen[name]["state"] = _values(run[0])
    return seen


@pytest.mark.parametrize("broadcast_buffers", [True, False], ids=["broadcast", "own-buffers"])
def test_batchnorm_buffers_follow_ddp_broadcast_buffers(broadcast_buffers: bool) -> None:
    """Every forward (training, microbatch under no_sync, eval) starts from the buffers it
    starts from under DDP(forward_sync_buffers=...), bit for bit; params and eval outputs are DDP's."""
    results = run_ranks(2, _bn_runs, broadcast_buffers)
    for result in results:
        ours, ddp = result["ours"], result["ddp"]
        assert len(ours["forwards"]) == len(ddp["forwards"]) == 6
        for mine, theirs in zip(ours["forwards"], ddp["forwards"]):
            _assert_equal(mine, theirs)
        for mine, theirs in zip(ours["evals"], ddp["evals"], strict=True):
            assert torch.equal(mine, theirs)
        _assert_equal(ours["state"], ddp["state"])
    same = torch.equal(results[0]["ours"]["state"]["1.running_mean"], results[1]["ours"]["state"]["1.running_mean"])
    assert same == broadcast_buffers  # the ranks' data differ: only the broadcast makes them agree


def _counted_collectives() -> dict:
    """What a step issues (backward and step() under the profiler) and what the optimizer declares."""
    out = {}
    for broadcast_buffers in (True, False):
        model = _bn_net()
        config = fxzero.Config(bucket_size=64, broadcast_buffers=broadcast_buffers)
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=config)
        for step in range(2):
            loss = model(_local(step)).square().mean()
            with profile(activities=[ProfilerActivity.CPU]) if step else contextlib.nullcontext() as prof:
                loss.backward()
                opt.step()
        ops = [e.name[len("c10d::") :] for e in prof.events() if e.name.startswith("c10d::") and "barrier" not in e.name]
        counted = collections.Counter(op.strip("_").replace("_base", "") for op in ops)
        out[broadcast_buffers] = {"counted": dict(counted), "declared": opt.collectives_per_step}
    return out


def test_the_buffer_broadcast_is_one_collective_per_dtype_and_counted() -> None:
    for result in run_ranks(2, _counted_collectives):
        for counts in result.values():
            assert counts["counted"] == counts["declared"], counts
        on, off = result[True]["declared"], result[False]["declared"]
        assert on == off | {"broadcast": off.get("broadcast", 0) + 2}, (on, off)  # fp32 statistics, int64 counts
    model = _bn_net()  # world size 1 (no process group here): nothing to broadcast, no collective
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model)
    model(torch.randn(4, 8)).sum().backward()
    assert not opt.step().skipped and opt.collectives_per_step == {}
