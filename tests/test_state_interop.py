"""State interop with plain torch.optim: a plain state dict loads into a DistributedOptimizer
(each rank takes its shard) and training goes on exactly as with torch.optim."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import fxzero
from fxzero.optim.state import sharded_state
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
    state = opt.rank_state_dict()
    state["world_size"] = dist.get_world_size() + 1 if dist.is_initialized() else 2
    try:
        opt.load_state_dict(state)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_another_world_sizes_state_dict_points_at_save_checkpoint() -> None:
    assert "fxzero.save_checkpoint" in _other_world_state() and "fxzero.load_checkpoint" in _other_world_state()



def _same_state(got: dict[str, Any], want: dict[str, Any]) -> tuple[bool, bool]:
    """(every param's state bitwise equal, param groups equal)."""
    same_state = got["state"].keys() == want["state"].keys() and all(
        got["state"][i].keys() == want["state"][i].keys()
        and all(torch.equal(got["state"][i][k], want["state"][i][k]) for k in want["state"][i])
        for i in want["state"]
    )
    return same_state, got["param_groups"] == want["param_groups"]


def _export_after_training() -> list[bool]:
    """fxzero's consolidated state equals plain AdamW's after the same steps, and loads back."""
    model, ref = _model(), _model()
    opt = fxzero.DistributedOptimizer(_groups(model), torch.optim.AdamW, lr=0.05, module=model,
                                      config=fxzero.Config(bucket_size=64))  # fmt: skip
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.05)
    _train(model, opt, range(STEPS))
    _train(ref, ref_opt, range(STEPS))
    got, want = opt.consolidated_state_dict(), ref_opt.state_dict()
    same_state, same_groups = _same_state(got, want)
    plain = torch.optim.AdamW(_groups(_model()), lr=0.05)
    plain.load_state_dict(got)  # loads without fxzero
    opt.load_state_dict(got)  # and back into fxzero
    return [same_state, same_groups, torch.equal(opt.consolidated_state_dict()["state"][0]["exp_avg"], got["state"][0]["exp_avg"])]


def test_consolidated_state_dict_is_plain_adamw_state_at_world_1() -> None:
    assert _export_after_training() == [True, True, True]


def test_consolidated_state_dict_is_plain_adamw_state_at_world_2() -> None:
    assert run_ranks(2, _export_after_training, timeout=90) == [[True, True, True]] * 2


# ---- torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict -----------------
def _fxzero(model: torch.nn.Module) -> fxzero.DistributedOptimizer:
    return fxzero.DistributedOptimizer(_groups(model), torch.optim.AdamW, lr=0.05, module=model,
                                       config=fxzero.Config(bucket_size=64))  # fmt: skip


def _reference(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Plain AdamW, under DDP when ranks run (every rank sees the same batches, so the same numbers)."""
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    return wrapped, torch.optim.AdamW(_groups(model), lr=0.05)


def _torch_api_state(full: bool) -> tuple[bool, bool, int]:
    """get_optimizer_state_dict of fxzero and of AdamW (DDP) after the same steps; opt.state's size."""
    model, (ref, ref_opt) = _model(), _reference(_model())
    opt = _fxzero(model)
    _train(model, opt, range(STEPS))
    _train(ref, ref_opt, range(STEPS))
    options = StateDictOptions(full_state_dict=full)
    got = get_optimizer_state_dict(model, opt, options=options)
    return (*_same_state(got, get_optimizer_state_dict(ref, ref_opt, options=options)), len(opt.state))


@pytest.mark.parametrize("full", [True, False], ids=["full_state_dict", "dcp_default"])
def test_get_optimizer_state_dict_is_adamws_at_world_1(full: bool) -> None:
    assert _torch_api_state(full) == (True, True, 4)  # and torch's zero-lr step was not taken (equal `step`s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("full", [True, False], ids=["full_state_dict", "dcp_default"])
def test_get_optimizer_state_dict_is_ddp_adamws_at_world_2(full: bool) -> None:
    # the default (DCP) options return the whole state too: DCP saves plain tensors once, as replicated
    assert run_ranks(2, _torch_api_state, full, timeout=90) == [(True, True, 4)] * 2


def _torch_api_resume(full: bool) -> bool:
    """fxzero -> get_optimizer_state_dict -> a new fxzero via set_optimizer_state_dict: trains on bitwise."""
    weights, _, expected = _plain_run()
    model = _model()
    opt = _fxzero(model)
    _train(model, opt, range(STEPS))
    options = StateDictOptions(full_state_dict=full)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    model = _model()
    model.load_state_dict(weights)
    opt = _fxzero(model)
    opt.load_state_dict(_plain_run()[1])  # an optimizer with state already: torch takes no zero-lr step
    set_optimizer_state_dict(model, opt, saved, options=options)
    _train(model, opt, range(STEPS, 2 * STEPS))
    opt.finish_param_sync()
    return all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("full", [True, False], ids=["full_state_dict", "dcp_default"])
def test_set_optimizer_state_dict_resumes_bitwise(full: bool) -> None:
    assert _torch_api_resume(full)
    assert run_ranks(2, _torch_api_resume, full, timeout=90) == [True, True]


def _fresh_get_and_set() -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """A fresh optimizer: torch takes its zero-gradient, zero-lr step on both; the states agree."""
    model, (ref, ref_opt) = _model(), _reference(_model())
    opt = _fxzero(model)
    options = StateDictOptions(full_state_dict=True)
    got = get_optimizer_state_dict(model, opt, options=options)
    same = _same_state(got, get_optimizer_state_dict(ref, ref_opt, options=options))
    fresh, (fresh_ref, fresh_ref_opt) = _model(), _reference(_model())
    loaded = _fxzero(fresh)
    set_optimizer_state_dict(fresh, loaded, got, options=options)  # a fresh one loads it, as plain AdamW does
    set_optimizer_state_dict(fresh_ref, fresh_ref_opt, got, options=options)
    want = get_optimizer_state_dict(fresh_ref, fresh_ref_opt, options=options)
    return same, _same_state(get_optimizer_state_dict(fresh, loaded, options=options), want)


def test_a_fresh_optimizer_gets_the_state_adamw_gets() -> None:
    assert _fresh_get_and_set() == ((True, True), (True, True))


def _one_element_rank_state() -> tuple[int, bool, list[str]]:
    """One 2-element param: rank 1's shard is all padding and it holds no state, yet opt.state
    has the same keys on both ranks, so both skip (or both take) torch's collective zero-lr step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, module=model)
    model(torch.ones(3, 2)).sum().backward()
    opt.step()
    got = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return len(opt.state), int(got["state"]["weight"]["step"]) == 1, sorted(opt.state[model.weight])


@pytest.mark.timeout(120)
def test_opt_state_has_the_same_keys_on_every_rank_and_this_ranks_piece_of_each() -> None:
    assert run_ranks(2, _one_element_rank_state, timeout=90) == [(1, True, ["exp_avg", "exp_avg_sq", "step"]), (1, True, [])]


def _rank_0_alone_saves() -> tuple[str, bytes]:
    """The DDP habit, ``if rank == 0: torch.save(opt.state_dict(), f)``, then the collective call."""
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, config=fxzero.Config(state_dict_timeout=1.0))
    _train(model, opt, range(STEPS))
    error = ""
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError) as caught, mock.patch.object(sharded_state, "STATE_DICT_WARNING", 0.3), \
                warnings.catch_warnings(record=True) as warned:  # fmt: skip
            warnings.simplefilter("always")
            opt.state_dict()
        error = str(caught.value)
        assert any("has waited 0.3 s for rank(s) [1] of 2" in str(w.message) for w in warned), [str(w.message) for w in warned]
    dist.barrier()
    buffer = io.BytesIO()
    state = opt.state_dict()  # every rank: the timed-out call was taken back, so this one meets
    if dist.get_rank() == 0:
        torch.save(state, buffer)
    return error, buffer.getvalue()


@pytest.mark.timeout(120)
def test_state_dict_on_rank_0_alone_fails_naming_the_fix_and_every_ranks_call_gives_the_whole_state() -> None:
    """No path saves one rank's shard as if it were the optimizer's state."""
    (error, saved), _ = run_ranks(2, _rank_0_alone_saves, timeout=90)
    assert "rank(s) [1] of 2 did not call it within 1 s" in error and "consolidate_state_dict()" in error
    assert "callbacks=[fxzero.hugging_face.CheckpointCallback()]" in error
    assert "`state = opt.state_dict()` before `if rank == 0: torch.save(state, ...)`" in error
    whole = torch.load(io.BytesIO(saved), weights_only=True)
    model = _model()
    reference = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, reference, range(STEPS))
    want = reference.state_dict()
    assert _same_state(whole, want) == (True, True)


def _state_dict_hook_calls(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple]:
    """What the four state-dict hooks see through ``state_dict``/``load_state_dict`` and through
    ``get/set_optimizer_state_dict``: the optimizer, a post-hook's replacement, a pre-hook's edit."""
    calls: list[tuple] = []

    def load_pre(o: torch.optim.Optimizer, state: dict) -> None:
        calls.append(("load pre", o is opt, state.pop("note", None)))  # edits torch's shallow copy

    opt.register_state_dict_pre_hook(lambda o: calls.append(("save pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, state: {**state, "note": "from the post-hook"})
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt)))
    _train(model, opt, range(STEPS))
    state = opt.state_dict()
    calls.append(("saved", state["note"]))
    opt.load_state_dict(state)
    calls.append(("kept", state["note"]))  # the caller's dict is not edited
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt, options=options), options=options)
    return calls


def test_state_dict_hooks_run_as_in_torch_optim_directly_and_through_dcp() -> None:
    """torch.optim runs hooks registered with register_(load_)state_dict_{pre,post}_hook inside
    its (load_)state_dict; fxzero overrides both, and ran none of them."""
    model, ref = _model(), _model()
    want = _state_dict_hook_calls(ref, torch.optim.AdamW(_groups(ref), lr=0.05))
    assert want[:5] == [("save pre", True), ("saved", "from the post-hook"), ("load pre", True, "from the post-hook"),
                        ("load post", True), ("kept", "from the post-hook")]  # fmt: skip
    assert _state_dict_hook_calls(model, _fxzero(model)) == want


def test_the_whole_state_dict_carries_the_fp32_masters_of_bf16_params_and_resumes_bitwise() -> None:
    """Without them a resume would restart the masters from the rounded bf16 params."""

    def build() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
        model = _model().to(torch.bfloat16)
        return model, fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, module=model)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            model(_batch(step).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(STEPS))
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    assert saved["state"][0]["fxzero_master"].dtype == torch.float32
    train(model, opt, range(STEPS, 2 * STEPS))
    resumed, resumed_opt = build()
    resumed.load_state_dict(weights)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, range(STEPS, 2 * STEPS))
    assert all(torch.equal(a.param, b.param) for a, b in zip(opt.runtime.fragments, resumed_opt.runtime.fragments))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_the_defaults_the_readme_states_for_a_state_dict_on_some_ranks_only() -> None:
    assert fxzero.Config().state_dict_timeout == 120.0 and sharded_state.STATE_DICT_WARNING == 10.0


def test_a_consolidated_state_is_dropped_at_the_next_step() -> None:
    """``consolidate_state_dict`` keeps the whole state for the next ``state_dict()``, not for one after a step."""
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, module=model)
    _train(model, opt, range(1))
    opt.consolidate_state_dict()
    opt.param_groups[0]["lr"] = 0.01  # a scheduler between the gather and the save
    assert int(opt.state_dict()["state"][0]["step"]) == 1 and opt.state_dict()["param_groups"][0]["lr"] == 0.01
    _train(model, opt, range(1, 2))
    assert int(opt.state_dict()["state"][0]["step"]) == 2
