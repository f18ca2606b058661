"""Forward all-gather prefetch: no read of a param before its bucket's wait.

The sharp test replaces the async all-gather by a *deferred* one that moves no data
until ``wait()``: any compiled kernel or eager module that reads a param before its
bucket's wait then sees the previous step's values, and the losses leave the eager
reference at once.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from expecttest import TestCase

import fxzero
import fxzero.graph_compiler
from fxzero.backend import fxzero_backend
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.testing import run_ranks

from doubles import DeferredGather, deferred_all_gather
from models import batch, build, forward_kwargs, loss_fn, param_groups

LR, STEPS, GLOBAL = 1e-2, 10, 8  # a stale read is off by ~LR per element: far above atol


def _train(name: str, inner: str | None, overlap: bool, deferred: bool, eval_every: int = 0) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(name)
    config = fxzero.Config(bucket_size=2000, overlap_param_gather=overlap)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model)
    run = torch.compile(model, backend="fxzero", options={"inner_compiler": inner}) if inner else model
    patch = mock.patch.object(DataParallelGroup, "all_gather_async", deferred_all_gather) if deferred else contextlib.nullcontext()
    losses, evals = [], []
    DeferredGather.launches = 0
    with patch:
        for step in range(STEPS):
            x, y = batch(name, step, GLOBAL)
            local = GLOBAL // world
            xs, ys = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            loss = loss_fn(name, run(xs, **forward_kwargs(name, step)), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
            if eval_every and step % eval_every == 0:
                with torch.no_grad():  # eager eval right after step: module pre-hooks must wait
                    evals.append(loss_fn(name, model(x), y).item())
        pending = any(opt.runtime.param_sync.pending)
        params = {n: v.clone() for n, v in model.state_dict().items()}
    return {"losses": losses, "evals": evals, "params": params, "pending_before_state_dict": pending}


def _reference(name: str, eval_every: int = 0) -> dict:
    model = build(name)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, evals = [], []
    for step in range(STEPS):
        x, y = batch(name, step, GLOBAL)
        loss = loss_fn(name, model(x, **forward_kwargs(name, step)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if eval_every and step % eval_every == 0:
            with torch.no_grad():
                evals.append(loss_fn(name, model(x), y).item())
    return {"losses": losses, "evals": evals, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _assert_matches(result: dict, reference: dict) -> None:
    torch.testing.assert_close(result["losses"], reference["losses"], atol=1e-5, rtol=0)
    torch.testing.assert_close(result["evals"], reference["evals"], atol=1e-5, rtol=0)
    for key, value in reference["params"].items():
        torch.testing.assert_close(result["params"][key], value, atol=1e-4, rtol=0, msg=key)


@pytest.mark.parametrize(
    ("name", "inner"),
    # the Inductor case compiles a GPT cold (~12 s): full suite only, the fast tier keeps the eager ones
    [("gpt", "eager"), ("gpt_break", "eager"), ("mlp", None), pytest.param("gpt", "inductor", marks=pytest.mark.slow)],
    ids=["compiled-eager", "graph-break-and-eager-head", "no-compile", "compiled-inductor"],
)
def test_no_read_before_its_wait_with_deferred_gathers(name: str, inner: str | None) -> None:
    reference = _reference(name)
    for result in run_ranks(2, _train, name, inner, True, True, timeout=300):
        _assert_matches(result, reference)


def test_eager_eval_after_step_sees_updated_params() -> None:
    reference = _reference("gpt", eval_every=2)
    for result in run_ranks(2, _train, "gpt", "eager", True, True, 2, timeout=300):
        _assert_matches(result, reference)
        assert result["pending_before_state_dict"], "a gather should still be in flight after the last step"


def test_overlap_on_and_off_give_identical_results() -> None:
    on = run_ranks(2, _train, "gpt", "eager", True, False, timeout=300)
    off = run_ranks(2, _train, "gpt", "eager", False, False, timeout=300)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _accumulate_launches() -> tuple[list[int], int]:
    model = build("gpt")
    opt = fxzero.DistributedOptimizer(
        param_groups(model), torch.optim.AdamW, lr=LR, config=fxzero.Config(bucket_size=2000), module=model
    )
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    launches = []
    with mock.patch.object(DataParallelGroup, "all_gather_async", deferred_all_gather):
        DeferredGather.launches = 0
        for step in range(2):
            x, y = batch("gpt", step, 8)
            for micro in range(4):
                with opt.no_sync() if micro < 3 else contextlib.nullcontext():
                    loss_fn("gpt", cmodel(x[2 * micro : 2 * micro + 2]), y[2 * micro : 2 * micro + 2]).backward()
                launches.append(DeferredGather.launches)
            opt.step()
            opt.zero_grad()
    return launches, len(opt.runtime.buckets)


def test_gradient_accumulation_gathers_only_after_the_step() -> None:
    for launches, buckets in run_ranks(2, _accumulate_launches, timeout=300):
        # (cumulative launch counts after each microbatch) step 1's microbatches see no
        # gathers; step 1's gathers all happen in step 2's first microbatch, and none is
        # launched between microbatches after that
        assert launches[:4] == [0, 0, 0, 0]
        assert launches[4:] == [buckets] * 4, launches


# ---- the rewritten forward graph ------------------------------------------------------
def _first_forward_code(overlap: bool) -> str:
    """The forward graph after fxzero's passes of a two-bucket MLP (comments and blanks dropped)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    config = fxzero.Config(bucket_size=32, overlap_param_gather=overlap)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=config, module=model)
    assert len(opt.runtime.buckets) == 2
    graphs = []
    original = fxzero.graph_compiler.run_forward_passes

    def capture(gm, example_inputs, **kwargs):  # type: ignore[no-untyped-def]
        graphs.append(original(gm, example_inputs, **kwargs))
        return graphs[-1]

    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    with mock.patch.object(fxzero.graph_compiler, "run_forward_passes", capture):
        cmodel(torch.randn(5, 4)).sum().backward()
    return "\n".join(l for l in graphs[0].code.strip().splitlines() if l.strip() and not l.strip().startswith("#"))


class TestRewrittenForward(TestCase):
    def test_each_bucket_is_waited_right_before_its_first_read(self) -> None:
        self.assertExpectedInline(_first_forward_code(overlap=True), """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5):
    wait_params_default = torch.ops.fxzero.wait_params.default([primals_2, primals_3]);  wait_params_default = None
    t = torch.ops.aten.t.default(primals_2)
    addmm = torch.ops.aten.addmm.default(primals_3, primals_1, t);  t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    detach = torch.ops.aten.detach.default(relu)
    wait_params_default_1 = torch.ops.fxzero.wait_params.default([primals_4, primals_5]);  wait_params_default_1 = None
    t_1 = torch.ops.aten.t.default(primals_4)
    addmm_1 = torch.ops.aten.addmm.default(primals_5, relu, t_1)
    return (addmm_1, primals_1, primals_2, primals_3, primals_4, primals_5, relu, detach, t_1)""")

    def test_without_overlap_the_forward_has_no_wait(self) -> None:
        """Overlap off (the default), ``step()`` returns with every gather finished: a wait
        in the graph would be a call out of it per graph run that never waits."""
        self.assertExpectedInline(_first_forward_code(overlap=False), """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5):
    t = torch.ops.aten.t.default(primals_2)
    addmm = torch.ops.aten.addmm.default(primals_3, primals_1, t);  t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    detach = torch.ops.aten.detach.default(relu)
    t_1 = torch.ops.aten.t.default(primals_4)
    addmm_1 = torch.ops.aten.addmm.default(primals_5, relu, t_1)
    return (addmm_1, primals_1, primals_2, primals_3, primals_4, primals_5, relu, detach, t_1)""")


def _written_after_step(finish_first: bool) -> tuple[torch.nn.Module, Any, torch.Tensor]:
    """One step with the gathers left in flight (MXFP8 at world size 1: buckets wait to be
    landed), then an in-place write into a param, with or without finishing them first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    config = fxzero.Config(bucket_size=2000, mxfp8_param_gather=True, overlap_param_gather=True)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, config=config, module=model)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert any(opt.runtime.param_sync.pending)
    if finish_first:
        opt.finish_param_sync()
    stepped = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    return model, opt, stepped  # the optimizer kept alive: its hooks go with it


def test_a_param_written_in_place_while_its_gather_is_in_flight_is_an_error_naming_the_fix() -> None:
    """With overlap on, the bucket's landing would overwrite the write (it once did, silently)."""
    model, opt, _ = _written_after_step(finish_first=False)
    with pytest.raises(RuntimeError, match=r"written in place after step\(\) .*Call opt\.finish_param_sync\(\) after step\(\) before writing params"):
        model(torch.randn(5, 4))
    model, opt, stepped = _written_after_step(finish_first=True)  # what the message says
    model(torch.randn(5, 4))
    assert torch.equal(model[0].weight, stepped * 0.5)


def _profiled_step() -> tuple[bool, bool]:
    model = build("gpt")
    config = fxzero.Config(overlap_param_gather=True)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model)
    x, y = batch("gpt", 0, 4)
    with torch.profiler.profile():
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        pending_under_profiler = any(opt.runtime.param_sync.pending)
    loss_fn("gpt", model(x), y).backward()
    opt.step()
    return pending_under_profiler, any(opt.runtime.param_sync.pending)


def test_no_gather_outlives_a_profiler() -> None:
    """A profiler stopping while gloo work it saw start is in flight crashed the next wait
    (torch 2.13): under a profiler the step finishes its gathers; outside, with overlap on, it
    leaves them in flight for the forward."""
    for under_profiler, outside in run_ranks(2, _profiled_step, timeout=120):
        assert (under_profiler, outside) == (False, True)


def test_a_blocks_graph_guards_its_modules_pre_hooks_by_type_in_cpp_alone() -> None:
    """Each module owning params has a pre-hook object of its own. One object shared by a
    block's modules made Dynamo add a guard in Python to the block's graph checking, on every
    call, that the modules still share it (about 4 us a call); the C++ guards check the type."""
    model = build("gpt_loop_break")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, module=model)
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    assert len(hooks) >= sum(1 for m in model.modules() if m._parameters) and len(hooks) == len({id(h) for h in hooks})
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    guards = logging.getLogger("torch._dynamo.guards.__guards")
    torch.compiler.reset()
    torch._logging.set_logs(guards=True)
    guards.addHandler(handler)
    try:
        x, y = batch("gpt_loop_break", 0, 4)
        loss_fn("gpt_loop_break", torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})(x), y).backward()
    finally:
        guards.removeHandler(handler)
        torch._logging.set_logs()
        torch.compiler.reset()
    python_guards = [m[m.index("def guard(L)") :] for m in messages if "def guard(L)" in m]
    assert python_guards, "no guards logged"
    assert not [g for g in python_guards if "_forward_pre_hooks" in g.split("return guard")[0]]
    opt.zero_grad()


def test_a_pre_hook_run_eagerly_in_a_compiled_region_is_not_compiled_on_its_own() -> None:
    """GPT.forward graph-breaks in its block loop, so Dynamo runs it eagerly and the embedding,
    final norm and head are called from eager code inside the compiled region: their param-wait
    pre-hook runs as plain Python there. (Dynamo used to compile it into a graph of its own,
    once per module type: a cold compile each, and a guarded graph call per module per step.)
    Traced into a module's graph, the hook still leaves its entry mark (test_param_read_order)."""
    graphs: list[fx.GraphModule] = []

    def recording(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return fxzero_backend(gm, example_inputs, options={"inner_compiler": "eager"})

    model = build("gpt_loop_break")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, module=model)
    cmodel = torch.compile(model, backend=recording)
    for step in range(2):
        x, y = batch("gpt_loop_break", step, 4)
        loss_fn("gpt_loop_break", cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.compiler.reset()
    targets = [{str(n.target) for n in gm.graph.nodes if n.op == "call_function"} for gm in graphs]
    marker = str(torch.ops.fxzero.module_entered)  # as Dynamo records it: the op packet
    assert graphs and all(t - {marker} for t in targets), f"a graph of the hook alone: {targets}"
    assert any(marker in t for t in targets), "the block graphs mark their modules' entries"
