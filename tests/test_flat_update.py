"""The flat update (:mod:`fxzero.optim.update.flat_update`): runs of adjacent fragments step as one
tensor, with the bits the fragment-by-fragment update gives, and fall back to it exactly.

The model's params are multiples of 64 elements, so no alignment padding splits them and
every group's fragments form one run per bucket; each case compares with plain
``torch.optim`` over the model's own params, bitwise, params and state alike."""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Iterator
from unittest import mock

import pytest
import torch

import fxzero
from fxzero.optim.update.flat_update import Place, Run, flat_update_applies, plan_runs
from fxzero.optim.layout.shards import FragmentTensor
from fxzero.optim.layout.validation import ELEMENTWISE_OPTIMIZERS

from models import build, param_groups, runs_from_initial_state, train_steps

STEPS = 5


# ---- plans, without tensors ----------------------------------------------------------
def _place(offset: int, numel: int, *, storage: int = 0, group: int = 0, bucket: int = 0, grad_offset: int | None = None) -> Place:
    return Place(storage, 100 + storage, group, bucket, offset, offset if grad_offset is None else grad_offset, numel)


def test_adjacent_fragments_of_one_group_form_one_run_in_memory_order() -> None:
    places = [_place(64, 64), _place(0, 64), _place(128, 8)]
    assert plan_runs(places) == (Run((1, 0, 2), 0, 0, 0, 136, 0),)


def test_padding_another_group_storage_or_bucket_ends_a_run() -> None:
    gap = [_place(0, 13), _place(16, 13)]
    assert [r.fragments for r in plan_runs(gap)] == [(0,), (1,)]
    groups = [_place(0, 64, group=0), _place(64, 64, group=1)]
    assert [(r.fragments, r.group) for r in plan_runs(groups)] == [((0,), 0), ((1,), 1)]
    storages = [_place(0, 64, storage=0), _place(64, 64, storage=1)]
    assert len(plan_runs(storages)) == 2
    buckets = [_place(0, 64, bucket=1), _place(64, 64, bucket=0)]  # world 1: one bucket's shard ends where the next begins
    assert [(r.fragments, r.bucket) for r in plan_runs(buckets)] == [((0,), 1), ((1,), 0)]


def test_a_run_stops_growing_at_its_length_limit_and_a_longer_fragment_is_a_run_alone() -> None:
    places = [_place(0, 40), _place(40, 40), _place(80, 40), _place(120, 200), _place(320, 10)]
    assert [r.fragments for r in plan_runs(places, max_numel=100)] == [(0, 1), (2,), (3,), (4,)]


def test_grads_that_are_not_adjacent_like_the_params_end_a_run() -> None:
    assert len(plan_runs([_place(0, 64, grad_offset=0), _place(64, 64, grad_offset=80)])) == 2
    assert plan_runs([_place(0, 64, grad_offset=10), _place(64, 64, grad_offset=74)]) == (Run((0, 1), 0, 0, 0, 128, 10),)


# ---- steps against plain torch.optim -------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.tanh(self.fc1(x))))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(step))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, skip: frozenset[int] = frozenset()) -> None:
    """``skip``: steps in which ``fc2.bias`` gets no gradient."""
    for step in steps:
        loss = model(_batch(step)).square().mean()
        loss.backward()
        if step in skip:
            model.fc2.bias.grad = None
        opt.step()
        opt.zero_grad()


def _same(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine.keys() == theirs.keys(), name
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine[key], value.reshape(-1) if value.dim() else value), f"{name} {key}"
            else:
                assert mine[key] == value, f"{name} {key}"


def _pair(cls: type, kwargs: dict) -> tuple:
    model, ref = _Model(), _Model()
    opt = fxzero.DistributedOptimizer(model.parameters(), cls, **copy.deepcopy(kwargs))
    return model, opt, ref, cls(ref.parameters(), **copy.deepcopy(kwargs))


_KWARGS = {torch.optim.SGD: {"lr": 0.1, "momentum": 0.9}, torch.optim.ASGD: {"lr": 0.1}, torch.optim.Adadelta: {"lr": 1.0}}
_NO_DECAY = (torch.optim.Rprop,)


@pytest.mark.parametrize("foreach", [False, True], ids=["single_tensor", "foreach"])
@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_elementwise_class_steps_flat_with_the_bits_of_plain_torch_optim(cls: type, foreach: bool) -> None:
    decay = {} if cls in _NO_DECAY else {"weight_decay": 0.01}
    model, opt, ref, ref_opt = _pair(cls, _KWARGS.get(cls, {"lr": 1e-2}) | {"foreach": foreach} | decay)
    assert len(opt.runtime.update.runs) == 1 < len(opt.runtime.fragments)  # one bucket, no padding between the params
    built_with_state = bool(ref_opt.state)  # Adagrad's: the others create it at their first update, fragment by fragment
    _train(model, opt, range(STEPS))
    _train(ref, ref_opt, range(STEPS))
    assert opt.runtime.update.flat_steps == STEPS - (not built_with_state)
    _same(model, opt, ref, ref_opt)


def test_state_tensors_are_replaced_once_at_the_second_update_then_updated_in_place() -> None:
    model, opt, *_ = _pair(torch.optim.AdamW, {"lr": 1e-2})
    held = []
    for step in range(4):
        _train(model, opt, range(step, step + 1))
        held.append({k: v for k, v in opt.state[model.fc1.weight].items()})
    assert all(held[0][k] is not held[1][k] for k in held[0])  # homed at the second update
    assert all(held[1][k] is held[3][k] for k in held[1])  # the same tensors from then on
    assert not torch.equal(held[1]["exp_avg"], held[0]["exp_avg"])  # the first step's tensors no longer move


def test_a_step_that_skips_a_param_goes_fragment_by_fragment_from_then_on_exactly() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    _train(model, opt, range(6), skip=frozenset({2}))
    _train(ref, ref_opt, range(6), skip=frozenset({2}))
    assert opt.runtime.update.flat_steps == 1  # step 1; step 2 hid fc2.bias, whose step count then lags its run's
    _same(model, opt, ref, ref_opt)


def test_loaded_state_is_homed_again_and_steps_on_exactly() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.Adam, {"lr": 1e-2, "amsgrad": True})
    _train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt.runtime.update.flat_steps == 2
    opt.param_groups[0]["lr"] = 3e-3  # the wrapped optimizer's load replaced its group dicts: it must still arrive
    _train(model, opt, range(3, 6))
    assert opt.runtime.update.flat_steps == 5  # homed again at once: the loaded state is the same in every run
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):  # views of one tensor per key (steps: one vector)
        assert len({opt.state[p][key].untyped_storage().data_ptr() for p in model.parameters()}) == 1, key
    _train(ref, ref_opt, range(3))
    ref_opt.param_groups[0]["lr"] = 3e-3
    _train(ref, ref_opt, range(3, 6))
    _same(model, opt, ref, ref_opt)


def test_a_state_tensor_replaced_by_hand_ends_the_homing_and_is_used() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.AdamW, {"lr": 1e-2})
    _train(model, opt, range(2))
    _train(ref, ref_opt, range(2))
    for p, q in zip(model.parameters(), ref.parameters()):
        opt.state[p]["exp_avg"] = torch.full_like(opt.state[p]["exp_avg"], 0.5)
        ref_opt.state[q]["exp_avg"] = torch.full_like(ref_opt.state[q]["exp_avg"], 0.5)
    _train(model, opt, range(2, 4))
    _train(ref, ref_opt, range(2, 4))
    assert opt.runtime.update.flat_steps == 3  # steps 1, 2 (homing the replaced moments again first) and 3
    _same(model, opt, ref, ref_opt)


def test_a_step_count_edited_in_place_is_used_as_torch_optim_would() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.AdamW, {"lr": 1e-2})
    _train(model, opt, range(3))
    _train(ref, ref_opt, range(3))
    opt.state[model.fc1.weight]["step"].fill_(10.0)
    ref_opt.state[ref.fc1.weight]["step"].fill_(10.0)
    _train(model, opt, range(3, 5))
    _train(ref, ref_opt, range(3, 5))
    assert opt.runtime.update.flat_steps == 2  # steps 1 and 2; then the run's step counts differ
    _same(model, opt, ref, ref_opt)


def test_an_lr_schedulers_values_reach_the_flat_update() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.AdamW, {"lr": 1e-2})
    for o, m in ((opt, model), (ref_opt, ref)):
        scheduler = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        for step in range(4):
            _train(m, o, range(step, step + 1))
            scheduler.step()
    assert opt.runtime.update.flat_steps == 3
    _same(model, opt, ref, ref_opt)


def test_a_group_switched_to_fused_steps_fragment_by_fragment_from_then_on() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.Adam, {"lr": 1e-2})
    _train(model, opt, range(2))
    _train(ref, ref_opt, range(2))
    opt.param_groups[0]["fused"] = ref_opt.param_groups[0]["fused"] = True
    _train(model, opt, range(2, 4))
    _train(ref, ref_opt, range(2, 4))
    assert opt.runtime.update.flat_steps == 1
    _same(model, opt, ref, ref_opt)


def test_fused_steps_and_unknown_classes_stay_fragment_by_fragment() -> None:
    model, opt, ref, ref_opt = _pair(torch.optim.Adam, {"lr": 1e-2, "fused": True})
    _train(model, opt, range(3))
    _train(ref, ref_opt, range(3))
    assert opt.runtime.update.flat_steps == 0
    _same(model, opt, ref, ref_opt)

    class Mine(torch.optim.SGD):  # a subclass's step may read shapes: never flat
        pass

    opt = fxzero.DistributedOptimizer(_Model().parameters(), Mine, lr=0.1, config=fxzero.Config(state_sharding="elementwise"))
    assert opt.runtime.update.twin is None


def test_the_flat_update_applies_to_known_elementwise_classes_over_1d_fp32_cpu_fragments() -> None:
    def frags(*tensors: torch.Tensor) -> list[FragmentTensor]:
        return [FragmentTensor(0, t, t, None) for t in tensors]  # type: ignore[arg-type]

    assert flat_update_applies(torch.optim.AdamW, frags(torch.zeros(4), torch.zeros(8)))
    assert not flat_update_applies(torch.optim.AdamW, frags(torch.zeros(4), torch.zeros(4, device="meta")))  # bitwise checked on the CPU only
    assert not flat_update_applies(torch.optim.AdamW, frags(torch.zeros(4, dtype=torch.float64)))
    assert not flat_update_applies(torch.optim.AdamW, frags(torch.zeros(2, 2)))  # a whole-param plan's shaped tensors
    assert not flat_update_applies(torch.optim.Adafactor, frags(torch.zeros(4)))
    assert not flat_update_applies(torch.optim.AdamW, [])


# ---- through the fxzero backend under Inductor --------------------------------------------
_FLAT_STEPS = {"gpt": STEPS - 1}
"""A tied head. A step that hides params (experts picked in Python, whose router gets no
gradient through its argmax) steps fragment by fragment whatever the inner compiler, as
``test_a_step_that_skips_a_param_goes_fragment_by_fragment_from_then_on_exactly`` checks (an
Inductor case of it cost 6 s of a cold suite). A conv net's flat
update under Inductor is the zoo's ResNet (``test_zoo.py``: SGD with momentum, world 2, overlap
on and off bitwise, against eager); a conv net here took 16 s of cold compile."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """As in the rank processes: with two threads, this machine's Inductor/BLAS kernels differed
    in the last bit between two identical runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # 31 s of cold Inductor in the development tier, whose first compile pays Inductor's warm-up
@pytest.mark.parametrize("name", list(_FLAT_STEPS))
def test_under_inductor_the_flat_update_trains_bitwise_like_the_fragment_by_fragment_one(name: str, one_thread: None) -> None:
    """One compiled model (Inductor), two runs from the same initial state through the same
    generated code: AdamW in two param groups stepping flat, and fragment by fragment (as on a GPU)."""
    torch.compiler.reset()
    model = build(name)
    cmodel = torch.compile(model, backend="fxzero", dynamic=False)

    def train(flat: bool) -> tuple[list[float], list[torch.Tensor], int]:
        with contextlib.nullcontext() if flat else mock.patch("fxzero.optim.update.flat_update.flat_update_applies", return_value=False):
            opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, module=model)
        losses = train_steps(name, cmodel, opt, range(STEPS), 8)
        return losses, [p.detach().clone() for p in model.parameters()], opt.runtime.update.flat_steps

    (flat_losses, flat_params, flat_steps), (losses, params, none) = runs_from_initial_state(model, (True, False), train)
    assert (flat_steps, none) == (_FLAT_STEPS[name], 0)
    assert flat_losses == losses
    assert all(torch.equal(p, q) for p, q in zip(flat_params, params))
