"""The backward pass: plans without graphs, rewritten graph text, numerics, backend edges."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
import weakref
from unittest import mock

import pytest
import torch
from expecttest import TestCase

import fxzero
import fxzero.graph_compiler
from fxzero.backend import BackendOptions
from fxzero.passes.bucket_reduce_scatter import BucketLaunch, ManagedParam, plan_launches
from fxzero.passes.matchers import is_grads_ready
from fxzero.optim.gradients.grad_views import ShardedGrad


# ---- plans, no graphs -------------------------------------------------------------
def test_each_launch_goes_after_its_buckets_last_grad() -> None:
    managed = [ManagedParam(0, 0, 1), ManagedParam(1, 0, 1), ManagedParam(3, 0, 0), ManagedParam(4, 0, 0)]
    plan = plan_launches(managed, producer={0: 10, 1: 7, 3: 5, 4: 6})
    assert plan.launches == (BucketLaunch(0, 0, (3, 4), 6), BucketLaunch(0, 1, (0, 1), 10))
    assert plan.positions == (3, 4, 0, 1)


def test_grads_missing_from_the_graph_are_not_planned_and_ties_keep_bucket_order() -> None:
    managed = [ManagedParam(0, 0, 2), ManagedParam(1, 0, 1), ManagedParam(2, 1, 0)]
    plan = plan_launches(managed, producer={0: 4, 1: 4})  # position 2 has no gradient here
    assert [(launch.manager_index, launch.bucket) for launch in plan.launches] == [(0, 1), (0, 2)]
    assert plan_launches([], producer={}).launches == ()


def test_hand_offs_cut_each_bucket_in_producer_order() -> None:
    big, small = 1 << 20, 1000
    managed = [ManagedParam(p, 0, 0, n) for p, n in [(0, small), (1, big), (2, small), (3, small), (4, big)]]
    producer = {0: 9, 1: 8, 2: 5, 3: 4, 4: 2}  # backward produces 4, 3, 2, 1, 0
    plan = plan_launches(managed, producer, handoff_numel=big)
    # a large gradient goes alone, small ones wait for the next large one
    assert [(launch.positions, launch.after) for launch in plan.launches] == [((4,), 2), ((1, 2, 3), 8), ((0,), 9)]
    assert [launch.positions for launch in plan_launches(managed, producer, handoff_numel=0).launches] == [(4,), (3,), (2,), (1,), (0,)]
    assert [launch.positions for launch in plan_launches(managed, producer, handoff_numel=10 * big).launches] == [(0, 1, 2, 3, 4)]


def _handoffs(inner: str) -> list[tuple[int, int]]:
    """Each hand-off of a compiled backward over one bucket: (elements handed, earlier
    handed-off gradients still alive)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=None))
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": inner})
    x = torch.randn(8, 1024)
    cmodel(x).sum().backward()  # compiles (and learns the counts)
    opt.step()
    calls, handed = [], []
    original = opt.runtime.binding.grads_ready

    def recording(grads, params):  # type: ignore[no-untyped-def]
        calls.append((sum(g.numel() for g in grads), sum(r() is not None for r in handed)))
        handed.extend(weakref.ref(g) for g in grads)
        original(grads, params)

    with mock.patch.object(opt.runtime.binding, "grads_ready", recording):
        cmodel(x).sum().backward()
    assert len(opt.runtime.buckets) == 1 and opt.runtime.ledger.launched == (True,)
    return calls


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_each_large_gradient_goes_into_main_grad_right_after_its_producer(inner: str) -> None:
    """One bucket of four 1M-element weights: four hand-offs, one per gradient, in the
    compiled backward (a single one, after the last gradient, kept all four alive)."""
    calls = _handoffs(inner)
    assert [n for n, _ in calls] == [1 << 20] * 4
    if inner == "eager":  # Inductor may reuse a dead gradient's buffer for a later one
        assert [alive for _, alive in calls] == [0, 0, 0, 0], "a handed-off gradient outlived its hand-off"


# ---- the rewritten backward graph -------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _capture_backward(cmodel: torch.nn.Module, x: torch.Tensor) -> list[torch.fx.GraphModule]:
    graphs: list[torch.fx.GraphModule] = []
    original = fxzero.graph_compiler.run_backward_passes

    def capture(gm, example_inputs, **kwargs):  # type: ignore[no-untyped-def]
        gm = original(gm, example_inputs, **kwargs)
        graphs.append(gm)
        return gm

    with mock.patch.object(fxzero.graph_compiler, "run_backward_passes", capture):
        cmodel(x).sum().backward()
    return graphs


def _code(gm: torch.fx.GraphModule) -> str:
    lines = [line for line in gm.code.strip().splitlines() if line.strip() and not line.strip().startswith("#")]
    return "\n".join(lines)


class TestRewrittenBackward(TestCase):
    def test_two_buckets_launch_right_after_their_last_grads(self) -> None:
        torch._dynamo.reset()
        model, reference = _model(), _model()
        # bucket_size 32: bucket 0 = last Linear (bias 3 at 0, weight 18 at 32: closes at 50 >= 32),
        # bucket 1 = first Linear.
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=32))
        self.assertEqual([len(b.params) for b in opt.runtime.buckets], [2, 2])
        cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
        x = torch.randn(5, 4)
        (gm,) = _capture_backward(cmodel, x)
        code = _code(gm)
        self.assertExpectedInline(code, """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5, relu, detach, t_1, tangents_1):
    t_2 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm = torch.ops.aten.mm.default(tangents_1, t_2);  t_2 = None
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu);  t_3 = relu = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
    view = torch.ops.aten.view.default(sum_1, [3]);  sum_1 = None
    t_5 = torch.ops.aten.t.default(t_4);  t_4 = None
    grads_ready_default = torch.ops.fxzero.grads_ready.default([t_5, view], [primals_4, primals_5]);  t_5 = view = primals_4 = primals_5 = grads_ready_default = None
    detach_1 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_1, 0);  mm = detach_1 = None
    t_6 = torch.ops.aten.t.default(threshold_backward)
    mm_2 = torch.ops.aten.mm.default(t_6, primals_3);  t_6 = primals_3 = None
    t_7 = torch.ops.aten.t.default(mm_2);  mm_2 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_1 = torch.ops.aten.view.default(sum_2, [6]);  sum_2 = None
    t_8 = torch.ops.aten.t.default(t_7);  t_7 = None
    grads_ready_default_1 = torch.ops.fxzero.grads_ready.default([t_8, view_1], [primals_1, primals_2]);  t_8 = view_1 = primals_1 = primals_2 = grads_ready_default_1 = None
    return (None, None, None, None, None)""")
        # numerics: main_grad holds exactly what eager autograd computes
        reference(x).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            self.assertIsInstance(p.grad, ShardedGrad)  # a view of the sharded gradient, not autograd's
            torch.testing.assert_close(p.main_grad, q.grad)
        # inserted nodes carry the stack trace of the grad they follow; every node has a val
        for node in gm.graph.nodes:
            if is_grads_ready(node):
                self.assertIn("val", node.meta)
                traced = [g.meta["stack_trace"] for g in node.args[0] if "stack_trace" in g.meta]
                self.assertEqual(node.meta.get("stack_trace"), traced[0] if traced else None)
                self.assertIn("fwd_nn_module_stack", node.meta)
        self.assertEqual(opt.runtime.ledger.launched, (True, True))


# ---- the backend around it --------------------------------------------------------
def test_backend_is_registered_through_the_entry_point_in_a_fresh_interpreter() -> None:
    code = (
        "import torch\n"
        "assert 'fxzero' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "m = torch.compile(torch.nn.Linear(2, 2), backend='fxzero', options={'inner_compiler': 'eager'})\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "m(torch.ones(1, 2)).sum().backward()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown fxzero option\(s\) \['inner'\]"):
        BackendOptions.from_mapping({"inner": "eager"})
    with pytest.raises(ValueError, match="'inner_compiler' must be 'inductor' or 'eager'"):
        BackendOptions.from_mapping({"inner_compiler": "tvm"})
    cmodel = torch.compile(_model(), backend="fxzero", options={"inner_compiler": "tvm"})
    with pytest.raises(Exception, match="inner_compiler"):
        cmodel(torch.ones(1, 4))


def test_unmanaged_model_compiles_and_trains_like_plain_torch_compile() -> None:
    torch._dynamo.reset()
    model, reference = _model(), _model()
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmodel(x).sum().backward()
    assert any("not managed by any fxzero.DistributedOptimizer" in str(w.message) for w in caught)
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_partly_managed_graph_keeps_autograd_for_the_rest() -> None:
    torch._dynamo.reset()
    model, reference = _model(), _model()
    opt = fxzero.DistributedOptimizer(model[2].parameters(), torch.optim.SGD, lr=0.1)  # noqa: F841 (kept alive)
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    x = torch.randn(3, 4)
    cmodel(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)  # unmanaged: autograd
    assert isinstance(model[2].weight.grad, ShardedGrad)
    torch.testing.assert_close(model[2].weight.main_grad, reference[2].weight.grad)  # managed: fxzero


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, forwards: list, sizes: list[int]) -> list[float]:
    losses = []
    for step, size in enumerate(sizes):
        x = torch.randn(size, 4, generator=torch.Generator().manual_seed(step))
        if step == 0:
            torch._dynamo.mark_dynamic(x, 0)
        loss = forwards[step % len(forwards)](x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_second_compile_and_dynamic_batch_reuse_buffers_without_double_counting() -> None:
    torch._dynamo.reset()
    model, reference = _model(), _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, config=fxzero.Config(bucket_size=64))
    pointers = [b.grad_data.data_ptr() for b in opt.runtime.buckets]
    first = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    second = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    sizes = [4, 7, 5, 9, 4, 6]
    losses = _train(model, opt, [first, second], sizes)
    expected = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), [reference], sizes)
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert [b.grad_data.data_ptr() for b in opt.runtime.buckets] == pointers
    copy.deepcopy(opt.state_dict())  # state stays usable after recompiles
