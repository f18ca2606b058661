"""Precision-aware ZeRO-1: narrow optimizer state, masters kept as remainders, bf16 param rounding.

What must hold (issue 46):

* ``Config.param_remainders`` trains **bitwise** like fp32 masters published with
  ``param_rounding="half_away"``, at world 1 and 2, with params that get no gradient in some
  steps (fxzero's own update then steps fragments one by one), Adam and AdamW;
* ``optimizer_state_dtype="bf16"`` keeps half of fp32's state bytes, ``"fp8"`` at most 0.3x,
  and each stays near the fp32 run (the drift per knob is measured by the parity tool and
  ``benchmarks/precision.py``; here only a loose bound that catches a broken update);
* every mode saves and resumes bitwise (``fxzero.save_checkpoint`` and ``opt.state_dict()``), and
  loads across modes, rounding only what the narrower mode cannot keep;
* options a class or param cannot have are refused, naming them.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.inductor_function import Compiling
from fxzero.optim.params.bf16_rounding import join, round_into, split
from fxzero.optim.state.state_dict import MASTER_KEY
from fxzero.optim.update import torch_fused
from fxzero.optim.update.moment_store import BlockStore, RootStore
from fxzero.testing import run_ranks

from models import batch, build, forward_kwargs, loss_fn, param_groups

STEPS, GLOBAL, LR = 4, 8, 1e-2
MODES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16 state": {"optimizer_state_dtype": "bf16"},
    "fp8 state": {"optimizer_state_dtype": "fp8"},
    "remainders": {"param_remainders": True},
    "remainders, bf16 state": {"param_remainders": True, "optimizer_state_dtype": "bf16"},
    "stochastic rounding": {"param_rounding": "stochastic"},
    "bf16 state, eager update": {"optimizer_state_dtype": "bf16", "compiled_update": False},  # the modes above compile (the default)
    "fp8 state, eager update": {"optimizer_state_dtype": "fp8", "compiled_update": False},
    "remainders, bf16 state, eager update": {"param_remainders": True, "optimizer_state_dtype": "bf16", "compiled_update": False},
    "stochastic rounding, eager update": {"param_rounding": "stochastic", "compiled_update": False},
    "remainders, fused": {"param_remainders": True, "flags": {"fused": True}},  # "flags": the optimizer's, not the Config's
}


def _train(name: str, options: dict[str, Any], *, dtype: torch.dtype = torch.bfloat16, steps: int = STEPS, cls: type = torch.optim.AdamW,
           forward: Any = None, model: Any = None, flags: Optional[dict[str, Any]] = None) -> dict[str, Any]:  # fmt: skip
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = model if model is not None else build(name).to(dtype)
    forward = model if forward is None else forward
    config = fxzero.Config(bucket_size=2000, **options)
    opt = fxzero.DistributedOptimizer(param_groups(model), cls, lr=LR, config=config, module=model, **(flags or {}))
    torch.manual_seed(rank)  # dropout draws its own masks per rank, alike in every run
    local, losses = GLOBAL // world, []
    for step in range(steps):
        x, y = batch(name, step, GLOBAL)
        x = x if x.dtype == torch.long else x.to(dtype)
        out = forward(x[rank * local : (rank + 1) * local], **forward_kwargs(name, step))
        loss = loss_fn(name, out.float(), y[rank * local : (rank + 1) * local])
        loss.backward()
        assert not opt.step().skipped
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().float().clone() for p in model.parameters()], "opt": opt, "model": model}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])) and a["losses"] == b["losses"]


def _drift(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of a param element, in units of the most a step can move one (lr)."""
    return max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"])) / LR


# ---- the bit-level pieces ----------------------------------------------------------------------
def test_a_remainder_rebuilds_every_fp32_value_exactly_and_its_param_is_the_half_away_rounding() -> None:
    x = torch.randn(100_000) * torch.logspace(-30, 30, 100_000)
    ties = ((torch.arange(1, 3000, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)
    x = torch.cat([x, ties, -ties, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    param, remainder = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
    split(x, param, remainder)
    assert torch.equal(join(param, remainder).view(torch.int32), x.view(torch.int32))
    rounded = torch.empty_like(param)
    round_into(x, rounded, "half_away")
    assert torch.equal(rounded.view(torch.int16), param.view(torch.int16))
    n = len(ties)
    assert bool((param[-4 - 2 * n : -4].float().abs() > torch.cat([ties, -ties]).abs()).all())  # ties go away from zero
    differs = (x.to(torch.bfloat16).view(torch.int16) != param.view(torch.int16)).nonzero().flatten()
    assert len(differs) >= n - 1 and bool((x.view(torch.int32)[differs] & 0xFFFF).eq(0x8000).all())  # only on ties


def test_stochastic_rounding_follows_the_master_in_expectation_and_repeats_itself() -> None:
    master = torch.ones(200_000) + torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2**-8
    out, again = (torch.empty(master.shape, dtype=torch.bfloat16) for _ in range(2))
    round_into(master, out, "stochastic")
    round_into(master, again, "stochastic")
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))  # a function of the master's bits
    biased = abs(float((master.to(torch.bfloat16).double() - master.double()).mean()))
    unbiased = abs(float((out.double() - master.double()).mean()))
    assert unbiased < biased / 20


def test_the_rounding_hash_in_int32_gives_the_int64_forms_bits() -> None:
    from fxzero.optim.params.bf16_rounding import _hash16_wide, hash16

    bits = torch.randint(-(2**31), 2**31 - 1, (100_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    bits[:4] = torch.tensor([0, -1, 2**31 - 1, -(2**31)], dtype=torch.int32)
    assert torch.equal(hash16(bits), _hash16_wide(bits))


def test_8_bit_blocks_decode_what_they_encode_again_within_their_rounding() -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 1000)
    for store_class, x, relative in ((BlockStore, values, 2**-4), (RootStore, values.square(), 2 * 2**-5 + 2**-10)):
        store = store_class(1000, torch.device("cpu"))
        store.save(x.clone())
        kept = store.load()
        again = store_class(1000, torch.device("cpu"))
        again.import_(store.export())
        assert torch.equal(again.load(), kept)  # a checkpoint of decoded values resumes bitwise
        assert float(((kept - x).abs() / x.abs()).max()) <= relative  # round to nearest: half a code (squared for roots)
    assert BlockStore(1000, torch.device("cpu")).nbytes == 1024 + 32
    assert RootStore(1000, torch.device("cpu")).nbytes == 1024 + 64


def test_the_second_moment_never_decodes_to_a_vanishing_denominator_when_gradients_span_six_decades() -> None:
    """A block whose gradients span six decades (twelve of v): what is too small for the block's codes
    keeps the smallest code, so no root decodes below its value by more than half a code."""
    g = torch.logspace(-6, 0, 32 * 8).view(8, 32)[:, torch.randperm(32, generator=torch.Generator().manual_seed(1))].reshape(-1)
    store = RootStore(g.numel(), torch.device("cpu"))
    store.save(g.square())
    roots = store.load().sqrt()
    assert bool((roots >= g * (1 - 2**-5)).all())  # a denominator shrinks by at most half a code: never a blown-up step
    assert bool((roots > 0).all())


def test_fp8_state_steps_no_element_further_than_fp32_state_when_gradients_span_six_decades() -> None:
    """End to end: a param whose gradient spans six decades, stepped with fp8 and fp32 state from the
    same gradients; no element's largest step exceeds fp32 state's by more than the two moments' rounding."""
    scale = torch.logspace(-6, 0, 4096)[torch.randperm(4096, generator=torch.Generator().manual_seed(2))]
    largest = {}
    for dtype in ("fp32", "fp8"):
        param = torch.nn.Parameter(torch.zeros(4096))
        opt = fxzero.DistributedOptimizer([param], torch.optim.AdamW, lr=1e-3, config=fxzero.Config(optimizer_state_dtype=dtype))
        largest[dtype] = torch.zeros(4096)
        for step in range(30):
            before = param.detach().clone()
            param.grad = scale * torch.randn(4096, generator=torch.Generator().manual_seed(step)).add_(0.5)
            opt.step()
            opt.zero_grad()
            torch.maximum(largest[dtype], (param.detach() - before).abs(), out=largest[dtype])
    # each moment's rounding (m: half an E4M3 code, 2^-4; sqrt(v): 2^-5), carried a few steps by the EMAs: ~10% at most
    assert bool((largest["fp8"] <= largest["fp32"] * 1.15 + 1e-9).all())
    assert float(largest["fp8"].sum()) > 0.9 * float(largest["fp32"].sum())


def test_each_moment_keeps_its_own_dtype() -> None:
    config = fxzero.Config(optimizer_state_dtype="bf16", exp_avg_sq_dtype="fp8")
    assert config.moment_dtypes == ("bf16", "fp8")
    assert fxzero.Config(exp_avg_dtype="fp8").moment_dtypes == ("fp8", "fp32")
    runs = {dtypes: _train("gpt", {"exp_avg_dtype": dtypes[0], "exp_avg_sq_dtype": dtypes[1]}, dtype=torch.float32, steps=2)
            for dtypes in (("fp32", "fp32"), ("fp8", "fp32"), ("fp32", "fp8"), ("bf16", "fp8"))}  # fmt: skip
    numel = sum(p.numel() for p in runs[("fp32", "fp32")]["model"].parameters())
    for (first, second), run in runs.items():
        want = {"fp32": 4.0, "bf16": 2.0, "fp8": 1 + 1 / 32}[first] + {"fp32": 4.0, "bf16": 2.0, "fp8": 1 + 2 / 32}[second]
        assert abs(run["opt"].state_bytes / numel - want) < 0.05, (first, second)
    state = runs[("fp32", "fp8")]["opt"].state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    with pytest.raises(ValueError, match=r"Config.exp_avg_sq_dtype must be 'fp32', 'bf16', 'fp8' or None"):
        fxzero.Config(exp_avg_sq_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exp_avg_dtype='bf16'.*only torch.optim.Adam and torch.optim.AdamW.*SGD"):
        fxzero.DistributedOptimizer(build("mlp").parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(exp_avg_dtype="bf16"))


# ---- world 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_remainders_train_bitwise_like_fp32_masters_rounded_half_away(cls: type) -> None:
    """``mlp_branch`` leaves a param without gradient in some steps: its run steps fragment by fragment."""
    masters = _train("mlp_branch", {"param_rounding": "half_away"}, cls=cls, steps=6)
    remainders = _train("mlp_branch", {"param_remainders": True}, cls=cls, steps=6)
    assert _same(masters, remainders)
    numel = sum(p.numel() for p in remainders["model"].parameters())
    # 2 bytes per element instead of 4, and the fp32 scratch of one run (a run lies in one bucket)
    largest_bucket = max(b.param_data.numel() for buffer in remainders["opt"].buffers for b in buffer.buckets)
    assert remainders["opt"].state_bytes <= masters["opt"].state_bytes - 2 * numel + 4 * largest_bucket


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_remainders_with_fused_train_bitwise_like_fused_fp32_masters_rounded_half_away(cls: type) -> None:
    """``fused=True`` with remainders: torch's fused kernel over each fragment of the rebuilt masters
    (``fxzero.optim.update.torch_fused``), as the fp32-master run steps each fragment's master."""
    masters = _train("mlp_branch", {"param_rounding": "half_away"}, cls=cls, steps=6, flags={"fused": True})
    with mock.patch.object(torch_fused, "functional_adam", wraps=torch_fused.functional_adam) as kernel:
        remainders = _train("mlp_branch", {"param_remainders": True}, cls=cls, steps=6, flags={"fused": True})
    assert kernel.call_count >= 6 and all(call.kwargs["fused"] for call in kernel.call_args_list)
    assert _same(masters, remainders)
    with pytest.raises(ValueError, match=r"optimizer_state_dtype='bf16'.*does not implement fused=True"):  # no fused kernel for bf16 moments
        fxzero.DistributedOptimizer(build("mlp").to(torch.bfloat16).parameters(), cls, fused=True,
                                    config=fxzero.Config(param_remainders=True, optimizer_state_dtype="bf16"))  # fmt: skip


@pytest.mark.parametrize("options", [{"optimizer_state_dtype": "bf16"}, {"optimizer_state_dtype": "fp8"}, {"exp_avg_sq_dtype": "bf16"},
                                     {"optimizer_state_dtype": "bf16", "compiled_update": False}, {"optimizer_state_dtype": "fp8", "compiled_update": False}],
                         ids=["bf16", "fp8", "fp32-bf16", "bf16-eager", "fp8-eager"])  # fmt: skip
def test_remainders_with_narrow_moments_train_bitwise_like_fp32_masters_rounded_half_away(options: dict[str, Any]) -> None:
    """A remainder rebuilds the master exactly, so the moments' dtype changes nothing: the same update
    steps the same fp32 values. Compiled (the default), the join and the split run outside the
    compiled update, on the step's scratch (``fxzero/optim/update/fused_run.py``)."""
    masters = _train("mlp_branch", {**options, "param_rounding": "half_away"}, steps=4)
    remainders = _train("mlp_branch", {**options, "param_remainders": True}, steps=4)
    assert _same(masters, remainders)


def test_narrow_state_stays_near_fp32_and_keeps_fewer_bytes() -> None:
    runs = {label: _train("gpt", MODES[label], dtype=torch.float32) for label in ("fp32", "bf16 state", "fp8 state")}
    moments = {label: run["opt"].state_bytes for label, run in runs.items()}  # fp32 params: no separate masters
    assert moments["bf16 state"] * 2 <= moments["fp32"] + 64
    assert moments["fp8 state"] <= 0.3 * moments["fp32"]
    for label, bound in (("bf16 state", 0.05 * STEPS), ("fp8 state", 0.3 * STEPS)):  # 8-bit: ~6% per moment
        assert _drift(runs[label], runs["fp32"]) < bound, (label, _drift(runs[label], runs["fp32"]))
        assert all(abs(a - b) < 0.05 for a, b in zip(runs[label]["losses"], runs["fp32"]["losses"]))


def test_other_classes_and_unsupported_flags_are_refused_naming_the_option() -> None:
    model = build("mlp").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"optimizer_state_dtype='bf16'.*only torch.optim.Adam and torch.optim.AdamW.*SGD"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(optimizer_state_dtype="bf16"))
    with pytest.raises(ValueError, match=r"param_remainders=True.*does not implement amsgrad=True"):
        fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, amsgrad=True, config=fxzero.Config(param_remainders=True))
    with pytest.raises(ValueError, match=r"param_remainders=True applies to bf16 params"):
        fxzero.DistributedOptimizer(build("mlp").parameters(), torch.optim.AdamW, config=fxzero.Config(param_remainders=True))
    with pytest.raises(ValueError, match=r"param_rounding='stochastic' applies to bf16 params"):
        fxzero.DistributedOptimizer(build("mlp").parameters(), torch.optim.AdamW, config=fxzero.Config(param_rounding="stochastic"))
    half = build("mlp").half()
    with pytest.raises(ValueError, match=r"param '.*' is float16"):
        fxzero.DistributedOptimizer([*model.parameters(), *half.parameters()], torch.optim.AdamW, config=fxzero.Config(param_remainders=True))
    with pytest.raises(ValueError, match="cannot go with mxfp8_param_gather"):
        fxzero.Config(param_remainders=True, mxfp8_param_gather=True)
    with pytest.raises(ValueError, match="param_rounding='nearest_even' cannot go with it"):
        fxzero.Config(param_remainders=True, param_rounding="nearest_even")
    with pytest.raises(ValueError, match="optimizer_state_dtype must be"):
        fxzero.Config(optimizer_state_dtype="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize("label", ["bf16 state", "fp8 state", "remainders", "stochastic rounding", "bf16 state, eager update",
                                   "fp8 state, eager update", "remainders, bf16 state, eager update", "stochastic rounding, eager update",
                                   "remainders, fused"])  # fmt: skip
def test_every_mode_resumes_bitwise_from_a_checkpoint(label: str, tmp_path: Any) -> None:
    """A 4-step run saves after step 2 (``fxzero.save_checkpoint`` and ``opt.state_dict()``); a fresh
    model and optimizer load either, take the run's generator state (dropout), and end bitwise alike."""
    model = build("gpt").to(torch.bfloat16)
    opt = _mode_optimizer(model, label)
    torch.manual_seed(0)
    _steps(model, opt, range(2))
    fxzero.save_checkpoint(tmp_path, model, opt, step=2)
    state, weights, generator = opt.state_dict(), copy.deepcopy(model.state_dict()), torch.get_rng_state()
    _steps(model, opt, range(2, 4))
    for how in ("checkpoint", "state_dict"):
        again = build("gpt", seed=1).to(torch.bfloat16)
        resumed = _mode_optimizer(again, label)
        if how == "checkpoint":
            fxzero.load_checkpoint(fxzero.latest_checkpoint(tmp_path), again, resumed)
        else:
            again.load_state_dict(weights)
            resumed.load_state_dict(state)
        torch.set_rng_state(generator)
        _steps(again, resumed, range(2, 4))
        assert all(torch.equal(p, q) for p, q in zip(again.parameters(), model.parameters())), (label, how)


def _mode_optimizer(model: torch.nn.Module, label: str) -> fxzero.DistributedOptimizer:
    options = dict(MODES[label])
    flags = options.pop("flags", {})
    config = fxzero.Config(bucket_size=2000, **options)
    return fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, module=model, config=config, **flags)


def _steps(model: torch.nn.Module, opt: Any, steps: Any) -> None:
    for step in steps:
        x, y = batch("gpt", step, GLOBAL)
        loss_fn("gpt", model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def test_state_loads_across_modes_rounding_only_what_the_narrower_mode_cannot_keep() -> None:
    source = _train("gpt", MODES["fp32"], steps=2)
    state = source["opt"].state_dict()
    # bf16: half an ulp of each element; 8-bit: within its block's scale (relative ~2^-4, the
    # second moment's root rounded up one code: ~2^-3, squared), small elements to 2^-9 of the largest
    for label, relative, floor in (("bf16 state", 2**-8, 0.0), ("fp8 state", 0.27, 2**-9), ("remainders", 0.0, 0.0),
                                   ("bf16 state, eager update", 2**-8, 0.0), ("fp8 state, eager update", 0.27, 2**-9)):  # fmt: skip
        model = copy.deepcopy(source["model"])
        opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, module=model,
                                          config=fxzero.Config(bucket_size=2000, **MODES[label]))  # fmt: skip
        opt.load_state_dict(state)
        loaded = opt.state_dict()
        for slot, saved in state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                want, got = saved[key].float(), loaded["state"][slot][key].float()
                assert bool(((got - want).abs() <= relative * want.abs() + floor * want.abs().max()).all()), (label, key)
            assert torch.equal(loaded["state"][slot][MASTER_KEY], saved[MASTER_KEY]), label
        other = copy.deepcopy(model)
        back = fxzero.DistributedOptimizer(param_groups(other), torch.optim.AdamW, lr=LR, module=other, config=fxzero.Config(bucket_size=2000))
        back.load_state_dict(loaded)  # and back to fp32: exact (a widening)
        assert all(torch.equal(back.state_dict()["state"][s]["exp_avg"], loaded["state"][s]["exp_avg"].float()) for s in loaded["state"])


# ---- world 1 and 2, eager and Inductor, MXFP8 gather on and off -----------------------------------
COMPILED = {  # label -> options; the same compiled graphs serve every run (runs_from_initial_state)
    "fp32": {},
    "half_away": {"param_rounding": "half_away"},
    "remainders": {"param_remainders": True},
    "bf16 state": {"optimizer_state_dtype": "bf16"},
    "fp8 state": {"optimizer_state_dtype": "fp8"},
    "fp8 state, mxfp8 gather": {"optimizer_state_dtype": "fp8", "mxfp8_param_gather": True},
    "bf16 state, mxfp8 gather": {"optimizer_state_dtype": "bf16", "mxfp8_param_gather": True},
    "mxfp8 gather": {"mxfp8_param_gather": True},
    "remainders, eager update": {"param_remainders": True, "compiled_update": False},  # the modes above compile (the default)
    "half_away, eager update": {"param_rounding": "half_away", "compiled_update": False},
    "bf16 state, eager update": {"optimizer_state_dtype": "bf16", "compiled_update": False},
    "fp8 state, eager update": {"optimizer_state_dtype": "fp8", "compiled_update": False},
    "half_away, fused": {"param_rounding": "half_away", "flags": {"fused": True}},
    "remainders, fused": {"param_remainders": True, "flags": {"fused": True}},
}


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {"losses": run["losses"], "params": run["params"], "bytes": run["opt"].state_bytes}


def _modes(inner: Any) -> dict[str, Any]:
    from models import runs_from_initial_state

    model = build("gpt").to(torch.bfloat16)
    forward = model if inner is None else torch.compile(model, backend="fxzero", options={"inner_compiler": inner}, dynamic=False)
    def run(label: str) -> dict[str, Any]:
        options = dict(COMPILED[label])
        return _summary(_train("gpt", options, forward=forward, model=model, flags=options.pop("flags", None)))

    runs = runs_from_initial_state(model, list(COMPILED), run)
    return dict(zip(COMPILED, runs))


def _check_modes(runs: dict[str, Any]) -> None:
    assert _same(runs["remainders"], runs["half_away"]) and _same(runs["remainders, eager update"], runs["half_away"])
    assert _same(runs["half_away, eager update"], runs["half_away"])  # word loops or eager ops: publish and the watch check
    assert _same(runs["remainders, fused"], runs["half_away, fused"])
    for label, bound in (("bf16 state", 1.5), ("fp8 state", 1.5), ("bf16 state, eager update", 1.5), ("fp8 state, eager update", 1.5)):  # bf16 params: one-ulp flips of ~1.0 weights are 0.78 lr
        assert _drift(runs[label], runs["fp32"]) < bound * STEPS, (label, _drift(runs[label], runs["fp32"]))
    # MXFP8 params: the comparison's resolution is one E4M3 code of the largest weight (3 mantissa bits:
    # 2^-4 for weights in [0.5, 1), 6.25 lr), which a narrow moment's rounding may flip
    code = max(2.0 ** (math.ceil(math.log2(float(p.abs().max()))) - 4) for p in runs["mxfp8 gather"]["params"]) / LR
    for label, bound in (("fp8 state, mxfp8 gather", 1.5), ("bf16 state, mxfp8 gather", 1.5)):
        assert _drift(runs[label], runs["mxfp8 gather"]) < bound * STEPS + code, label
    assert runs["remainders"]["bytes"] < runs["half_away"]["bytes"]
    assert runs["fp8 state"]["bytes"] < runs["bf16 state"]["bytes"] < runs["fp32"]["bytes"]
    assert all(abs(a - b) < 0.05 for run in runs.values() for a, b in zip(run["losses"], runs["fp32"]["losses"]))


@pytest.mark.slow
def test_every_mode_under_inductor_at_world_1() -> None:
    _check_modes(_modes("inductor"))


def _world_2() -> dict[str, Any]:
    return {"eager": _modes(None), "inductor": _modes("inductor")}


@pytest.mark.slow
def test_every_mode_at_world_2_eager_and_inductor() -> None:
    results = run_ranks(2, _world_2, timeout=600)
    for result in results:
        for how in ("eager", "inductor"):
            _check_modes(result[how])
    for how in ("eager", "inductor"):  # every rank holds the same params
        assert all(torch.equal(a, b) for label in COMPILED for a, b in zip(results[0][how][label]["params"], results[1][how][label]["params"]))


def test_a_param_written_outside_the_optimizer_keeps_the_written_value_under_remainders() -> None:
    model = build("mlp").to(torch.bfloat16)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=fxzero.Config(param_remainders=True))
    _steps_mlp(model, opt)
    written = [torch.randn(p.shape).to(torch.bfloat16) for p in model.parameters()]
    with torch.no_grad():
        for p, w in zip(model.parameters(), written):
            p.copy_(w)
    for group in opt.param_groups:
        group["lr"] = 0.0
    _steps_mlp(model, opt)  # an update of zero: each param keeps what was written, bit for bit
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), written))


def _steps_mlp(model: torch.nn.Module, opt: Any) -> None:
    x, y = batch("mlp", 0, GLOBAL)
    loss_fn("mlp", model(x.to(torch.bfloat16)).float(), y).backward()
    opt.step()
    opt.zero_grad()


# ---- other model families, default configurations, and the loops around them ----------------------
def _hf_gpt2() -> torch.nn.Module:
    """A tiny GPT-2 from its config: its default dropouts (embedding, attention, residual 0.1) are on."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _family_run(name: str, options: dict[str, Any], accumulate: int = 1) -> list[torch.Tensor]:
    """Three steps of ``name`` in bf16 (``accumulate`` microbatches each, under ``no_sync``); its params."""
    import contextlib

    model = (_hf_gpt2() if name == "hf_gpt2" else build(name)).to(torch.bfloat16)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model, config=fxzero.Config(bucket_size=2000, **options))
    torch.manual_seed(0)  # dropout: the same masks in each run
    for step in range(3):
        for micro in range(accumulate):
            x, y = batch("gpt" if name == "hf_gpt2" else name, step * accumulate + micro, GLOBAL)
            with opt.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                if name == "hf_gpt2":
                    loss = model(input_ids=x, labels=x).loss
                else:
                    x = x if x.dtype == torch.long else x.to(torch.bfloat16)
                    loss = loss_fn(name, model(x, **forward_kwargs(name, step)).float(), y)
                (loss / accumulate).backward()
        assert not opt.step().skipped
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["conv", "adapters", "expert_loop", "mlp_frozen", "hf_gpt2"])
def test_model_families_keep_remainders_bitwise_and_train_with_narrow_state(name: str) -> None:
    """A conv net, adapters and experts picked in Python, a partly frozen MLP, and Hugging Face's GPT-2 with
    its default dropout (tied embeddings), with gradient accumulation under ``no_sync``; compiled (the default)
    and eager (``compiled_update=False``): remainders bitwise either way, packed bf16 moments and fp8 block rows
    within the eager update's bound."""
    half_away = _family_run(name, {"param_rounding": "half_away"}, accumulate=2)
    assert all(torch.equal(a, b) for a, b in zip(half_away, _family_run(name, {"param_remainders": True}, accumulate=2)))
    eager = _family_run(name, {"param_remainders": True, "compiled_update": False}, accumulate=2)
    assert all(torch.equal(a, b) for a, b in zip(half_away, eager))
    for dtype, options in (("bf16", {}), ("fp8", {}), ("bf16", {"compiled_update": False}), ("fp8", {"compiled_update": False})):
        narrow = _family_run(name, {"optimizer_state_dtype": dtype, "param_remainders": True, **options}, accumulate=2)
        assert all(bool(p.isfinite().all()) for p in narrow)
        assert max(float((a - b).abs().max()) for a, b in zip(narrow, half_away)) < 1.5 * 3 * LR, (name, dtype)


# ---- the compiled run update (Config.compiled_update) ------------------------------------------------
@pytest.mark.slow
def test_the_compiled_run_update_compiles_once_per_kinds_and_steps_like_the_eager_one() -> None:
    """Cold Inductor compiles (one per kinds of moments and remainders): slow. A later step, another lr
    and another run of the same kinds reuse the graph; the params stay within rounding of the eager update's."""
    for options in ({"optimizer_state_dtype": "fp8"}, {"optimizer_state_dtype": "bf16", "param_remainders": True},
                    {"exp_avg_sq_dtype": "fp8"}):  # fmt: skip
        eager = _train("gpt", {**options, "compiled_update": False}, steps=2)
        model = build("gpt").to(torch.bfloat16)
        compiled = _train("gpt", {**options, "compiled_update": True}, steps=2, model=model)
        fused = compiled["opt"].runtime.local.fused
        assert fused.compile_seconds > 0
        first = fused.compiles
        for group in compiled["opt"].param_groups:
            group["lr"] = LR / 2
        x, y = batch("gpt", 2, GLOBAL)
        loss_fn("gpt", model(x, **forward_kwargs("gpt", 2)).float(), y).backward()
        compiled["opt"].step()  # a third step at another lr: the same graph
        assert fused.compiles == first, options
        _train("gpt", {**options, "compiled_update": True}, steps=1)
        assert fused.compiles == first  # a fresh optimizer of the same kinds: the same graph
        assert _drift(compiled, eager) < 0.5 * 2, (options, _drift(compiled, eager))
        assert compiled["opt"].state_bytes == eager["opt"].state_bytes


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("fp8", "fp8"), ("bf16", "fp8")], ids="-".join)
def test_a_run_of_whole_blocks_steps_in_rows_bitwise_like_the_flat_run(dtypes: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold Inductor compiles: slow. A run of whole 8-bit blocks steps as rows of one block each
    (``fused_run._in_rows``: Inductor then writes the master and the codes in one pass); it keeps the flat
    run's bits, in the master and in every stored byte, with NaN and inf gradients, Adam with maximize too."""
    from fxzero.optim.update import fused_run
    from fxzero.optim.update.moment_store import make_stores

    n = 32 * 257
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) * 10 ** torch.randint(-6, 2, (n,), generator=g).float() for _ in range(4)]
    grads[2][[5, 77]] = torch.tensor([float("nan"), float("inf")])
    hypers = [(1e-3, 0.9, 0.999, 1e-8, 0.01, False, True)] * 2 + [(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)] * 2
    ends = []
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(fused_run, "_in_rows", lambda kinds, grad: False)
        update, master = fused_run.FusedRunUpdate(Compiling(True, "the test's update")), torch.randn(n, generator=torch.Generator().manual_seed(0))
        stores = make_stores(dtypes, n, master.device, paired=True)
        for step, (grad, hyper) in enumerate(zip(grads, hypers), 1):
            update(master, grad, *stores, step, hyper)
        ends.append([master.view(torch.int32)] + [t.view(torch.uint8) for store in stores for t in fused_run._parts(store)])
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert not bool(ends[0][0].view(torch.float32).isfinite().all())  # the NaN gradient reached the master: compared too


def test_both_bf16_moments_packed_in_one_word_keep_what_two_bf16_tensors_keep() -> None:
    """The compiled update's store of two bf16 moments (one int32 word per element) rounds, loads and
    exports exactly as two bf16 tensors (``copy_``: to nearest even, overflow to inf) do."""
    from fxzero.optim.update.moment_store import make_stores

    g = torch.Generator().manual_seed(5)
    n = 1000
    m = torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-30, 38, generator=g)
    v = torch.rand(n, generator=g) * 10 ** torch.empty(n).uniform_(-38, 38, generator=g)
    m[:3] = torch.tensor([3.4e38, -0.0, float("inf")])
    paired = make_stores(("bf16", "bf16"), n, torch.device("cpu"), paired=True)
    plain = make_stores(("bf16", "bf16"), n, torch.device("cpu"), paired=False)
    assert [s.nbytes for s in paired] == [s.nbytes for s in plain] == [2 * n, 2 * n]
    for stores in (paired, plain):
        stores[0].save(m.clone())
        stores[1].save(v.clone())
    for a, b in zip(paired, plain):
        assert torch.equal(a.load(), b.load()) and torch.equal(a.export(), b.export()) and a.export().dtype == torch.bfloat16
    assert torch.equal(paired[0].load(), m.bfloat16().float()) and torch.equal(paired[1].load(), v.bfloat16().float())


def test_the_first_moments_block_exponents_are_frexp_and_exp2_computed_from_bits() -> None:
    """The 8-bit first moment's scales are built from fp32 bits (``torch.frexp`` / ``torch.exp2`` are libm
    calls per element in Inductor's loops); they must be the exponent ``ceil(log2(amax / 448))`` and the
    power of two that frexp and exp2 give, for blocks of every magnitude, zero and subnormal ones included."""

    def reference_encode(blocks: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor) -> None:
        mantissa, exponent = torch.frexp(blocks.abs().amax(dim=1) / 448.0)
        exponent = (exponent - mantissa.eq(0.5).to(exponent.dtype)).clamp(-127, 127)
        exponents.copy_(exponent)
        codes.copy_((blocks / torch.exp2(exponent.to(torch.float32)).unsqueeze(1)).clamp(-448.0, 448.0))

    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(4000, 32, generator=g) * 10 ** torch.empty(4000, 1).uniform_(-46, 38, generator=g)
    blocks[:2] = 0
    blocks[2:6, 0] = torch.tensor([448 * 2.0**-127, 448 * 2.0**-126, 1e-45, 448 * 1.5 * 2.0**-127])
    blocks[6] = 3.4e38
    want = (torch.empty(4000, 32, dtype=torch.float8_e4m3fn), torch.empty(4000, dtype=torch.int8))
    got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    reference_encode(blocks, *want)
    BlockStore.encode(blocks, *got)
    assert torch.equal(want[0].view(torch.uint8), got[0].view(torch.uint8)) and torch.equal(want[1], got[1])
    assert torch.equal(BlockStore.decode(*got), want[0].float() * torch.exp2(want[1].float()).unsqueeze(1))
