"""fxzero.explain: golden text for two fixed models, graph breaks, no training effect."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase

import fxzero
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.target import load_target
from derived_layout import derive_layout
from models import GPT, GPTArgs

ROOT = Path(__file__).resolve().parent.parent


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


def _found(opt: fxzero.DistributedOptimizer) -> dict[str, Any]:
    """What explain must leave as it found it: params, grads (``.grad`` and the buffers),
    the wrapped optimizer's state and the readiness ledger's."""
    return {
        "params": [p.detach().clone() for p in opt.param_table.params],
        "grads": [p.grad for p in opt.param_table.params],
        "main_grads": [_effective_grad(opt, slot) for slot in range(len(opt.param_table.params))],
        "state": opt.state_dict(),
        "ledger": opt.runtime.ledger.snapshot(),
    }


def _effective_grad(opt: fxzero.DistributedOptimizer, slot: int) -> torch.Tensor:
    """What ``main_grad`` counts as: zeros where it holds a gradient the last step consumed
    (overwritten by the next one, zeroed before any read: :mod:`fxzero.optim.gradients.stale_grads`)."""
    main_grad, stale = opt.param_table.params[slot].main_grad, opt.runtime.stale
    return torch.zeros_like(main_grad) if stale is not None and stale.stale(slot) else main_grad.clone()


def _assert_as_found(opt: fxzero.DistributedOptimizer, found: dict[str, Any]) -> None:
    now = _found(opt)
    assert all(map(torch.equal, now.pop("params"), found["params"]))
    assert all(map(torch.equal, now.pop("main_grads"), found["main_grads"]))
    torch.testing.assert_close(now.pop("state"), found["state"], rtol=0, atol=0)
    assert now == {"grads": found["grads"], "ledger": found["ledger"]}


def _named_by_order(text: str) -> str:
    """``text`` with each graph id (``12/0``) replaced by its order of appearance (``G0``)."""
    ids: dict[str, str] = {}
    return re.sub(r"\b\d+/\d+\b", lambda m: ids.setdefault(m.group(0), f"G{len(ids)}"), text)


class TestExplain(TestCase):
    def test_mlp_golden_and_no_side_effects(self) -> None:
        torch._dynamo.reset()  # graphs are named by Dynamo's compile ids: 0/0 from here
        model, opt = _mlp_and_optimizer()
        found = _found(opt)
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager", full=True)
        self.assertExpectedInline(text, """\
fxzero explain: Sequential, world size 1, bucket size 32, inner compiler eager, overlap_param_gather on
process group: none or world size 1 (no collective is issued)

2 buckets: 51 param elements in 256 buffer elements (80.1% padding), float32 params, float32 grads
bucket  params  first .. last param  elements  padded  pad %  shard/rank  grad bytes  gather bytes  graphs
------  ------  -------------------  --------  ------  -----  ----------  ----------  ------------  ------
     0       2  2.bias .. 2.weight         21     128   83.6         128         512           512  0/0
     1       2  0.bias .. 0.weight         30     128   76.6         128         512           512  0/0

schedule: node k/N of each compiled graph; forward graphs run in order, backward graphs in reverse
graph 0/0: 4 params of buckets 0, 1
  forward    14 nodes: gather waited for bucket 1 at node 5 (36%), bucket 0 at node 10 (71%)
  backward   28 nodes: reduction launched for bucket 0 at node 17 (61%), bucket 1 at node 26 (93%)
buckets read by several graphs: none

collectives per step, c10d names (as torch.profiler shows them): none
  data-parallel group: ranks [0]
the model's own in its graphs: none

== graph 0/0: 4 params of buckets 0, 1 ==
# primals_2 = 0.weight (bucket 1)
# primals_3 = 0.bias (bucket 1)
# primals_4 = 2.weight (bucket 0)
# primals_5 = 2.bias (bucket 0)
-- graph 0/0 forward, after fxzero's passes (14 nodes; frees omitted) --
def forward(self, primals_1, 0.weight, 0.bias, 2.weight, 2.bias):
    wait_bucket1 = torch.ops.fxzero.wait_params.default([0.weight, 0.bias])  # <- fxzero: wait for bucket 1's gather (and launch the next)
    t = torch.ops.aten.t.default(0.weight)
    addmm = torch.ops.aten.addmm.default(0.bias, primals_1, t)
    relu = torch.ops.aten.relu.default(addmm)
    detach = torch.ops.aten.detach.default(relu)
    wait_bucket0 = torch.ops.fxzero.wait_params.default([2.weight, 2.bias])  # <- fxzero: wait for bucket 0's gather (and launch the next)
    t_1 = torch.ops.aten.t.default(2.weight)
    addmm_1 = torch.ops.aten.addmm.default(2.bias, relu, t_1)
    return (addmm_1, primals_1, 0.weight, 0.bias, 2.weight, 2.bias, relu, detach, t_1)
-- graph 0/0 backward, after fxzero's passes (28 nodes; frees omitted) --
def forward(self, primals_1, 0.weight, 0.bias, 2.weight, 2.bias, relu, detach, t_1, tangents_1):
    t_2 = torch.ops.aten.t.default(t_1)
    mm = torch.ops.aten.mm.default(tangents_1, t_2)
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu)
    t_4 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
    view = torch.ops.aten.view.default(sum_1, [3])
    t_5 = torch.ops.aten.t.default(t_4)
    launch_bucket0 = torch.ops.fxzero.grads_ready.default([t_5, view], [2.weight, 2.bias])  # <- fxzero: launch bucket 0's reduction (its grads from this graph are in)
    detach_1 = torch.ops.aten.detach.default(detach)
    threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_1, 0)
    t_6 = torch.ops.aten.t.default(threshold_backward)
    mm_2 = torch.ops.aten.mm.default(t_6, primals_1)
    t_7 = torch.ops.aten.t.default(mm_2)
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
    view_1 = torch.ops.aten.view.default(sum_2, [6])
    t_8 = torch.ops.aten.t.default(t_7)
    launch_bucket1 = torch.ops.fxzero.grads_ready.default([t_8, view_1], [0.weight, 0.bias])  # <- fxzero: launch bucket 1's reduction (its grads from this graph are in)
    return (None, None, None, None, None)
""")
        self.assertIn(derive_layout(list(model.parameters()), 1, 32).summary_line(), text)  # the figures, from the rules
        _assert_as_found(opt, found)

    def test_graph_break_golden_bucket_spans_both_graphs(self) -> None:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Broken()
        config = fxzero.Config(overlap_param_gather=True)
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=config, module=model)
        found = _found(opt)
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager")
        self.assertExpectedInline(text, """\
fxzero explain: _Broken, world size 1, bucket size 40,000,000, inner compiler eager, overlap_param_gather on
process group: none or world size 1 (no collective is issued)

1 bucket: 51 param elements in 128 buffer elements (60.2% padding), float32 params, float32 grads
bucket  params  first .. last param     elements  padded  pad %  shard/rank  grad bytes  gather bytes  graphs
------  ------  ----------------------  --------  ------  -----  ----------  ----------  ------------  --------
     0       4  fc2.bias .. fc1.weight        51     128   60.2         128         512           512  2/0, 3/0

schedule: node k/N of each compiled graph; forward graphs run in order, backward graphs in reverse
graph 2/0: 2 params of buckets 0
  forward     9 nodes: gather waited for bucket 0 at node 3 (33%)
  backward   15 nodes: reduction launched for bucket 0 at node 13 (87%)
graph 3/0: 2 params of buckets 0
  forward     7 nodes: gather waited for bucket 0 at node 3 (43%)
  backward   15 nodes: reduction launched for bucket 0 at node 13 (87%)
buckets read by several graphs: 0 (graphs 2/0, 3/0)
  (such a bucket launches where its last grads arrive and is waited by the first forward to run)

collectives per step, c10d names (as torch.profiler shows them): none
  data-parallel group: ranks [0]
the model's own in its graphs: none
""")
        _assert_as_found(opt, found)


def test_gpt_graph_break_tied_embedding_bucket_spans_graphs() -> None:
    torch.manual_seed(0)
    model = GPT(GPTArgs(layers=1, graph_break=True))
    opt = fxzero.DistributedOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=4000), module=model
    )
    text = fxzero.explain(model, torch.randint(0, 64, (2, 16)), optimizer=opt, inner_compiler="eager", full=True)
    lines = text.splitlines()
    assert any(line.startswith("4 buckets: ") for line in lines)
    # The last bucket holds the embeddings: read before the break (the first graph) and,
    # tied to the head, after it (the second).
    first, second = re.findall(r"^graph (\S+): ", text, re.M)
    row = next(line for line in lines if line.startswith("     3  "))
    assert "blocks.0.ln2.bias .. " in row and row.endswith(f"  {first}, {second}"), row
    assert f"buckets read by several graphs: 3 (graphs {first}, {second})" in lines
    assert "def forward(self, primals_1, wte.weight, wpe.weight):" in text
    graph0 = lines[lines.index(next(line for line in lines if line.startswith(f"graph {first}: "))) :]
    assert "3 at node " in next(line for line in graph0 if line.startswith("  backward"))
    # overlap off (the default): the step finishes the gathers, the forwards wait for nothing
    assert "wait_params" not in text
    assert "gathers: finished inside step() (overlap_param_gather off: the forward graphs wait for none)" in lines


def test_explain_shows_the_same_graphs_whatever_the_process_explained_before() -> None:
    """Each explain compiles a frame of its own, with static shapes: explains of other models
    and shapes before it once made it compile with dynamic shapes (other graphs), and from the
    ninth on Dynamo's recompile limit left it with no graph at all."""
    model, opt = _mlp_and_optimizer()
    first = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager", full=True)
    for width in range(5, 14):  # nine other models and shapes
        other = torch.nn.Sequential(torch.nn.Linear(width, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
        other_opt = fxzero.DistributedOptimizer(other.parameters(), torch.optim.SGD, lr=0.1, module=other)
        text = fxzero.explain(other, torch.randn(width - 2, width), optimizer=other_opt, inner_compiler="eager")
        assert re.search(r"^graph \d+/0: 4 params", text, re.M), text
    again = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager", full=True)
    assert again != first and _named_by_order(again) == _named_by_order(first)  # the same graphs, named by their own compiles


def test_explain_leaves_a_training_optimizer_as_found_or_refuses_naming_its_gradients() -> None:
    """After a compiled step (compiled slots, zero grads present: ``set_to_none=False``) explain
    leaves grads, state and ledger as they were, so the next step is the one it would have
    been; between a backward and the step it refuses, naming the params holding gradients."""
    model, opt = _mlp_and_optimizer()
    compiled = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    compiled(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    found = _found(opt)
    fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager")
    _assert_as_found(opt, found)
    compiled(torch.randn(2, 4)).sum().backward()
    found = _found(opt)
    with pytest.raises(RuntimeError, match=r"holds gradients not yet stepped, of 0\.weight, 0\.bias, 2\.weight, 2\.bias \(4 params"):
        fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager")
    _assert_as_found(opt, found)


def test_explain_names_its_bad_arguments() -> None:
    model, opt = _mlp_and_optimizer()
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="optimizer must be a fxzero.DistributedOptimizer, got SGD"):
        fxzero.explain(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="inner_compiler must be 'eager' or 'inductor', got 'cuda'"):
        fxzero.explain(model, x, optimizer=opt, inner_compiler="cuda")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fxzero.explain(lambda t: t, x, optimizer=opt, inner_compiler="eager")


def test_early_hand_offs_are_named_apart_from_the_bucket_launch() -> None:
    """With a hand-off per gradient, each but the bucket's last only adds its gradient into
    main_grad: named grads_bucketB_K, and the schedule points at the last one."""
    from unittest import mock

    import fxzero.passes.bucket_reduce_scatter as backward_pass

    model, opt = _mlp_and_optimizer()
    with mock.patch.object(backward_pass, "HANDOFF_NUMEL", 0):
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt, inner_compiler="eager", full=True)
    lines = [line.strip() for line in text.splitlines() if "fxzero.grads_ready" in line]
    assert [line.split(" = ")[0] for line in lines] == ["grads_bucket0_0", "launch_bucket0", "grads_bucket1_0", "launch_bucket1"]
    assert lines[0].endswith("# <- fxzero: add these grads of bucket 0 into main_grad (they die here)")
    backward = next(line for line in text.splitlines() if line.startswith("  backward"))
    assert backward.count("bucket") == 2, backward  # the schedule names the launches only, not the hand-offs before them


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
    text = fxzero.explain(model, x, optimizer=opt, inner_compiler="eager")
    assert "bucket" in text
    cmodel(x).sum().backward()  # the user's graph again: no new compile
    opt.step()
    assert len(compiles) == 1


# ---- examples/explain_mlp.py at world size 2: summary, JSON, picture from one compile ---------------
def _bucket_truth(opt: fxzero.DistributedOptimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """What the optimizer's own buckets hold, read straight from them."""
    return [
        {
            "index": b.index,
            "params": [names[id(p)] for p in b.params],
            "elements": sum(p.numel() for p in b.params),
            "padded": b.param_data.numel(),
            "shard_per_rank": b.param_data.numel() // opt.dp.size,
            "grad_bytes": b.grad_data.nbytes,
            "gather_bytes": b.param_data.nbytes,
        }
        for b in opt.runtime.buckets
    ]


@pytest.fixture(scope="module")
def mlp_world_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fxzero explain examples/explain_mlp.py --world-size 2 --bucket-size 5000 --overlap-param-gather``
    as the CLI runs it (the fake process group), compiled once (eager) for the tests below."""
    out = tmp_path_factory.mktemp("explain")
    try:
        import matplotlib  # noqa: F401  (the picture is drawn where the plotting extra is installed)

        timeline = out / "timeline.png"
    except ImportError:
        timeline = None
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        model, inputs = load_target(str(ROOT / "examples" / "explain_mlp.py"), "fxzero_explain", "")()
        config = fxzero.Config(bucket_size=5000, overlap_param_gather=True)
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.0, config=config, module=model)
        text = fxzero.explain(model, *inputs, optimizer=opt, inner_compiler="eager", json_file=out / "e.json", timeline_file=timeline)
        names = {id(p): n for n, p in model.named_parameters()}
        truth = {"buckets": _bucket_truth(opt, names), "collectives": opt.collectives_per_step}
    finally:
        dist.destroy_process_group()
    return {"text": text, "data": json.loads((out / "e.json").read_text()), "truth": truth, "timeline": timeline}


def test_summary_of_the_example_fits_a_screen(mlp_world_2: dict[str, Any]) -> None:
    lines = mlp_world_2["text"].splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 120, (len(lines), max(map(len, lines)))
    assert lines[0].startswith("fxzero explain: ResidualMLP, world size 2, bucket size 5,000, inner compiler eager")
    model, _ = load_target(str(ROOT / "examples" / "explain_mlp.py"), "fxzero_explain", "")()
    assert derive_layout(list(model.parameters()), 2, 5000).summary_line() + ", float32 params, float32 grads" in lines
    assert re.search(r"^buckets read by several graphs: 0 \(graphs (\d+/0), (?!\1)\d+/0\)$", mlp_world_2["text"], re.M), lines
    assert not any(line.startswith("def forward") for line in lines)  # the graphs' code is --full's


def test_json_holds_the_optimizers_buckets_and_the_summarys_schedule(mlp_world_2: dict[str, Any]) -> None:
    data, truth = mlp_world_2["data"], mlp_world_2["truth"]
    assert data["schema"] == 2 and data["conditions"]["world_size"] == 2 and data["conditions"]["bucket_size"] == 5000
    assert data["conditions"]["backend"] == "fake" and data["conditions"]["collectives_assume"] == "nccl"
    keys = truth["buckets"][0].keys()
    assert [{k: b[k] for k in keys} for b in data["buckets"]] == truth["buckets"]
    assert data["collectives"]["per_step"] == truth["collectives"]
    assert (data["collectives"]["reduction"], data["collectives"]["gather"]) == ("reduce_scatter", "allgather")
    # each bucket's reduction launches once per graph reading it, and its gather is waited there
    for graph in data["graphs"]:
        for key, part in (("launches", "backward"), ("waits", "forward")):
            assert sorted(e["bucket"] for e in graph["parts"][part][key]) == graph["buckets"], graph
        assert {p["bucket"] for p in graph["params"]} == set(graph["buckets"])
    # the summary shows the same positions
    text = mlp_world_2["text"]
    for graph in data["graphs"]:
        for e in graph["parts"]["backward"]["launches"]:
            assert f"{e['bucket']} at node {e['node']} (" in text


def test_timeline_png_is_drawn(mlp_world_2: dict[str, Any]) -> None:
    if mlp_world_2["timeline"] is None:
        pytest.skip("matplotlib is not installed (pip install -e .[bench])")
    assert mlp_world_2["timeline"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collectives_are_named_as_the_group_issues_them() -> None:
    """gloo: alltoall and a broadcast per rank (what torch.profiler records there,
    tests/test_optimizer.py::test_collectives_per_step_are_what_a_step_issues); NCCL's otherwise."""
    from fxzero.explainer import collectives

    gloo = DataParallelGroup(None, 2, 0, "all_to_all", backend="gloo")
    nccl = DataParallelGroup(None, 2, 0, "reduce_scatter", backend="nccl")
    fake = DataParallelGroup(None, 2, 0, "reduce_scatter", backend="fake")
    assert [(collectives.reduction_name(g), collectives.gather_name(g)) for g in (gloo, nccl, fake)] == [
        ("alltoall", "broadcast"), ("reduce_scatter", "allgather"), ("reduce_scatter", "allgather")
    ]
    assert collectives.backend_note(gloo).endswith("reduces each bucket with alltoall (in chunks), gathers it with one broadcast per rank")
    assert "Names and default bucket size are NCCL's" in collectives.backend_note(fake)
    assert [collectives.assumed_backend(g) for g in (gloo, nccl, fake)] == ["gloo", "nccl", "nccl"]


def test_explain_and_the_cli_compile_with_inductor_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a training run compiles with; checked without compiling (a spy takes the options)."""
    import fxzero.explainer as explainer
    from fxzero.cli import _parser

    seen = []
    monkeypatch.setattr(explainer, "record", lambda model, inputs, opt, options, *rest: seen.append(options) or [])
    model, opt = _mlp_and_optimizer()
    fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
    assert seen == [{"inner_compiler": "inductor"}]
    assert _parser().parse_args(["explain", "x.py"]).inner_compiler == "inductor"


def test_json_and_timeline_give_estimated_times_from_the_graphs_costs(mlp_world_2: dict[str, Any]) -> None:
    """Each part's estimated ms, and each event's ms into its part: node k starts after nodes
    0..k-1, so events keep the order of their nodes and fall inside the part."""
    data = mlp_world_2["data"]
    assert re.fullmatch(r"\d+ GFLOP/s, [\d.]+ GB/s, measured on cpu", data["conditions"]["speed"])
    for graph in data["graphs"]:
        for part in graph["parts"].values():
            assert part["ms"] > 0
            events = sorted(part["launches"] + part["handoffs"] + part["waits"], key=lambda e: e["node"])
            times = [e["ms"] for e in events]
            assert times == sorted(times) and all(0 <= t <= part["ms"] for t in times)


def test_node_costs_are_a_matmuls_flops_and_the_bytes_it_reads_and_writes() -> None:
    """(8 x 16) @ (16 x 32): 2 * 8 * 16 * 32 FLOPs, reading 8*16 + 16*32 and writing 8*32 fp32
    elements; relu reads and writes 8*32 and does no FLOP torch counts; a view moves nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxzero.explainer.node_costs import Speed, node_costs

    gm = make_fx(lambda a, b: torch.mm(a, b).relu().t())(torch.randn(8, 16), torch.randn(16, 32))
    costs = {n.target.__name__ if callable(n.target) else n.target: c for n, c in zip(gm.graph.nodes, node_costs(gm))}
    assert costs["mm.default"] == (2 * 8 * 16 * 32, (8 * 16 + 16 * 32 + 8 * 32) * 4)
    assert costs["relu.default"] == (0, 2 * 8 * 32 * 4)
    assert costs["t.default"] == (0, 0)
    speed = Speed(flops=1e9, bytes=1e9, device="cpu")
    assert speed.seconds(8192, 3584) == pytest.approx(8.192e-6)  # compute-bound: FLOPs / peak


def test_one_bucket_is_said_in_the_singular() -> None:
    from fxzero.explainer.sizing import size_run
    from fxzero.explainer.timeline import _conditions

    assert "; 1 bucket, " in size_run(torch.nn.Linear(4, 4), 2).text()
    conditions = {"bucket_size": None, "collectives_assume": None, "backend": "gloo", "world_size": 2, "overlap_param_gather": False,
                  "inner_compiler": "eager", "fxzero": "0", "torch": "2"}  # fmt: skip
    text = _conditions({"conditions": conditions, "buckets": [{}], "collectives": {"reduction": None}}, "today")
    assert "; 1 bucket; " in text and "buckets" not in text
