"""The optimizer keeps its config, group, param table, buffers, wrapped optimizer class and its
runtime (:mod:`fxzero.runtime`); the runtime is a read-only surface: its parts are not reassigned."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxzero


def test_the_optimizer_keeps_few_fields_and_its_runtime_is_read_only() -> None:
    model = torch.nn.Linear(4, 4)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model)
    public = {name for name in vars(opt) if not name.startswith("_")}
    assert public == {"config", "dp", "optimizer_class", "defaults", "param_groups", "param_table", "buffers", "runtime"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.runtime.ledger = None  # type: ignore[misc]
    assert opt.runtime.sharded_state.rank_state is opt.state and opt.runtime.buckets == opt.buffers[0].buckets
