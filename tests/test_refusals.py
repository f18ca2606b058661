"""Bad state never gets in, and every refusal names what it refuses (issue 56).

* ``load_state_dict`` checks everything it is given before it changes anything: a moment saved
  transposed (same number of elements), another class's state, a missing key, a wrong size, a
  negative step, a damaged fxzero-format shard. Each refusal names the param, the key and both
  shapes, and the optimizer then trains on bitwise like one never given the bad state; what
  torch.optim accepts (an AdamW state into SGD) is accepted.
* Messages that named the wrong fix: ``p.data = t`` under ``overlap_param_gather``, a late
  gradient with two optimizers, ``module=DDP(model)``, a graph compiled before its optimizer,
  ``opt.state_dict()`` on rank 0 alone.

World 1 against plain torch.optim in the same process; the multi-rank cases in one world-2 run.
"""

from __future__ import annotations

import copy
import datetime
import logging
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.gradients.ledger import LateGradient
from fxzero.optim.state import sharded_state
from fxzero.testing import run_ranks

STEPS = 2


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _batch(step: int) -> torch.Tensor:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    whole = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
    return whole[4 * rank : 4 * (rank + 1)]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _fxzero(cls: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: Any) -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), cls, module=model, lr=0.01, **kwargs)
    return model, opt


def _adamw_state() -> dict[str, Any]:
    """A plain torch.optim AdamW state dict of the same model after a few steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, range(STEPS))
    return copy.deepcopy(opt.state_dict())


def _sgd_state() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, range(STEPS))
    return copy.deepcopy(opt.state_dict())


def _transposed(state: dict[str, Any]) -> None:
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].t().contiguous()  # 0.weight is 16x8


def _missing(state: dict[str, Any]) -> None:
    del state["state"][1]["exp_avg_sq"]


def _wrong_size(state: dict[str, Any]) -> None:
    state["state"][2]["exp_avg"] = torch.zeros(5)


def _negative_step(state: dict[str, Any]) -> None:
    state["state"][3]["step"] = torch.tensor(-1.0)


def _bad_master(state: dict[str, Any]) -> None:
    state["state"][2]["fxzero_master"] = torch.zeros(16, 8)  # 2.weight is 8x16


_BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "transposed": (_transposed, r"param '0\.weight': state 'exp_avg' has shape \(8, 16\), the param \(16, 8\) \(the same number of elements"),
    "missing key": (_missing, r"param '0\.bias': AdamW cannot step from the given state \(KeyError: 'exp_avg_sq'\): it has keys \['exp_avg', 'step'\]"),
    "wrong size": (_wrong_size, r"param '2\.weight': state 'exp_avg' has shape \(5\), the param \(8, 16\)"),
    "negative step": (_negative_step, r"param '2\.bias': state 'step' is -1\.0, not a step count"),
    "fp32 master": (_bad_master, r"param '2\.weight': state 'fxzero_master' has shape \(16, 8\), the param \(8, 16\)"),
}


def _trains_on_like_one_never_given(load: Callable[[fxzero.DistributedOptimizer], None], match: str) -> None:
    """Train, refuse ``load`` (raising ``match``), train on: bitwise the run that never tried."""
    model, opt = _fxzero()
    clean_model, clean = _fxzero()
    _train(model, opt, range(STEPS))
    _train(clean_model, clean, range(STEPS))
    with pytest.raises(ValueError, match=match):
        load(opt)
    _train(model, opt, range(STEPS, 2 * STEPS))
    _train(clean_model, clean, range(STEPS, 2 * STEPS))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clean_model.parameters()))
    got, want = opt.state_dict()["state"], clean.state_dict()["state"]
    assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])


@pytest.mark.parametrize("case", sorted(_BAD))
def test_a_damaged_plain_state_is_refused_naming_param_key_and_shapes_and_changes_nothing(case: str) -> None:
    damage, match = _BAD[case]
    state = _adamw_state()
    damage(state)
    _trains_on_like_one_never_given(lambda opt: opt.load_state_dict(state), match)


def test_another_classes_state_is_refused_naming_what_differs() -> None:
    """An SGD(momentum) state dict into AdamW raised a bare KeyError: 'step' and left the optimizer broken."""
    state = _sgd_state()
    match = r"AdamW cannot step with the saved param group 0's hyperparameters \(KeyError: 'betas'\): they lack \[.*'betas'.*\] and have \['dampening', 'momentum', 'nesterov'\]"
    _trains_on_like_one_never_given(lambda opt: opt.load_state_dict(state), match)
    state["param_groups"] = _adamw_state()["param_groups"]  # AdamW's groups, SGD's per-param state
    _trains_on_like_one_never_given(lambda opt: opt.load_state_dict(state), r"param '0\.weight': AdamW cannot step from the given state .*momentum_buffer")


def test_a_damaged_rank_state_dict_is_refused_too() -> None:
    """fxzero's own per-rank format: the wrapped optimizer's state against this rank's fragments."""
    model, opt = _fxzero()
    _train(model, opt, range(STEPS))
    saved = copy.deepcopy(opt.rank_state_dict())
    first = min(saved["local"]["state"])
    numel = saved["local"]["state"][first]["exp_avg"].numel()
    saved["local"]["state"][first]["exp_avg"] = saved["local"]["state"][first]["exp_avg"].reshape(2, -1)
    match = rf"\(this rank's fragment\): state 'exp_avg' has shape \(2, {numel // 2}\), the param \({numel}\) \(the same number"
    _trains_on_like_one_never_given(lambda o: o.load_state_dict(saved), match)
    saved = copy.deepcopy(opt.rank_state_dict())
    saved["main_shards"] = [torch.zeros(3)]
    _trains_on_like_one_never_given(lambda o: o.load_state_dict(saved), r"the state dict holds 1 fp32 main shards, this rank keeps 0")


def test_what_torch_optim_accepts_is_accepted() -> None:
    """AdamW's per-param state under SGD's groups: torch.optim SGD keeps the keys it does not
    know and starts its momentum fresh; so does fxzero, and both train on alike. (With AdamW's
    groups too, torch.optim fails at its next step, KeyError: 'momentum': refused, as above.)"""
    state = _adamw_state()
    state["param_groups"] = torch.optim.SGD(_model().parameters(), lr=0.01, momentum=0.9).state_dict()["param_groups"]
    model, opt = _fxzero(torch.optim.SGD, momentum=0.9)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    opt.load_state_dict(state)
    ref_opt.load_state_dict(copy.deepcopy(state))
    _train(model, opt, range(STEPS))
    _train(reference, ref_opt, range(STEPS))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    model, opt = _fxzero()
    opt.load_state_dict(_adamw_state())  # the clean state itself


class _TiedConvNet(torch.nn.Module):
    """A conv net with an embedding tied to its output layer (as language models tie theirs), dropout on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 6)
        self.conv = torch.nn.Conv1d(6, 6, kernel_size=3, padding=1)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.conv(self.embed(tokens).transpose(1, 2)))).transpose(1, 2)
        return self.head(h)


def _tied_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two steps of torch.optim AdamW on the tied conv net."""
    model = _TiedConvNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _tied_steps(model, opt)
    return model, opt


def _tied_steps(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The same batches and dropout masks for every run."""
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        tokens = torch.randint(0, 10, (3, 5))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()


def test_a_conv_net_with_tied_weights_loads_its_torch_optim_state_and_refuses_a_permuted_conv_moment() -> None:
    """The tied weight is one param with one state; a conv moment permuted (same number of elements)
    is refused naming it, and the optimizer then trains on bitwise like torch.optim from the good state."""
    reference, ref_opt = _tied_run()  # torch.optim: two steps, then two more from where they left off
    state, weights = copy.deepcopy(ref_opt.state_dict()), copy.deepcopy(reference.state_dict())
    bad = copy.deepcopy(state)
    conv = [i for i, s in bad["state"].items() if s["exp_avg"].dim() == 3][0]
    bad["state"][conv]["exp_avg"] = bad["state"][conv]["exp_avg"].permute(2, 1, 0).contiguous()
    fresh = _TiedConvNet()
    fresh_opt = fxzero.DistributedOptimizer(fresh.parameters(), torch.optim.AdamW, module=fresh, lr=0.01)
    with pytest.raises(ValueError, match=r"param 'conv\.weight': state 'exp_avg' has shape \(3, 6, 6\), the param \(6, 6, 3\)"):
        fresh_opt.load_state_dict(bad)
    fresh.load_state_dict(weights)
    fresh_opt.load_state_dict(state)  # after the refusal, the good state: as if the bad one was never given
    _tied_steps(fresh, fresh_opt)
    _tied_steps(reference, ref_opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), reference.parameters()))
    assert len(list(fresh.parameters())) == len(state["state"])  # the tied weight counted once


# ---- messages naming the real cause and a fix that works --------------------------------------------
class _ActorCritic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.pi, self.v = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return torch.log_softmax(self.pi(h), -1), self.v(h)


@pytest.mark.slow  # a cold Inductor compile
def test_a_late_gradient_with_two_optimizers_names_the_optimizer_and_the_param_by_module_path() -> None:
    """A2C with an actor and a critic optimizer (the critic's built without module=), compiled,
    only the actor's in no_sync(): the critic's param got a gradient from both backwards. The
    message said "param params[0]" and named no_sync(), which the user had applied."""
    torch.compiler.reset()
    model = _ActorCritic()
    actor = fxzero.DistributedOptimizer([*model.body.parameters(), *model.pi.parameters()], torch.optim.Adam, lr=1e-2, module=model)
    critic = fxzero.DistributedOptimizer(model.v.parameters(), torch.optim.Adam, lr=1e-2)
    forward = torch.compile(model, backend="fxzero")  # Inductor, the default inner compiler
    x, reward = torch.randn(5, 6), torch.randn(5, 1)
    with pytest.raises(LateGradient) as caught:
        for _ in range(2):  # the first compiled step learns the counts
            logp, value = forward(x)
            with actor.no_sync():
                (-(logp[:, 0] * (reward - value).squeeze(1))).mean().backward(retain_graph=True)
            (reward - value).pow(2).mean().backward()
            actor.step(), critic.step()
    message = str(caught.value)
    assert message.startswith("fxzero: param 'v.") and "of the DistributedOptimizer over v.weight, v.bias (2 params)" in message
    assert "`with opt_a.no_sync(), opt_b.no_sync():`" in message and "detach" in message


def test_a_graph_compiled_before_its_optimizer_warns_with_the_fix() -> None:
    torch.compiler.reset()
    model = _model()
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    with pytest.warns(UserWarning, match=r"at this compile.*call torch\.compiler\.reset\(\) after building it") as warned:
        cmodel(_batch(0)).sum().backward()
    assert not any("trains as plain torch.compile (gradients" in str(w.message).split("A model no")[0] for w in warned)


# ---- world 2: overlap, DDP, rank 0 alone --------------------------------------------------------------
def _overlap(write: str) -> Any:
    """``p.data = t`` with a same-shaped tensor under overlap_param_gather: before
    ``finish_param_sync()`` refused naming it and ``copy_``; after it taken in, as torch.optim
    goes on from whatever ``p.data`` holds (DDP's params: the same write on every rank)."""
    model, opt = _fxzero(config=fxzero.Config(overlap_param_gather=True, bucket_size=64))
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    _train(model, opt, range(STEPS))
    _train(ddp, ref_opt, range(STEPS))
    if write == "before":
        model[0].weight.data = torch.full_like(model[0].weight, 0.5)
        try:
            _train(model, opt, range(STEPS, STEPS + 1))
        except RuntimeError as error:
            return str(error)
        return "no error"
    opt.finish_param_sync()
    for m in (model, reference):
        m[0].weight.data = torch.full_like(m[0].weight, 0.5)
    _train(model, opt, range(STEPS, 2 * STEPS))
    _train(ddp, ref_opt, range(STEPS, 2 * STEPS))
    opt.finish_param_sync()
    return all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))


def _ddp_module() -> str:
    model = _model()
    try:
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, module=torch.nn.parallel.DistributedDataParallel(model))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _rank_0_alone() -> dict[str, Any]:
    """``if rank == 0: opt.state_dict()`` while rank 1 trains on: rank 0 warns once and fails
    naming the fix; rank 1 fails with that message, not gloo's "Connection closed by peer".
    A group of its own, so its end (rank 0 leaving) does not end the harness's world group."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    model = _model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, process_group=group,
                                      config=fxzero.Config(state_dict_timeout=1.0))  # fmt: skip
    _train(model, opt, range(STEPS))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("fxzero").addHandler(handler)
    out: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if dist.get_rank() == 0:
                sharded_state.STATE_DICT_WARNING = 0.3
                try:
                    opt.state_dict()
                except RuntimeError as error:
                    out["error"] = str(error)
                dist.destroy_process_group(group)  # what rank 0's exit does to rank 1's connections
            else:
                try:
                    _train(model, opt, range(STEPS, 2 * STEPS))
                except RuntimeError as error:
                    out["error"] = str(error)
        out["warnings"] = [str(w.message) for w in warned if "has waited" in str(w.message)]
        out["records"] = [r.getMessage() for r in records if "has waited" in r.getMessage()]
    finally:
        sharded_state.STATE_DICT_WARNING = 10.0
        logging.getLogger("fxzero").removeHandler(handler)
    return out


def _overlap_both() -> dict[str, Any]:
    return {"before": _overlap("before"), "after": _overlap("after")}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_param_data_replaced_under_overlap_is_taken_after_finish_param_sync_and_refused_before_naming_it() -> None:
    """It raised even after finish_param_sync(), saying "move and cast the model first"."""
    for rank in run_ranks(2, _overlap_both, timeout=120):
        assert "replaced by a tensor holding other values" in rank["before"] and "finish_param_sync() first" in rank["before"]
        assert "param.data.copy_(t)" in rank["before"] and "Move and cast" not in rank["before"]
        assert rank["after"] is True


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_module_given_as_a_ddp_wrapper_is_refused_at_construction_with_the_ddp_sentence() -> None:
    """It failed at backward with an aten.copy_ message that never mentioned DDP."""
    for message in run_ranks(2, _ddp_module, timeout=120):
        assert "module= is a torch.nn.parallel.DistributedDataParallel wrapper" in message and "module=model" in message


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_state_dict_on_rank_0_alone_warns_once_and_the_other_ranks_fail_with_its_fix() -> None:
    """It logged its warning twice, and the other ranks died with gloo's "Connection closed by peer"."""
    rank_0, rank_1 = run_ranks(2, _rank_0_alone, timeout=120)
    assert "rank(s) [1] of 2 did not call it within 1 s" in rank_0["error"]
    assert len(rank_0["warnings"]) == 1 and rank_0["records"] == [], rank_0
    assert rank_1["error"].startswith("fxzero: rank 1 of 2 failed waiting for the gradient reduction"), rank_1["error"]
    assert "rank 0 stopped first, with this error: fxzero: opt.state_dict() on rank 0" in rank_1["error"]
    assert "`state = opt.state_dict()` before `if rank == 0: torch.save(state, ...)`" in rank_1["error"]
