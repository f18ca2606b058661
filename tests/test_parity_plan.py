"""fxzero.parity's decisions, without ranks: options, batch slices, the optimizer as
data, what makes a model not comparable, tolerances, the ordering of params and the
verdict."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.parity_check import plan, probe
from fxzero.parity_check.plan import OptimizerSpec, ParityError, ParityOptions, Tolerance
from fxzero.parity_check.ranks import ModelSource
from fxzero.parity_check.reference import Trace
from fxzero.parity_check.report import Agreement, ParamResult, ParityReport, Setup, compare_params


# ---- options and batches --------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "parity: world_size must be a whole number >= 1, got 0"),
        ({"steps": 1.5}, "parity: steps must be a whole number >= 1, got 1.5"),
        ({"inner_compiler": "aot_eager"}, "parity: inner_compiler must be 'inductor' or 'eager', got 'aot_eager'"),
        ({"atol_param": -1e-3}, "parity: atol_param must be a finite number >= 0, got -0.001"),
        ({"atol_loss": math.nan}, "parity: atol_loss must be a finite number >= 0, got nan"),
        ({"mxfp8": 1}, "parity: mxfp8 must be a bool, got 1"),
    ],
)
def test_options_name_the_bad_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ParityError, match=f"^{message.replace('(', '.').replace(')', '.')}$"):
        ParityOptions(**kwargs)


def test_bad_bucket_size_is_configs_error() -> None:
    with pytest.raises(ValueError, match="Config.bucket_size must be > 0 elements"):
        ParityOptions(bucket_size=0)


def test_batches_split_along_dim0_into_rank_slices() -> None:
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    slices = plan.split_batch((x, y), 3, step=0)
    assert [s[1].tolist() for s in slices] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(torch.cat([s[0] for s in slices]), x)
    with pytest.raises(ParityError, match=r"batch_fn\(4\)\[1\] has shape \(6,\): its size along dim 0 \(6\) is not divisible"):
        plan.split_batch((torch.zeros(8, 2), y), 4, step=4)


def test_batch_fn_results_are_checked() -> None:
    assert plan.normalize_batch(torch.ones(2), 0)[0].shape == (2,)  # a lone tensor is one argument
    with pytest.raises(ParityError, match=r"batch_fn\(3\) returned str; expected a tuple of tensors"):
        plan.normalize_batch("x", 3)
    keys = plan.batch_keys({"input_ids": 1, "labels": 2})  # a dict: the forward's keyword arguments
    assert plan.normalize_batch({"input_ids": torch.ones(2), "labels": torch.zeros(2)}, 1, keys)[1].sum() == 0
    with pytest.raises(ParityError, match=r"batch_fn\(3\) returned keys \['x'\]; batch_fn\(0\) returned \['input_ids', 'labels'\]"):
        plan.normalize_batch({"x": torch.ones(2)}, 3, keys)
    with pytest.raises(ParityError, match=r"batch_fn\(0\)\[1\] is a 0-dim tensor; every item must be a tensor"):
        plan.normalize_batch((torch.ones(2), torch.tensor(1.0)), 0)
    with pytest.raises(ParityError, match=r"batch_fn\(0\)\[0\] is a int"):
        plan.normalize_batch((3,), 0)


def test_models_and_batches_off_the_cpu_are_refused_naming_the_limit() -> None:
    cpu_only = r"fxzero parity runs its ranks on CPU with gloo \(no NCCL/GPU path yet\)"
    with pytest.raises(ParityError, match=f"model tensor 'weight' is on meta; {cpu_only}"):
        plan.check_model(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ParityError, match=r"batch_fn\(0\)\[0\] is on meta; fxzero parity runs its ranks on CPU"):
        plan.normalize_batch((torch.zeros(2, device="meta"),), 0)
    with pytest.raises(ParityError, match="parity: Linear has no trainable params"):
        plan.check_model(nn.Linear(2, 2).requires_grad_(False))


def test_floor_splits_like_the_ranks_and_still_splits_at_world_one() -> None:
    even, odd = [(torch.zeros(4, 2),)], [(torch.zeros(3, 2),)]
    assert plan.floor_parts(4, even) == 4
    assert plan.floor_parts(1, even) == 2
    assert plan.floor_parts(1, odd) == 1


# ---- the optimizer as data --------------------------------------------------------------
def test_optimizer_spec_keeps_groups_and_drops_keywords_the_class_does_not_take() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 1e-2}], lr=3e-4, betas=(0.8, 0.9)
    )
    spec = OptimizerSpec.of(opt, params)
    assert spec.optimizer_class is torch.optim.AdamW
    assert "decoupled_weight_decay" not in spec.kwargs and spec.kwargs["betas"] == (0.8, 0.9)
    assert [indices for indices, _ in spec.groups] == [(0, 1), (2, 3)]
    rebuilt = spec.param_groups(params)
    assert rebuilt[0]["weight_decay"] == 0.1 and rebuilt[1]["lr"] == 1e-2 and rebuilt[1]["params"][0] is params[2]
    assert spec.describe() == "AdamW (2 param groups, lr 0.0003, 0.01)"
    torch.optim.AdamW(rebuilt, **spec.kwargs)  # what the ranks build it from


def test_optimizer_factory_must_build_a_plain_optimizer_of_the_given_params() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ParityError, match="must return a plain torch.optim optimizer .fxzero wraps it., got str"):
        OptimizerSpec.of("adamw", params)
    wrapped = fxzero.DistributedOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ParityError, match="got DistributedOptimizer"):
        OptimizerSpec.of(wrapped, params)
    stranger = torch.zeros(2, requires_grad=True)
    with pytest.raises(ParityError, match=r"param_groups\[0\] holds a tensor that is not one of the params"):
        OptimizerSpec.of(torch.optim.SGD([stranger], lr=0.1), params)


def _local_model() -> nn.Module:
    class Local(nn.Linear):  # not importable by name in another process
        pass

    return Local(2, 2)


def test_a_model_the_ranks_cannot_import_is_refused_up_front() -> None:
    model = _local_model()
    params = list(model.parameters())
    spec = OptimizerSpec.of(torch.optim.SGD(params, lr=0.1), params)
    with pytest.raises(ParityError, match="cannot be pickled.*Define the model's class at module level"):
        ModelSource.of_model(model, spec)


# ---- what makes a model not comparable -------------------------------------------------------
def test_batchnorm_in_train_mode_is_flagged_and_dropout_is_not() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.1), nn.Dropout(0.0), nn.LazyBatchNorm1d())
    flagged = plan.incomparable_modules(model)
    assert [reason.split(":")[0] for reason in flagged] == ["1 (BatchNorm2d in train mode)", "4 (LazyBatchNorm1d in train mode)"]
    assert all("Fix: check the model with it in eval mode, or GroupNorm / LayerNorm" in reason for reason in flagged)
    assert plan.incomparable_modules(model.eval()) == ()


class _Summed(nn.Module):
    """A loss summed over the batch, and dropout (eval mode for the mixing check)."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.fc, self.drop, self.reduction = nn.Linear(4, 2), nn.Dropout(0.5), reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.drop(self.fc(x)), torch.zeros(x.shape[0], 2), reduction=self.reduction)


def test_random_ops_and_a_summed_loss_are_found_before_training() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    for reduction, mixes in (("mean", False), ("sum", True)):
        model = _Summed(reduction)
        assert probe.has_random_ops(model, (x,), (), None)
        assert probe.has_random_ops(model.eval(), (x,), (), None) is False
        found = probe.batch_mixing(model.train(), (x,), 2, (), None, random=True)
        assert bool(found) == mixes
    assert found[0].startswith("before training (random ops off: eval mode), the loss on the global batch ")
    assert probe.batch_mixing(model, (x,), 1, (), None, random=True) == ()  # no slices, nothing to compare


# ---- tolerances ---------------------------------------------------------------------------
def test_tolerance_is_a_multiple_of_the_floor_above_a_few_ulps_unless_given() -> None:
    assert plan.tolerance(1e-6, 4.0, torch.float32, None, "atol_loss").value == pytest.approx(plan.FLOOR_MULTIPLE * 1e-6)
    zero = plan.tolerance(0.0, 4.0, torch.float32, None, "atol_loss")
    assert zero.value == pytest.approx(8 * torch.finfo(torch.float32).eps * 4.0)
    assert zero.source == "8 x eps(float32) x largest |value| 4"
    assert plan.tolerance(1e-6, 4.0, torch.bfloat16, None, "atol_param").value == pytest.approx(8 * 2**-7 * 4.0)
    given = plan.tolerance(1.0, 4.0, torch.float32, 1e-3, "atol_param")
    assert (given.value, given.source) == (1e-3, "given (atol_param)")


# ---- comparing and judging ---------------------------------------------------------------------
def _trace(ref: list[dict[str, float]], floor: list[dict[str, float]]) -> Trace:
    params = tuple({n: torch.tensor([v]) for n, v in step.items()} for step in ref)
    return Trace((1.0,) * len(ref), (1.0,) * len(ref), params, tuple(floor))


def test_params_over_the_tolerance_come_first_earliest_first() -> None:
    ref = [{"a": 0.0, "b": 0.0, "c": 0.0}] * 3
    fx = [{"a": 0.0, "b": 0.0, "c": 0.5}, {"a": 0.0, "b": 0.2, "c": 0.5}, {"a": 0.01, "b": 0.9, "c": 0.5}]
    trace = _trace(ref, [{"a": 0.0, "b": 0.0, "c": 0.0}] * 3)
    snapshots = [{n: torch.tensor([v]) for n, v in step.items()} for step in fx]
    rows = compare_params(trace, snapshots, {"a": 0, "b": 1}, atol=0.1)
    assert [(r.name, r.first_exceeded, r.bucket) for r in rows] == [("c", 1, None), ("b", 2, 1), ("a", None, 0)]
    assert rows[1].diffs == pytest.approx((0.0, 0.2, 0.9))


def _report(**changes: object) -> ParityReport:
    fields = dict(
        setup=Setup("Net", 1, 4, ParityOptions(), "AdamW (1 param group, lr 0.001)", 1, 2),
        reference_losses=(1.0, 0.9),
        fxzero_losses=(1.0, 0.9),
        floor_losses=(1.0, 0.9),
        params=(ParamResult("w", (2, 2), 0, (0.0, 1e-7), 1e-7, None),),
        loss_tolerance=Tolerance(1e-6, "x"),
        param_tolerance=Tolerance(1e-6, "x"),
        overlap=Agreement(True),
        ranks=Agreement(True),
        not_comparable=(),
        skipped_steps=(),
        seconds=1.0,
    )
    return ParityReport(**{**fields, **changes})


def test_verdicts_and_exit_codes() -> None:
    assert (_report().verdict, _report().exit_code) == ("PASS", 0)
    loss = _report(fxzero_losses=(1.0, 0.95))
    assert (loss.verdict, loss.failures) == ("FAIL", ("loss differs by more than 1e-06 at step(s) 2",))
    param = _report(params=(ParamResult("w", (2, 2), 0, (0.0, 1e-3), 1e-7, 2),))
    assert param.failures == ("1 param(s) differ by more than 1e-06, first 'w' (from step 2)",)
    nan = _report(fxzero_losses=(1.0, math.nan))
    assert nan.verdict == "FAIL"  # NaN is never within a tolerance
    reason = "bn (BatchNorm1d in train mode): per-rank batch statistics"
    bn = _report(not_comparable=(reason,), fxzero_losses=(1.0, 2.0))
    assert (bn.verdict, bn.exit_code) == ("NOT COMPARABLE", 3)
    assert "not comparable: bn (BatchNorm1d in train mode)" in str(bn)
    # fxzero disagreeing with itself is a bug whatever the model
    overlap = _report(not_comparable=bn.not_comparable, overlap=Agreement(False, "rank 1 loss at step 2: 1.0 vs 1.5"))
    assert (overlap.verdict, overlap.exit_code) == ("FAIL", 1)
    assert "overlap on/off not bitwise identical: rank 1 loss at step 2" in str(overlap)
    assert _report(ranks=Agreement(False, "rank 1 param 'w' differs")).verdict == "FAIL"


def test_parity_is_public() -> None:
    assert fxzero.parity.__module__ == "fxzero.parity_check" and "parity" in fxzero.__all__


def test_precision_options_reach_the_ranks_config_and_the_report_gives_their_drift() -> None:
    options = ParityOptions(optimizer_state_dtype="bf16", param_remainders=True)
    config = options.config(overlap=False)
    assert (config.optimizer_state_dtype, config.param_remainders, config.param_rounding) == ("bf16", True, "auto")
    assert options.precision == ("optimizer_state_dtype='bf16'", "param_remainders=True")
    assert ParityOptions().precision == ()
    with pytest.raises(ParityError, match="optimizer_state_dtype must be"):
        ParityOptions(optimizer_state_dtype="int8")  # type: ignore[arg-type]
    setup = Setup("Net", 1, 4, options, "AdamW (1 param group, lr 0.001)", 1, 2)
    text = str(_report(setup=setup, fxzero_losses=(1.0, 0.9 + 4e-7), floor_losses=(1.0, 0.9 + 2e-7)))
    assert "precision options: optimizer_state_dtype='bf16', param_remainders=True (the reference keeps fp32 state and masters)" in text
    assert "drift against fp32 (optimizer_state_dtype='bf16', param_remainders=True) over 2 steps: loss 4.00e-07 (2x the noise floor)" in text
    assert "drift against fp32" not in str(_report())
