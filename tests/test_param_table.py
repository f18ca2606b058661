"""The param table: one row per managed param, found by identity, named once."""

from __future__ import annotations

import torch

import fxzero
from fxzero.optim.layout.param_table import ParamTable, param_names


def test_rows_follow_group_order_with_names_groups_and_buckets() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = fxzero.DistributedOptimizer([{"params": decay}, {"params": rest}], torch.optim.SGD, lr=0.1, module=model)
    table = opt.param_table
    assert [(r.slot, r.name, r.group) for r in table.rows] == [(0, "0.weight", 0), (1, "1.weight", 0), (2, "0.bias", 1), (3, "1.bias", 1)]
    assert table.params == tuple(decay + rest) == opt.param_table.params and table.group_slots == ((0, 1), (2, 3))
    assert all(any(table.rows[s].param is p for p in opt.runtime.buckets[b].params) for s, b in enumerate(table.bucket_of_slot))
    assert not any(hasattr(p, "_fxzero_slot") or hasattr(p, "_fxzero_name") for p in model.parameters())


def test_find_confirms_identity_and_labels_fall_back_to_the_slot() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [a, b]}]
    table = ParamTable.build(groups, {id(a): "a"}, {id(a): 1, id(b): 0})
    assert table.find(a) == 0 and table.find(b) == 1
    assert table.find(torch.zeros(3)) is None and table.find(a.detach()) is None
    assert [table.label(0), table.label(1)] == ["a", "params[1]"]
    assert table.describe([0, 1]) == "a, params[1] (2 params, 5 elements)"


def test_module_names_win_over_named_parameter_groups_and_tied_weights_keep_their_first_name() -> None:
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    groups = [{"params": [emb.weight], "param_names": ["given"]}]
    assert param_names(groups, None) == {id(emb.weight): "given"}
    assert param_names(groups, model) == {id(emb.weight): "emb.weight"}
