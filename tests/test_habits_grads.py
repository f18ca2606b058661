"""Training-loop habits around gradients behave as torch.optim (+ DDP) would, or fail loudly.

Each test trains fxzero on N ranks (each on its slice of a global batch) next to one
process training the whole batch with plain torch.optim and the same habit: averaged
gradients make the two equal up to float rounding.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim import ShardedGrad
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.optim.gradients import grad_sync
from fxzero.testing import run_ranks

from models import batch, build, loss_fn, param_groups

LR, CLIP, GLOBAL, STEPS = 1e-2, 0.05, 8, 4


def _local(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(name, step, GLOBAL)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    size = GLOBAL // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _mean(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean of the ranks' equal slices."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _fxzero(name: str, config: Optional[fxzero.Config] = None, **kwargs: object) -> tuple:
    model = build(name)
    config = config or fxzero.Config(bucket_size=2000)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=config, module=model, **kwargs)
    return model, opt


def _params(model: torch.nn.Module) -> dict:
    return {n: v.clone() for n, v in model.state_dict().items()}  # waits for the gathers


# ---- 1. model.zero_grad() instead of opt.zero_grad() -----------------------------------
_ZERO = {
    "none": lambda model, opt: None,
    "opt": lambda model, opt: opt.zero_grad(),
    "model": lambda model, opt: model.zero_grad(),
    "model-keep": lambda model, opt: model.zero_grad(set_to_none=False),
    "one-param": lambda model, opt: setattr(model.ln_f.weight, "grad", None),
}


def _zero_grad_habit(zero: str, config: Optional[fxzero.Config] = None) -> dict:
    model, opt = _fxzero("gpt", config)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _local("gpt", step)
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        norms.append(opt.step().grad_norm)
        _ZERO[zero](model, opt)
        losses.append(_mean(loss))
    return {"losses": losses, "norms": norms, "params": _params(model)}


def _reference(name: str, habit: Callable[[torch.nn.Module, torch.optim.Optimizer, int], object] | None = None) -> dict:
    """Plain torch.optim on the whole batch; ``habit(model, opt, step)`` runs between
    backward and step and returns the grad norm to record (or None)."""
    model = build(name)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(name, step, GLOBAL)
        loss = loss_fn(name, model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
        if habit is not None:
            result = habit(model, opt, step)
            norms[-1] = norms[-1] if result is None else float(result)
        opt.step()
        model.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _assert_close(result: dict, reference: dict, keys: tuple[str, ...] = ("losses", "norms")) -> None:
    for key in keys:
        torch.testing.assert_close(result[key], reference[key], atol=1e-5, rtol=1e-5, msg=key)
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("zero", ["model", "model-keep", "opt", "none"])
def test_model_zero_grad_after_step_matches_torch(zero: str) -> None:
    """step() consumes the gradients: the grad norms of a loop that calls model.zero_grad()
    (or no zero_grad at all) are the norms of each step's own gradients (they piled up
    before: 1.68, 2.82, 3.16)."""
    reference = _reference("gpt")
    assert reference["norms"][0] != pytest.approx(reference["norms"][1], rel=0.05)
    for result in run_ranks(2, _zero_grad_habit, zero):
        _assert_close(result, reference)


def test_model_zero_grad_with_the_mxfp8_gather_in_the_grad_buffer() -> None:
    """The grad buffer holds gather bytes until a bucket lands: consuming the gradients
    at step() must not disturb them; model.zero_grad() equals opt.zero_grad() bit for bit."""
    config = fxzero.Config(bucket_size=2000, mxfp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
    by_model = run_ranks(2, _zero_grad_habit, "model", config)
    by_opt = run_ranks(2, _zero_grad_habit, "opt", config)
    for a, b in zip(by_model, by_opt):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["losses"][-1] < a["losses"][0]


def _dropping(zero_before_step: dict[int, str]) -> dict:
    """model.zero_grad() between backward and step drops (None) or zeroes the gradients."""
    model, opt = _fxzero("gpt")
    losses = []
    for step in range(STEPS):
        x, y = _local("gpt", step)
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        if step in zero_before_step:
            _ZERO[zero_before_step[step]](model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dropping every gradient is not "no backward": no warning
            result = opt.step()
        assert result.skipped == (zero_before_step.get(step) == "model"), result
        losses.append(_mean(loss))
    return {"losses": losses, "params": _params(model)}


def test_model_zero_grad_before_step_drops_or_zeroes_the_gradients_like_torch() -> None:
    habits = {1: "model-keep", 2: "model", 3: "one-param"}

    def habit(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step in habits:
            _ZERO[habits[step]](model, opt)

    reference = _reference("gpt", habit)
    for result in run_ranks(2, _dropping, habits):
        _assert_close(result, reference, keys=("losses",))


def test_zero_grad_between_forward_and_backward_with_graph_breaks() -> None:
    """The tutorial's order (forward, zero_grad, backward, step) keeps the compiled
    forward's expected gradients: no bucket launches before its last gradient."""
    torch._dynamo.reset()
    model, opt = _fxzero("gpt_break")
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    losses = []
    for step in range(STEPS):
        x, y = batch("gpt", step, GLOBAL)
        loss = loss_fn("gpt", cmodel(x), y)
        opt.zero_grad()
        loss.backward()
        assert not opt.step().skipped
        losses.append(loss.item())
    torch.testing.assert_close(losses, _reference("gpt_break")["losses"], atol=1e-5, rtol=0)


# ---- 2. torch.nn.utils.clip_grad_norm_ between backward and step ------------------------
_CLIP_BY_NORM = {2.0: CLIP, math.inf: 0.02}  # below every step's norm


def _clipping(how: str, norm_type: float) -> dict:
    model, opt = _fxzero("gpt")
    losses, norms = [], []
    sums = []
    all_reduce_sum = DataParallelGroup.all_reduce_sum

    def counted(self: DataParallelGroup, *args: object, **kwargs: object) -> None:
        sums.append(1)
        all_reduce_sum(self, *args, **kwargs)

    patch = mock.patch.object(DataParallelGroup, "all_reduce_sum", counted)
    for step in range(STEPS):
        x, y = _local("gpt", step)
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        clip = _CLIP_BY_NORM[norm_type]
        with patch:
            if how == "torch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type)
            else:
                norm = opt.clip_grad_norm_(clip, norm_type=norm_type)
            result = opt.step()
        if norm_type == 2.0:  # step() sees the clipped gradients
            assert result.grad_norm == pytest.approx(clip, rel=1e-4), (result, norm)
        norms.append(float(norm))
        losses.append(_mean(loss))
    assert len(sums) == STEPS, sums  # the clip's statistics all-reduce is the step's: one per step
    return {"losses": losses, "norms": norms, "params": _params(model)}


@pytest.mark.parametrize(("how", "norm_type"), [("torch", 2.0), ("torch", math.inf), ("optimizer", 2.0)])
def test_clip_grad_norm_clips_by_the_global_norm_like_ddp(how: str, norm_type: float) -> None:
    """clip_grad_norm_(model.parameters()) sees every param's p.grad, returns the global
    norm over all ranks and clips by it (it returned 0.0 and clipped nothing)."""
    clip = _CLIP_BY_NORM[norm_type]
    reference = _reference("gpt", lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(), clip, norm_type=norm_type))
    assert min(reference["norms"]) > clip  # every step is clipped
    for result in run_ranks(2, _clipping, how, norm_type):
        _assert_close(result, reference)



def _two_optimizers(model: torch.nn.Module, distributed: bool) -> tuple[torch.optim.Optimizer, ...]:
    """The Muon recipe's shape (a shape-aware optimizer over the matrices, whole params, and AdamW
    over the rest), with Adafactor standing in for Muon: Muon's Newton-Schulz runs in bf16, whose
    rounding grows past this file's tolerances within four steps (world 1 too)."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    if not distributed:
        return torch.optim.Adafactor(matrices, lr=LR), torch.optim.AdamW(rest, lr=LR)
    config = fxzero.Config(bucket_size=2000)
    return (fxzero.DistributedOptimizer(matrices, torch.optim.Adafactor, lr=LR, config=config, module=model),
            fxzero.DistributedOptimizer(rest, torch.optim.AdamW, lr=LR, config=config, module=model))


def _clip_over_two_optimizers(foreach: bool, distributed: bool = True) -> dict:
    model = build("gpt")
    opts = _two_optimizers(model, distributed)
    assert not distributed or opts[0].runtime.whole_params
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _local("gpt", step) if distributed else batch("gpt", step, GLOBAL)
        loss = loss_fn("gpt", model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=foreach)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(_mean(loss) if distributed else loss.item())
    return {"losses": losses, "norms": norms, "params": _params(model)}


@pytest.mark.parametrize("foreach", [False, True], ids=["per-param", "foreach"])
def test_clip_grad_norm_over_params_of_two_optimizers(foreach: bool) -> None:
    """Two optimizers over one model (the Muon recipe): torch's clip over model.parameters()
    gets the norm over both optimizers' params and clips both. Its foreach path passes one
    list holding both optimizers' views (it raised)."""
    reference = _clip_over_two_optimizers(foreach, distributed=False)
    assert min(reference["norms"]) > CLIP  # every step is clipped
    for result in run_ranks(2, _clip_over_two_optimizers, foreach):
        _assert_close(result, reference)

def test_unsupported_use_of_p_grad_names_the_param_and_what_works() -> None:
    model, opt = _fxzero("mlp")
    x, y = batch("mlp", 0, 4)
    loss_fn("mlp", model(x), y).backward()
    grad = model.fc1.weight.grad
    assert isinstance(grad, ShardedGrad) and grad.shape == model.fc1.weight.shape and grad.dtype == model.fc1.weight.dtype
    assert float(grad.norm()) == pytest.approx(float(model.fc1.weight.main_grad.norm()), rel=1e-6)  # world 1: all of it
    assert grad.data is grad and float(grad.data.norm()) == float(grad.norm())
    with pytest.raises(RuntimeError, match=r"p.grad of param 'fc1.weight' .* add_ is not supported.*clip_grad_norm_"):
        grad.add_(1.0)
    with pytest.raises(TypeError, match="p.grad of param 'fc1.bias' was set to another param's sharded-gradient view"):
        model.fc1.bias.grad = model.norm.bias.grad
        opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_compiled_forward_between_backward_and_step_still_compiles() -> None:
    """torch.compile reads p.grad's metadata when it traces a function of the params."""
    torch._dynamo.reset()
    model, opt = _fxzero("gpt")
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    x, y = batch("gpt", 0, GLOBAL)
    loss = loss_fn("gpt", cmodel(x), y)
    loss.backward()
    with torch.no_grad():
        again = loss_fn("gpt", cmodel(x), y)
    assert again.item() == pytest.approx(loss.item(), abs=1e-6)
    assert not opt.step().skipped


# ---- 8. a forward with grad enabled and no backward ---------------------------------------
class _WithLoss(torch.nn.Module):
    """The loss computed inside the compiled graph (as Hugging Face models do): the
    backward's root is then the compiled function's own autograd node."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn("gpt", self.model(x), y)


def _launched_before_end_of_backward(validate: bool, loss_in_graph: bool = False) -> tuple[list[int], int, list[float]]:
    torch._dynamo.reset()
    model, opt = _fxzero("gpt", fxzero.Config(bucket_size=1500))
    compiled = torch.compile(_WithLoss(model) if loss_in_graph else model, backend="fxzero", options={"inner_compiler": "eager"})
    seen: list[int] = []
    queue = grad_sync.queue_end_of_backward  # the one function that queues fxzero's end-of-backward callback

    def counting_launched(callback: Callable[[], None]) -> None:
        queue(lambda: (seen.append(sum(opt.runtime.ledger.launched)), callback()))

    losses, kept = [], []
    with mock.patch.object(grad_sync, "queue_end_of_backward", counting_launched):
        for step in range(3):
            x, y = batch("gpt", step, GLOBAL)
            if validate:  # a validation loss computed without torch.no_grad(), kept alive
                kept.append(compiled(x, y) if loss_in_graph else loss_fn("gpt", compiled(x), y))
            loss = compiled(x, y) if loss_in_graph else loss_fn("gpt", compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return seen, len(opt.runtime.buckets), losses


@pytest.mark.parametrize("loss_in_graph", [False, True], ids=["loss-outside", "loss-inside-the-graph"])
def test_forward_without_backward_does_not_delay_bucket_launches(loss_in_graph: bool) -> None:
    seen, buckets, losses = _launched_before_end_of_backward(validate=True, loss_in_graph=loss_in_graph)
    plain, _, plain_losses = _launched_before_end_of_backward(validate=False, loss_in_graph=loss_in_graph)
    assert buckets >= 3
    # step 0 is the learning step (everything at the end); after it all buckets but the
    # last launch inside backward, validation forward or not
    assert seen[1:] == plain[1:] and min(seen[1:]) >= buckets - 1, (seen, plain)
    assert losses == plain_losses


# ---- 9. step() twice after one backward ----------------------------------------------------
def test_second_step_after_one_backward_applies_nothing_and_says_so() -> None:
    model, opt = _fxzero("mlp")
    x, y = batch("mlp", 0, 4)
    loss_fn("mlp", model(x), y).backward()
    assert not opt.step().skipped
    assert all(p.grad is None for p in model.parameters())  # taken back by step()
    after_first = _params(model)
    with pytest.warns(UserWarning, match="no gradient since the previous step"):
        second = opt.step()
    assert second.skipped and second.reason == "no_gradients" and second.grad_norm == 0.0
    assert all(torch.equal(v, after_first[k]) for k, v in _params(model).items())


# ---- 10. torch.amp.GradScaler ----------------------------------------------------------------
_INF_STEP = 2


def _scaled(unscale_and_clip: bool) -> dict:
    model, opt = _fxzero("mlp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        x, y = _local("mlp", step)
        loss = loss_fn("mlp", model(x), y)
        if step == _INF_STEP and dist.get_rank() == 0:
            loss = loss * math.inf  # one rank overflows: every rank must skip, as under DDP
        scaler.scale(loss).backward()
        if unscale_and_clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        skipped.append(scaler.step(opt).skipped)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        losses.append(_mean(loss))
    return {"losses": losses, "scales": scales, "skipped": skipped, "params": _params(model)}


def _scaled_reference(unscale_and_clip: bool) -> dict:
    model = build("mlp")
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    scales = []
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL)
        half = GLOBAL // 2
        first, second = (loss_fn("mlp", model(x[s]), y[s]) for s in (slice(0, half), slice(half, GLOBAL)))
        loss = ((first * math.inf if step == _INF_STEP else first) + second) / 2
        scaler.scale(loss).backward()
        if unscale_and_clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["scaler.step", "unscale_-clip-step"])
def test_grad_scaler_scales_unscales_and_skips_like_ddp(unscale_and_clip: bool) -> None:
    reference = _scaled_reference(unscale_and_clip)
    assert reference["scales"][_INF_STEP] < reference["scales"][_INF_STEP - 1]  # the inf step backed off
    for result in run_ranks(2, _scaled, unscale_and_clip):
        assert result["skipped"] == [step == _INF_STEP for step in range(STEPS)]
        assert result["scales"] == reference["scales"]
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)


# ---- activation checkpointing (torch.utils.checkpoint; HF's gradient_checkpointing_enable) ----
class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


def _checkpointing_run(reentrant: Optional[bool]) -> list[torch.Tensor]:
    """The tied GPT under the fxzero backend, each block checkpointed (``None``: not)."""
    model, opt = _fxzero("gpt")
    if reentrant is not None:
        model.blocks = torch.nn.ModuleList(_Checkpointed(block, reentrant) for block in model.blocks)
    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
    for step in range(STEPS):
        x, y = _local("gpt", step)
        loss_fn("gpt", cmodel(x), y).backward()
        assert not opt.step().skipped
        opt.zero_grad()
    return list(_params(model).values())


def _with_and_without_checkpointing() -> list[bool]:
    plain = _checkpointing_run(None)
    return [all(map(torch.equal, _checkpointing_run(reentrant), plain)) for reentrant in (False, True)]


@pytest.mark.slow
def test_activation_checkpointing_trains_bit_for_bit_as_without_it() -> None:
    """Each block recomputed in the backward, with either of torch.utils.checkpoint's
    implementations (the reentrant one runs a backward inside the backward): the
    gradients reach the buckets once, and training is the same as without it."""
    assert run_ranks(2, _with_and_without_checkpointing, timeout=240) == [[True, True]] * 2


def _fxzero_and_ddp(config: fxzero.Config, compiled: bool) -> tuple[tuple, tuple]:
    """(model, forward, optimizer) of fxzero and of DDP + AdamW over the same GPT; compiled
    alike (the fxzero backend with the eager inner compiler, ``aot_eager``) or both eager."""
    model, opt = _fxzero("gpt", config)
    ref = build("gpt")
    forward, ref_forward = model, torch.nn.parallel.DistributedDataParallel(ref)
    if compiled:
        forward = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})
        ref_forward = torch.compile(ref_forward, backend="aot_eager")
    return (model, forward, opt), (ref, ref_forward, torch.optim.AdamW(param_groups(ref), lr=LR))


# ---- mixed precision by autocast over fp32 params ------------------------------------------
def _autocast_beside_ddp(compiled: bool) -> list[bool]:
    """fxzero and DDP + AdamW, each forward under ``torch.autocast(bfloat16)``: per step, the
    same loss and the same params, bit for bit (both compiled alike, or both eager)."""
    (model, forward, opt), (ref, ref_forward, ref_opt) = _fxzero_and_ddp(fxzero.Config(bucket_size=2000), compiled)
    same = []
    for step in range(STEPS):
        x, y = _local("gpt", step)
        losses = []
        for fwd, optimizer in ((forward, opt), (ref_forward, ref_opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn("gpt", fwd(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        opt.finish_param_sync()
        same.append(losses[0] == losses[1] and all(map(torch.equal, model.parameters(), ref.parameters())))
    return same


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fxzero-backend"])
def test_autocast_bf16_over_fp32_params_trains_bit_for_bit_like_ddp(compiled: bool) -> None:
    assert run_ranks(2, _autocast_beside_ddp, compiled, timeout=240) == [[True] * STEPS] * 2


# ---- two forwards, one backward (contrastive pairs, preference pairs, a sum of two losses) ----
def _two_forwards_beside_ddp(overlap: bool) -> list[bool]:
    """The compiled model called twice before one backward: its graph runs twice with the same
    params, so each param's gradient arrives summed once and its bucket launches only after
    both forwards' contributions (the per-forward counts). fxzero next to DDP + AdamW."""
    config = fxzero.Config(bucket_size=2000, overlap_param_gather=overlap)
    (model, forward, opt), (ref, ref_forward, ref_opt) = _fxzero_and_ddp(config, compiled=True)
    same = []
    for step in range(STEPS):
        (x, y), (x2, y2) = _local("gpt", step), _local("gpt", 100 + step)
        for fwd, optimizer in ((forward, opt), (ref_forward, ref_opt)):
            (loss_fn("gpt", fwd(x), y) + 0.5 * loss_fn("gpt", fwd(x2), y2)).backward()
            optimizer.step()
            optimizer.zero_grad()
        opt.finish_param_sync()
        same.append(all(map(torch.equal, model.parameters(), ref.parameters())))
    return same


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlap"])
def test_two_forwards_then_one_backward_train_bit_for_bit_like_ddp(overlap: bool) -> None:
    assert run_ranks(2, _two_forwards_beside_ddp, overlap, timeout=240) == [[True] * STEPS] * 2
