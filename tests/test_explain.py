"""fxzero.explain: golden text for two fixed models, graph breaks, no training effect."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

import fxzero
from models import GPT, GPTArgs


def _mlp_and_optimizer() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    config = fxzero.Config(bucket_size=32, overlap_param_gather=True)  # the forward graphs get their waits
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=config, module=model)
    return model, opt


class _Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(x)


def _assert_untouched(model: torch.nn.Module, opt: fxzero.DistributedOptimizer, before: list[torch.Tensor]) -> None:
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p.detach(), old)
        assert torch.count_nonzero(p.main_grad) == 0
    assert not any(opt.ledger.launched)


class TestExplain(TestCase):
    def test_mlp_golden_and_no_side_effects(self) -> None:
        model, opt = _mlp_and_optimizer()
        before = [p.detach().clone() for p in model.parameters()]
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
        self.assertExpectedInline(text, """\
fxzero buckets (dp=1): 2 buckets, 51 param elements in 256 buffer elements (80.1% padding: param starts aligned, buckets to dp shards)
|   bucket |   params | first param   | last param   |   numel |   padded |   pad % |   shard numel | shard % 2^16 == 0   |   RS bytes |   AG bytes | dtype (param/grad)   |   graphs |
|----------|----------|---------------|--------------|---------|----------|---------|---------------|---------------------|------------|------------|----------------------|----------|
|        0 |        2 | 2.bias        | 2.weight     |      21 |      128 |    83.6 |           128 | no                  |        512 |        512 | float32/float32      |        0 |
|        1 |        2 | 0.bias        | 0.weight     |      30 |      128 |    76.6 |           128 | no                  |        512 |        512 | float32/float32      |        0 |

== graph 0: 4 params of buckets 0, 1 ==
# primals_2 = 0.weight (bucket 1)
# primals_3 = 0.bias (bucket 1)
# primals_4 = 2.weight (bucket 0)
# primals_5 = 2.bias (bucket 0)
-- graph 0 forward, after fxzero's passes (14 nodes; frees omitted) --
def forward(self, primals_1, 0.weight, 0.bias, 2.weight, 2.bias):
    ag_wait_bucket1 = torch.ops.fxzero.wait_params.default([0.weight, 0.bias])  # <- fxzero: wait for bucket 1's all-gather (and launch the next)
    t = torch.ops.aten.t.default(0.weight)
    addmm = torch.ops.aten.addmm.default(0.bias, primals_1, t)
    relu = torch.ops.aten.relu.default(addmm)
    detach = torch.ops.aten.detach.default(relu)
    ag_wait_bucket0 = torch.ops.fxzero.wait_params.default([2.weight, 2.bias])  # <- fxzero: wait for bucket 0's all-gather (and launch the next)
    t_1 = torch.ops.aten.t.default(2.weight)
    addmm_1 = torch.ops.aten.addmm.default(2.bias, relu, t_1)
    return (addmm_1, primals_1, 0.weight, 0.bias, 2.weight, 2.bias, relu, detach, t_1)
-- graph 0 backward, after fxzero's passes (28 nodes; frees omitted) --
def forward(self, primals_1, 0.weight, 0.bias, 2.weight, 2.bias, relu, detach, t_1, tangents_1):
    t_2 = torch.ops.aten.t.default(t_1)
    mm = torch.ops.aten.mm.default(tangents_1, t_2)
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu)
    t_4 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
    view = torch.ops.aten.view.default(sum_1, [3])
    t_5 = torch.ops.aten.t.default(t_4)
    rs_launch_bucket0 = torch.ops.fxzero.grads_ready.default([t_5, view], [2.weight, 2.bias])  # <- fxzero: launch bucket 0's reduce-scatter (its grads from this graph are in)
    detach_1 = torch.ops.aten.detach.default(detach)
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_1, 0)
    t_6 = torch.ops.aten.t.default(threshold_backward)
    mm_2 = torch.ops.aten.mm.default(t_6, primals_1)
    t_7 = torch.ops.aten.t.default(mm_2)
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
    view_1 = torch.ops.aten.view.default(sum_2, [6])
    t_8 = torch.ops.aten.t.default(t_7)
    rs_launch_bucket1 = torch.ops.fxzero.grads_ready.default([t_8, view_1], [0.weight, 0.bias])  # <- fxzero: launch bucket 1's reduce-scatter (its grads from this graph are in)
    return (None, None, None, None, None)

schedule (node k/N: the k-th of the graph's N nodes; backward graphs run in reverse graph order)
bucket 0: reduce-scatter launches in graph 0 backward at node 17/28 (61%); all-gather waited in graph 0 forward at node 10/14 (71%)
bucket 1: reduce-scatter launches in graph 0 backward at node 26/28 (93%); all-gather waited in graph 0 forward at node 5/14 (36%)
buckets spanning several graphs: none

collectives: fxzero's per step, as c10d counts them: none (data-parallel size 1); data-parallel group: ranks [0]
the model's own in its graphs: none
""")
        _assert_untouched(model, opt, before)

    def test_graph_break_golden_bucket_spans_both_graphs(self) -> None:
        torch.manual_seed(0)
        model = _Broken()
        config = fxzero.Config(overlap_param_gather=True)
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=config, module=model)
        before = [p.detach().clone() for p in model.parameters()]
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
        self.assertExpectedInline(text, """\
fxzero buckets (dp=1): 1 bucket, 51 param elements in 128 buffer elements (60.2% padding: param starts aligned, buckets to dp shards)
|   bucket |   params | first param   | last param   |   numel |   padded |   pad % |   shard numel | shard % 2^16 == 0   |   RS bytes |   AG bytes | dtype (param/grad)   | graphs   |
|----------|----------|---------------|--------------|---------|----------|---------|---------------|---------------------|------------|------------|----------------------|----------|
|        0 |        4 | fc2.bias      | fc1.weight   |      51 |      128 |    60.2 |           128 | no                  |        512 |        512 | float32/float32      | 0, 1     |

== graph 0: 2 params of buckets 0 ==
# primals_2 = fc1.weight (bucket 0)
# primals_3 = fc1.bias (bucket 0)
-- graph 0 forward, after fxzero's passes (9 nodes; frees omitted) --
def forward(self, primals_1, fc1.weight, fc1.bias):
    ag_wait_bucket0 = torch.ops.fxzero.wait_params.default([fc1.weight, fc1.bias])  # <- fxzero: wait for bucket 0's all-gather (and launch the next)
    t = torch.ops.aten.t.default(fc1.weight)
    addmm = torch.ops.aten.addmm.default(fc1.bias, primals_1, t)
    relu = torch.ops.aten.relu.default(addmm)
    detach = torch.ops.aten.detach.default(relu)
    return (relu, primals_1, fc1.weight, fc1.bias, detach)
-- graph 0 backward, after fxzero's passes (15 nodes; frees omitted) --
def forward(self, primals_1, fc1.weight, fc1.bias, detach, tangents_1):
    detach_1 = torch.ops.aten.detach.default(detach)
    threshold_backward = torch.ops.aten.threshold_backward.default(tangents_1, detach_1, 0)
    t_1 = torch.ops.aten.t.default(threshold_backward)
    mm = torch.ops.aten.mm.default(t_1, primals_1)
    t_2 = torch.ops.aten.t.default(mm)
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
    view = torch.ops.aten.view.default(sum_1, [6])
    t_3 = torch.ops.aten.t.default(t_2)
    rs_launch_bucket0 = torch.ops.fxzero.grads_ready.default([t_3, view], [fc1.weight, fc1.bias])  # <- fxzero: launch bucket 0's reduce-scatter (its grads from this graph are in)
    return (None, None, None)

== graph 1: 2 params of buckets 0 ==
# primals_2 = fc2.weight (bucket 0)
# primals_3 = fc2.bias (bucket 0)
-- graph 1 forward, after fxzero's passes (7 nodes; frees omitted) --
def forward(self, primals_1, fc2.weight, fc2.bias):
    ag_wait_bucket0 = torch.ops.fxzero.wait_params.default([fc2.weight, fc2.bias])  # <- fxzero: wait for bucket 0's all-gather (and launch the next)
    t = torch.ops.aten.t.default(fc2.weight)
    addmm = torch.ops.aten.addmm.default(fc2.bias, primals_1, t)
    return (addmm, primals_1, fc2.weight, fc2.bias, t)
-- graph 1 backward, after fxzero's passes (15 nodes; frees omitted) --
def forward(self, primals_1, fc2.weight, fc2.bias, t, tangents_1):
    t_1 = torch.ops.aten.t.default(t)
    mm = torch.ops.aten.mm.default(tangents_1, t_1)
    t_2 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_2, primals_1)
    t_3 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
    view = torch.ops.aten.view.default(sum_1, [3])
    t_4 = torch.ops.aten.t.default(t_3)
    rs_launch_bucket0 = torch.ops.fxzero.grads_ready.default([t_4, view], [fc2.weight, fc2.bias])  # <- fxzero: launch bucket 0's reduce-scatter (its grads from this graph are in)
    return (mm, None, None)

schedule (node k/N: the k-th of the graph's N nodes; backward graphs run in reverse graph order)
bucket 0: reduce-scatter launches in graph 0 backward at node 13/15 (87%), graph 1 backward at node 13/15 (87%) (at the last of these to run); all-gather waited in graph 0 forward at node 3/9 (33%), graph 1 forward at node 3/7 (43%) (by the first to run)
buckets spanning several graphs: 0 (graphs 0, 1)

collectives: fxzero's per step, as c10d counts them: none (data-parallel size 1); data-parallel group: ranks [0]
the model's own in its graphs: none
""")
        _assert_untouched(model, opt, before)


def test_gpt_graph_break_tied_embedding_bucket_spans_graphs() -> None:
    torch.manual_seed(0)
    model = GPT(GPTArgs(layers=1, graph_break=True))
    opt = fxzero.DistributedOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=4000), module=model
    )
    text = fxzero.explain(model, torch.randint(0, 64, (2, 16)), optimizer=opt)
    table = text.split("\n\n")[0].splitlines()
    assert table[0].startswith("fxzero buckets (dp=1): 4 buckets, ")
    # The last bucket holds the embeddings: read before the break (graph 0) and, tied to
    # the head, after it (graph 1).
    assert table[-1].split("|")[3].strip() == "blocks.0.ln2.bias" and table[-1].rstrip("| ").endswith("0, 1")
    assert "buckets spanning several graphs: 3 (graphs 0, 1)" in text
    assert "def forward(self, primals_1, wte.weight, wpe.weight):" in text
    assert "bucket 3: reduce-scatter launches in graph 0 backward at node " in text
    # overlap off (the default): the step finishes the gathers, the forwards wait for nothing
    assert "wait_params" not in text
    assert "; all-gather finished inside step() (overlap_param_gather off: no wait in the graphs)\n" in text


def test_explain_shows_the_same_graphs_whatever_the_process_explained_before() -> None:
    """Each explain compiles a frame of its own, with static shapes: explains of other models
    and shapes before it once made it compile with dynamic shapes (other graphs), and from the
    ninth on Dynamo's recompile limit left it with no graph at all."""
    model, opt = _mlp_and_optimizer()
    first = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
    for width in range(5, 14):  # nine other models and shapes
        other = torch.nn.Sequential(torch.nn.Linear(width, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
        other_opt = fxzero.DistributedOptimizer(other.parameters(), torch.optim.SGD, lr=0.1, module=other)
        assert "== graph 0: 4 params" in fxzero.explain(other, torch.randn(width - 2, width), optimizer=other_opt)
    assert fxzero.explain(model, torch.randn(2, 4), optimizer=opt) == first


def test_explain_names_its_bad_arguments() -> None:
    model, opt = _mlp_and_optimizer()
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="optimizer must be a fxzero.DistributedOptimizer, got SGD"):
        fxzero.explain(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="inner_compiler must be 'eager' or 'inductor', got 'cuda'"):
        fxzero.explain(model, x, optimizer=opt, inner_compiler="cuda")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fxzero.explain(lambda t: t, x, optimizer=opt)


def test_early_hand_offs_are_named_apart_from_the_bucket_launch() -> None:
    """With a hand-off per gradient, each but the bucket's last only adds its gradient into
    main_grad: named grads_bucketB_K, and the schedule points at the last one."""
    from unittest import mock

    import fxzero.passes.bucket_reduce_scatter as backward_pass

    model, opt = _mlp_and_optimizer()
    with mock.patch.object(backward_pass, "HANDOFF_NUMEL", 0):
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
    lines = [line.strip() for line in text.splitlines() if "fxzero.grads_ready" in line]
    assert [line.split(" = ")[0] for line in lines] == ["grads_bucket0_0", "rs_launch_bucket0", "grads_bucket1_0", "rs_launch_bucket1"]
    assert lines[0].endswith("# <- fxzero: add these grads of bucket 0 into main_grad (they die here)")
    schedule = [line for line in text.splitlines() if line.startswith("bucket 0: reduce-scatter launches in")]
    assert len(schedule) == 1 and "(at the last of these to run)" not in schedule[0]  # one site: the launch


def test_the_compiled_graphs_of_the_process_survive_an_explain() -> None:
    """explain compiles a frame of its own and resets nothing: the user's compiled model
    keeps its graphs (before, explain reset Dynamo and the next call compiled again)."""
    import fxzero.backend

    model, opt = _mlp_and_optimizer()
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(gm)
        return fxzero.backend.fxzero_backend(gm, example_inputs, options={"inner_compiler": "eager"})

    cmodel = torch.compile(model, backend=counting)
    x = torch.randn(2, 4)
    for _ in range(2):
        cmodel(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(compiles) == 1
    text = fxzero.explain(model, x, optimizer=opt)
    assert "bucket" in text
    cmodel(x).sum().backward()  # the user's graph again: no new compile
    opt.step()
    assert len(compiles) == 1
