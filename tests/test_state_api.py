"""The optimizer's internal state API (what checkpoints and ``load_state_dict`` use): private
methods, since a user who replaces state by hand bypasses every check ``load_state_dict`` makes."""

from __future__ import annotations

import ast
from pathlib import Path
from unittest import mock

import torch

import fxzero

CHECKPOINT = Path(fxzero.__file__).resolve().parent / "checkpoint"


def _bf16_model_and_opt() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    return model, fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model)


def test_fragments_say_where_they_lie_and_replacing_state_publishes_the_masters() -> None:
    model, opt = _bf16_model_and_opt()
    assert sorted((f.slot, f.where.param_offset, f.where.numel) for f in opt.runtime.fragments) == [
        (s, 0, p.numel()) for s, p in enumerate(opt.param_table.params)
    ]
    with opt.runtime.sharded_state.replacing():
        for frag in opt.runtime.fragments:
            frag.param.fill_(float(frag.slot) + 0.5)  # fp32 masters, apart from the bf16 params
    for slot, param in enumerate(opt.param_table.params):
        assert torch.equal(param, torch.full_like(param, slot + 0.5))


def test_fragment_states_round_trip_and_load_state_dict_goes_through_replacing_state() -> None:
    model, opt = _bf16_model_and_opt()
    model(torch.randn(3, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    states = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.runtime.sharded_state.fragment_state(f).items()} for f in opt.runtime.fragments]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in states)
    saved = opt.state_dict()
    with opt.runtime.sharded_state.replacing():
        opt.runtime.sharded_state.load_fragment_states([{**s, "exp_avg": torch.zeros_like(s["exp_avg"])} for s in states])
    assert all(not opt.runtime.sharded_state.fragment_state(f)["exp_avg"].any() for f in opt.runtime.fragments)
    state = opt.runtime.sharded_state
    with mock.patch.object(type(state), "replacing", wraps=state.replacing) as replacing:
        opt.load_state_dict(saved)
    assert replacing.call_count == 1
    assert all(torch.equal(opt.runtime.sharded_state.fragment_state(f)["exp_avg"], s["exp_avg"]) for f, s in zip(opt.runtime.fragments, states))


def _attributes_of(tree: ast.AST, owner: str) -> set[str]:
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and ast.unparse(node.value) == owner}


STATE_API = {"fragment_state", "load_fragment_states", "master_of", "load_master", "replacing"}
"""The methods of the runtime's sharded state fxzero.checkpoint may call: the fragment-level state API
(masters go through it too: under ``Config.param_remainders`` they are rebuilt, not held)."""


def test_checkpoints_use_only_the_state_api_of_the_optimizer() -> None:
    trees = [ast.parse(p.read_text()) for p in CHECKPOINT.glob("*.py")]
    used, runtime, state = ({a for t in trees for a in _attributes_of(t, owner)} for owner in ("opt", "opt.runtime", "opt.runtime.sharded_state"))
    assert used and not {a for a in used if a.startswith("_")} and "buffers" not in used
    assert runtime <= {"fragments", "mesh_params", "sharded_state"} and state == STATE_API
