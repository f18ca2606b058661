"""fxzero.explain: the bucket table, marked graphs and schedule, with no training effect."""

from __future__ import annotations

import torch
from expecttest import TestCase

import fxzero


def _mlp_and_optimizer() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = fxzero.DistributedOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=64), module=model
    )
    return model, opt


class _Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(x)


def _section(text: str, title: str) -> str:
    return next(s for s in text.split("\n\n") if s.startswith(title))


class TestExplain(TestCase):
    def test_mlp_table_graph_marks_schedule_and_no_side_effects(self) -> None:
        model, opt = _mlp_and_optimizer()
        before = [p.detach().clone() for p in model.parameters()]
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
        self.assertExpectedInline(
            _section(text, "fxzero buckets"),
            """\
fxzero buckets (dp=1)
|   bucket |   params | first param   | last param   |   numel |   padded |   pad % |   shard numel | shard % 2^16 == 0   |   RS bytes |   AG bytes | dtype (param/grad)   |
|----------|----------|---------------|--------------|---------|----------|---------|---------------|---------------------|------------|------------|----------------------|
|        0 |        2 | 2.bias        | 2.weight     |      82 |      128 |    35.9 |           128 | no                  |        512 |        512 | float32/float32      |
|        1 |        2 | 0.bias        | 0.weight     |      88 |      128 |    31.2 |           128 | no                  |        512 |        512 | float32/float32      |""",
        )
        schedule = _section(text, "schedule").splitlines()
        assert schedule[1].startswith("bucket 0: reduce-scatter launches in graph 0 backward at node ")
        assert schedule[2].startswith("bucket 1: reduce-scatter launches in graph 0 backward at node ")
        assert all("all-gather waited in graph 0 forward at node " in line for line in schedule[1:3])
        assert schedule[3] == "buckets spanning several graphs: none"
        assert "# primals_2 = 0.weight (bucket 1)" in text and "# primals_5 = 2.bias (bucket 0)" in text
        assert text.count("# <- fxzero: wait for bucket") == 2
        assert text.count("# <- fxzero: bucket") == 2 and "bucket 1 reduce-scatter launch" in text
        for p, old in zip(model.parameters(), before):
            assert torch.equal(p.detach(), old)
            assert torch.count_nonzero(p.main_grad) == 0
        assert not any(opt.grad_sync.launched)

    def test_graph_break_bucket_spans_both_graphs(self) -> None:
        torch.manual_seed(0)
        model = _Broken()
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)
        assert len(opt.buckets) == 1
        text = fxzero.explain(model, torch.randn(2, 4), optimizer=opt)
        assert "== graph 1 ==" in text and "# primals_" in text and "fc2.weight" in text
        assert "buckets spanning several graphs: 0 (graphs 0, 1)" in text
        assert "bucket 0: reduce-scatter launches in graph 0 backward" in text
        assert ", graph 1 backward" in text
        assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())
        assert not any(opt.grad_sync.launched)
