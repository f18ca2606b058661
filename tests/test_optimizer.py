"""DistributedOptimizer behaviour: bad input, skipping, schedulers, state, allocation."""

from __future__ import annotations

import contextlib
from typing import Any
import copy
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fxzero
from fxzero.testing import run_ranks

from models import batch, build, loss_fn, param_groups, train_steps


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ---- bad input -------------------------------------------------------------------
def test_param_in_two_optimizers_is_an_error() -> None:
    model = small_model()
    first = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"param '0\.weight' .* already managed by another"):
        fxzero.DistributedOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
    del first


def test_non_leaf_param_is_an_error() -> None:
    leaf = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .* not a leaf"):
        fxzero.DistributedOptimizer([leaf, leaf * 2], torch.optim.SGD, lr=0.1)


def test_bad_param_is_named_by_module_path_when_module_is_given() -> None:
    """Frozen params are accepted (tests/test_frozen_params.py); a param no optimizer can
    step is refused, named by its module path although params were passed by position."""
    model = small_model()
    model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    with pytest.raises(ValueError, match=r"param 'count' \(shape \(2,\)\) has dtype torch.int64"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)


def test_meta_params_are_refused_naming_the_fix_and_materialized_ones_train() -> None:
    with torch.device("meta"):
        model = small_model()
    with pytest.raises(ValueError, match=r"param '0\.weight' \(shape \(16, 8\)\) is on the meta device.*to_empty"):
        fxzero.DistributedOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, module=model)
    model.to_empty(device="cpu")
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    opt = fxzero.DistributedOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, module=model)
    assert train_step(model, opt, 0) > train_step(model, opt, 0)


def test_unknown_optimizer_kwarg_is_an_error_and_a_group_key_typo_warns() -> None:
    model = small_model()
    with pytest.raises(TypeError, match="AdamW rejected keyword arguments .*'betass'"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, betass=(0.9, 0.9))
    groups = [{"params": list(model.parameters()), "weight_decayy": 0.1}]
    with pytest.warns(UserWarning, match=r"param_groups\[0\] has option 'weight_decayy'.*did you mean 'weight_decay'"):
        fxzero.DistributedOptimizer(groups, torch.optim.AdamW, lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=-1.0)
    with pytest.raises(TypeError, match="optimizer_class"):
        fxzero.DistributedOptimizer(model.parameters(), torch.nn.Linear, lr=0.1)  # type: ignore[arg-type]


def test_group_keys_torch_optim_keeps_are_kept_and_train_like_torch_optim() -> None:
    """timm's ``lr_scale``, a group ``name`` and a scheduler's ``initial_lr``: torch.optim
    keeps them (and ignores them); so does fxzero, in its groups and its state dict."""
    extra = {"lr_scale": 0.5, "name": "decay", "initial_lr": 0.1}
    results = []
    for make in (torch.optim.AdamW, lambda groups, **kw: fxzero.DistributedOptimizer(groups, torch.optim.AdamW, **kw)):
        model = small_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no typo warning for these
            opt = make([{"params": list(model.parameters()), **extra}], lr=0.1)
        assert all(opt.param_groups[0][k] == v for k, v in extra.items())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5, last_epoch=0)  # needs initial_lr
        for _ in range(3):
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        results.append([p.detach().clone() for p in model.parameters()])
        state = opt.state_dict()
        assert state["param_groups"][0]["name"] == "decay"
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_failed_construction_leaves_the_model_untouched() -> None:
    model = small_model()
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, nonsense=1)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)  # still usable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"bucket_size": 0}, "bucket_size"),
        ({"bucket_size": -1}, "bucket_size"),
        ({"bucket_size": "big"}, "bucket_size"),
        ({"clip_grad": 0.0}, "clip_grad"),
        ({"clip_grad": float("inf")}, "clip_grad"),
        ({"grad_dtype": torch.int8}, "grad_dtype"),
        ({"pad_for_high_busbw": 1}, "pad_for_high_busbw"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=f"Config.{field}"):
        fxzero.Config(**kwargs)


@pytest.mark.parametrize("change", ["append-group", "append-param", "remove-param", "swap-param"])
def test_params_put_into_or_taken_out_of_param_groups_fail_the_next_step(change: str) -> None:
    """torch.optim steps whatever param_groups holds; fxzero's buffers are laid out once, so the
    edit silently did nothing (the new param never trained). Replacing a group's list with the
    same params, and editing hyperparameters, stay fine."""
    model, extra = small_model(), torch.nn.Linear(2, 2)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
    opt.param_groups[0]["lr"] = 0.05
    train_step(model, opt, 0)
    params = opt.param_groups[0]["params"]
    {
        "append-group": lambda: opt.param_groups.append({"params": list(extra.parameters()), "lr": 0.1}),
        "append-param": lambda: params.append(extra.weight),
        "remove-param": lambda: params.pop(),
        "swap-param": lambda: params.__setitem__(0, extra.weight),
    }[change]()
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"param_groups changed after construction .*(2 param groups|param_groups\[0\]).*Build a new"):
        opt.step()


def test_add_param_group_after_construction_adds_a_group() -> None:
    """As torch.optim's (state kept, schedulers see it: tests/test_frozen_params.py)."""
    opt = fxzero.DistributedOptimizer(small_model().parameters(), torch.optim.SGD, lr=0.1)
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5] and opt.param_groups[1]["params"] == [extra]
    extra.sum().backward()
    opt.step()
    assert torch.equal(extra.detach(), torch.full((2,), -0.5))


# ---- step semantics (world size 1, no process group) -------------------------------
def test_non_finite_gradient_skips_the_update() -> None:
    model = small_model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 8)).sum().backward()
    model[0].weight.main_grad[0, 0] = float("nan")
    result = opt.step()
    assert result.skipped and result.grad_norm != result.grad_norm
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.runtime.local.state, "a skipped step must not create optimizer state"
    opt.zero_grad()
    train_step(model, opt, 1)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_lr_scheduler_drives_the_sharded_optimizer() -> None:
    model, ref = small_model(), small_model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(3):
        assert train_step(model, opt, step) == train_step(ref, ref_opt, step)
        sched.step()
        ref_sched.step()
    assert opt.runtime.local.param_groups[0]["lr"] == 0.5 * 0.5**2  # synced at the last step
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


class _GroupScaledSGD(torch.optim.SGD):
    """Reads a group key its class has no default for (``scale``), as third-party optimizers may."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * group["scale"])


def test_a_group_key_without_a_default_edited_between_steps_reaches_the_optimizer() -> None:
    """Only the class's defaults were copied to the wrapped optimizer each step: an edited
    group key it reads but has no default for was silently kept at its first value."""
    def train(make: Any) -> torch.Tensor:
        model = small_model()
        opt = make([{"params": model.parameters(), "scale": 1.0}])
        for step in range(3):
            train_step(model, opt, step)
            opt.param_groups[0]["scale"] = 10.0 * (step + 1)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    want = train(lambda groups: _GroupScaledSGD(groups, lr=0.01))
    assert torch.equal(train(lambda groups: fxzero.DistributedOptimizer(groups, _GroupScaledSGD, lr=0.01)), want)


def test_step_hooks_run_once_per_step_with_the_users_optimizer() -> None:
    """As with torch.optim under DDP: a global step hook sees the optimizer the user
    stepped, once; an instance hook of the wrapped class still runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    class HookedSGD(torch.optim.SGD):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.register_step_post_hook(lambda o, a, k: seen.append(("own", type(o).__name__)))

    seen: list[tuple[str, str]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("post", type(o).__name__))),
    ]
    try:
        model = small_model()
        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
        local_pre = opt.register_step_pre_hook(lambda o, a, k: seen.append(("mine", type(o).__name__)))
        for step in range(2):
            train_step(model, opt, step)
        assert seen == [("pre", "DistributedOptimizer"), ("mine", "DistributedOptimizer"), ("post", "DistributedOptimizer")] * 2
        local_pre.remove()
        seen.clear()
        model = small_model()
        train_step(model, fxzero.DistributedOptimizer(model.parameters(), HookedSGD, lr=0.1), 0)
        assert seen[0] == ("pre", "DistributedOptimizer") and seen[-1] == ("post", "DistributedOptimizer")
        assert ("own", "HookedSGD") in seen  # its class's hook: the wrapped optimizer steps through it
    finally:
        for handle in handles:
            handle.remove()


def test_step_with_closure_returns_its_loss() -> None:
    model = small_model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)

    def closure() -> torch.Tensor:
        loss = model(torch.ones(1, 8)).sum()
        loss.backward()
        return loss

    result = opt.step(closure)
    assert isinstance(result, fxzero.StepResult) and not result.skipped and result.loss is not None


def test_second_backward_without_no_sync_is_a_clear_error() -> None:
    model = small_model()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(torch.ones(1, 8)).sum().backward()
    opt.zero_grad()
    train_step(model, opt, 0)  # recovers after zero_grad


def test_state_dict_round_trip_continues_training_exactly() -> None:
    model = build("gpt")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, config=fxzero.Config(bucket_size=3000))

    train_steps("gpt", model, opt, range(3), 4)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    expected = train_steps("gpt", model, opt, range(3, 6), 4)
    resumed = build("gpt", seed=123)
    resumed_opt = fxzero.DistributedOptimizer(
        param_groups(resumed), torch.optim.AdamW, lr=1e-2, config=fxzero.Config(bucket_size=3000)
    )
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    assert train_steps("gpt", resumed, resumed_opt, range(3, 6), 4) == expected
    other = fxzero.DistributedOptimizer(param_groups(build("gpt")), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="bucket layout differs"):
        other.load_state_dict(opt.rank_state_dict())  # one rank's shard only loads into the same layout


def test_bf16_params_keep_fp32_masters() -> None:
    model = small_model().to(torch.bfloat16)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    (shard,) = opt.runtime.shards
    assert shard.main.dtype == torch.float32 and not shard.main_is_param
    assert torch.equal(shard.bucket.param_data, shard.main.to(torch.bfloat16))
    assert not torch.equal(shard.main, shard.main.to(torch.bfloat16).float()), "masters must keep fp32 bits"


# ---- the hot path allocates nothing (world 2) -------------------------------------
_VIEW_OPS = ("aten::slice", "aten::narrow", "aten::as_strided", "aten::view", "aten::select", "aten::chunk")


class _DoneWork:
    def wait(self) -> bool:
        return True


def _no_op_collective(*args: object, **kwargs: object) -> _DoneWork:
    return _DONE


_DONE = _DoneWork()


def _hot_path_allocations(grad_collective: str) -> dict:
    model = build("gpt")
    config = fxzero.Config(bucket_size=4000, grad_collective=grad_collective)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, config=config)
    pointers = lambda: [t.data_ptr() for b in opt.runtime.buckets for t in (*b.grad_shards, *b.param_shards)]  # noqa: E731
    before = pointers()
    x, y = batch("gpt", 0, 4)
    for _ in range(2):
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def comm_path() -> None:
        opt.runtime.reductions.finish()
        opt.runtime.ledger.start_step()
        opt.start_param_sync()
        opt.finish_param_sync()

    # gloo's CPU collectives allocate and slice internally (NCCL's do not); stub them out
    # so that what is measured is fxzero's own launch/wait bookkeeping, at world size 2.
    with mock.patch.object(dist, "reduce_scatter_single", _no_op_collective), mock.patch.object(
        dist, "all_gather_single", _no_op_collective
    ), mock.patch.object(dist, "all_reduce", _no_op_collective), mock.patch.object(
        dist, "all_to_all_single", _no_op_collective
    ), mock.patch.object(dist, "broadcast", _no_op_collective):
        comm_path()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            comm_path()
    events = prof.events()
    return {
        "allocated": sum(max(e.self_cpu_memory_usage, 0) for e in events),
        "view_ops": sorted(e.name for e in events if e.name in _VIEW_OPS),
        "same_views": pointers() == before,
        "buckets": len(opt.runtime.buckets),
    }


@pytest.mark.parametrize("grad_collective", ["reduce_scatter", "all_reduce", "all_to_all"])
def test_communication_path_allocates_and_slices_nothing_and_views_never_move(grad_collective: str) -> None:
    for result in run_ranks(2, _hot_path_allocations, grad_collective):
        assert result["buckets"] >= 3
        assert result["same_views"]
        assert result["view_ops"] == [], result
        assert result["allocated"] == 0, result


def test_a_dropped_optimizer_releases_its_params() -> None:
    import gc

    model, ref = small_model(), small_model()
    first = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    del first
    gc.collect()
    second = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert train_step(model, second, 0) == train_step(ref, ref_opt, 0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q), "stale hooks of the first optimizer double-counted a gradient"


def test_module_orders_the_layout_like_megatron_and_group_order_warns(caplog: pytest.LogCaptureFixture) -> None:
    model = build("gpt")
    names = {id(p): n for n, p in model.named_parameters()}
    with caplog.at_level("WARNING"):
        grouped = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-3)
    assert "Pass module=model" in caplog.text
    del grouped
    model = build("gpt")
    names = {id(p): n for n, p in model.named_parameters()}
    opt = fxzero.DistributedOptimizer(
        param_groups(model), torch.optim.AdamW, lr=1e-3, module=model, config=fxzero.Config(bucket_size=3000)
    )
    first = [names[id(p)] for p in opt.runtime.buckets[0].params]
    last = [names[id(p)] for p in opt.runtime.buckets[-1].params]
    # reverse registration order: the last layers (backward's first grads) fill bucket 0
    assert all(not n.startswith("blocks.0.") for n in first) and "ln_f.weight" in first, first
    assert "wte.weight" in last and all(not n.startswith("blocks.1.") for n in last), last
    with pytest.raises(ValueError, match="module holds none"):
        fxzero.DistributedOptimizer(small_model().parameters(), torch.optim.SGD, lr=0.1, module=model)


# ---- what one step issues ---------------------------------------------------------
def _counted_collectives(config: fxzero.Config) -> dict:
    rank = dist.get_rank()
    model = build("gpt")
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-3, config=config, module=model)
    x, y = batch("gpt", 0, 8)
    for step in range(2):
        loss = loss_fn("gpt", model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
        with profile(activities=[ProfilerActivity.CPU]) if step else contextlib.nullcontext() as prof:
            loss.backward()
            opt.step()  # under the profiler step() also finishes every gather
    counted: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("c10d::") and "barrier" not in event.name:
            op = event.name[len("c10d::") :].strip("_").replace("_base", "")
            counted[op] = counted.get(op, 0) + 1
    return {"counted": counted, "declared": opt.collectives_per_step, "buckets": len(opt.runtime.buckets)}


@pytest.mark.parametrize(
    "config",
    [fxzero.Config(bucket_size=2000), fxzero.Config(bucket_size=2000, grad_collective="all_reduce"), fxzero.Config(bucket_size=2000, mxfp8_param_gather=True)],
    ids=["gloo-default", "all_reduce", "mxfp8"],
)
def test_collectives_per_step_are_what_a_step_issues(config: fxzero.Config) -> None:
    for result in run_ranks(2, _counted_collectives, config):
        assert result["buckets"] >= 2
        assert result["counted"] == result["declared"], result


def _compiled_steps(backend: str) -> list[bool]:
    """fxzero with ``torch.compile``d ``step()`` (torch's "compiling the optimizer" recipe) beside
    DDP with the same recipe on plain AdamW: each step's params, bitwise."""
    rank = dist.get_rank()
    model, ref = small_model(), small_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, config=fxzero.Config(bucket_size=64))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    step, ref_step = torch.compile(opt.step, backend=backend), torch.compile(ref_opt.step, backend=backend)
    same = []
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).square().mean().backward()
        step()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        ref_step()
        ref_opt.zero_grad()
        same.append(all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())))
    return same


@pytest.mark.slow
def test_a_compiled_step_trains_like_ddp_with_a_compiled_adamw_step() -> None:
    """Dynamo traces into step(), breaking the graph where it cannot follow fxzero's
    bookkeeping and host reads, and what it compiles keeps its meaning: the same params as
    DDP + AdamW compiled alike."""
    assert run_ranks(2, _compiled_steps, "aot_eager", timeout=120) == [[True] * 3] * 2
