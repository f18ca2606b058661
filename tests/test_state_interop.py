"""State interop with plain torch.optim: a plain state dict loads into a DistributedOptimizer
(each rank takes its shard) and training goes on exactly as with torch.optim."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.testing import run_ranks

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


def _plain_run() -> tuple[torch.nn.Module, dict[str, Any], list[torch.Tensor]]:
    """Plain AdamW: STEPS steps, its state dict and weights, then STEPS more (the reference)."""
    model = _model()
    opt = torch.optim.AdamW(_groups(model), lr=0.05)
    _train(model, opt, range(STEPS))
    saved = copy.deepcopy(opt.state_dict())  # its tensors are the live state otherwise
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, range(STEPS, 2 * STEPS))
    return weights, saved, [p.detach().clone() for p in model.parameters()]


def _resume_with_fxzero(weights: dict, saved: dict, group: Any = None) -> list[torch.Tensor]:
    model = _model()
    opt = fxzero.DistributedOptimizer(_groups(model), torch.optim.AdamW, lr=0.05, module=model, process_group=group,
                                      config=fxzero.Config(bucket_size=64))  # fmt: skip
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    _train(model, opt, range(STEPS, 2 * STEPS))
    opt.finish_param_sync()  # the last step's gathers land in the next forward otherwise
    return [p.detach().clone() for p in model.parameters()]


def test_a_plain_adamw_state_dict_loads_and_training_continues_bitwise() -> None:
    weights, saved, expected = _plain_run()
    assert all(torch.equal(a, b) for a, b in zip(_resume_with_fxzero(weights, saved), expected))


def _rank_resume() -> bool:
    weights, saved, expected = _plain_run()
    got = _resume_with_fxzero(weights, saved)
    return all(torch.equal(a, b) for a, b in zip(got, expected))  # both ranks: the same batches, averaged


@pytest.mark.timeout(120)
def test_each_rank_takes_its_shard_of_a_plain_state_dict() -> None:
    assert run_ranks(2, _rank_resume, timeout=90) == [True, True]


def test_a_plain_state_dict_with_other_groups_is_refused_naming_the_groups() -> None:
    weights, saved, _ = _plain_run()
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    with pytest.raises(ValueError, match=r"param groups of \[2, 2\] params, this optimizer \[4\]"):
        opt.load_state_dict(saved)


def _other_world_state() -> str:
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    state = opt.state_dict()
    state["world_size"] = dist.get_world_size() + 1 if dist.is_initialized() else 2
    try:
        opt.load_state_dict(state)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_another_world_sizes_state_dict_points_at_save_checkpoint() -> None:
    assert "fxzero.save_checkpoint" in _other_world_state() and "fxzero.load_checkpoint" in _other_world_state()



def _export_after_training() -> list[bool]:
    """fxzero's consolidated state equals plain AdamW's after the same steps, and loads back."""
    model, ref = _model(), _model()
    opt = fxzero.DistributedOptimizer(_groups(model), torch.optim.AdamW, lr=0.05, module=model,
                                      config=fxzero.Config(bucket_size=64))  # fmt: skip
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.05)
    _train(model, opt, range(STEPS))
    _train(ref, ref_opt, range(STEPS))
    got, want = opt.consolidated_state_dict(), ref_opt.state_dict()
    same_state = got["state"].keys() == want["state"].keys() and all(
        got["state"][i].keys() == want["state"][i].keys()
        and all(torch.equal(got["state"][i][k], want["state"][i][k]) for k in want["state"][i])
        for i in want["state"]
    )
    same_groups = got["param_groups"] == want["param_groups"]
    plain = torch.optim.AdamW(_groups(_model()), lr=0.05)
    plain.load_state_dict(got)  # loads without fxzero
    opt.load_state_dict(got)  # and back into fxzero
    return [same_state, same_groups, torch.equal(opt.consolidated_state_dict()["state"][0]["exp_avg"], got["state"][0]["exp_avg"])]


def test_consolidated_state_dict_is_plain_adamw_state_at_world_1() -> None:
    assert _export_after_training() == [True, True, True]


def test_consolidated_state_dict_is_plain_adamw_state_at_world_2() -> None:
    assert run_ranks(2, _export_after_training, timeout=90) == [[True, True, True]] * 2
