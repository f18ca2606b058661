"""On a CUDA GPU: the NCCL path at one rank, Inductor's CUDA code with fxzero's passes,
the MXFP8 cast, and host syncs in ``step()``. Skipped (with the reason) without a GPU."""

from __future__ import annotations

import datetime
import warnings
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import mxfp8

from models import batch, build, loss_fn, param_groups, train_steps

pytestmark = pytest.mark.cuda

LR, STEPS, GLOBAL = 1e-2, 4, 8


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build("gpt").cuda()
    losses = train_steps("gpt", model, torch.optim.AdamW(param_groups(model), lr=LR), range(STEPS), GLOBAL, "cuda")
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_fxzero(group: object) -> None:
    """fxzero (Inductor) on the GPU trains like eager AdamW; every param's gradient came
    through the compiled backward's hand-offs."""
    torch._dynamo.reset()
    model = build("gpt").cuda()
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, module=model, process_group=group)
    losses = train_steps("gpt", torch.compile(model, backend="fxzero"), opt, range(STEPS), GLOBAL, "cuda")
    ref_losses, ref_params = _reference()
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ref_params[name], atol=1e-4, rtol=0, msg=name)
    assert sum(opt.runtime.ledger.compiled) == len(opt.param_table.params)


def test_inductor_cuda_compile_with_the_passes_trains_like_eager() -> None:
    _check_fxzero(None)


def test_nccl_group_of_one_rank() -> None:
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        assert fxzero.optim.DataParallelGroup.resolve(group).grad_collective == "reduce_scatter"
        _check_fxzero(group)
    finally:
        dist.destroy_process_group()


def test_mxfp8_cast_on_cuda_is_bitwise_the_cpu_cast() -> None:
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 1024)
    codes, scales = mxfp8.quantize(x.cuda())
    cpu_codes, cpu_scales = mxfp8.quantize(x)
    assert codes.is_cuda and scales.is_cuda
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))
    assert torch.equal(scales.cpu().view(torch.uint8), cpu_scales.view(torch.uint8))
    assert torch.equal(mxfp8.dequantize(codes, scales).cpu(), mxfp8.dequantize(cpu_codes, cpu_scales))


def test_step_synchronizes_with_the_host_at_most_once() -> None:
    """torch's sync debug mode warns at every synchronizing CUDA call inside step()."""
    torch._dynamo.reset()
    model = build("gpt").cuda()
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=LR, config=fxzero.Config(clip_grad=1.0), module=model)
    run = torch.compile(model, backend="fxzero")
    for step in range(3):
        x, y = (t.cuda() for t in batch("gpt", step, GLOBAL))
        loss_fn("gpt", run(x), y).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_random_ops_draw_plain_compiles_masks_on_cuda() -> None:
    """Dropout and its kin (``test_random_ops.py``'s chain, the second half checkpointed) under
    Inductor's CUDA random kernels: fxzero draws plain ``torch.compile``'s masks, forward and
    recompute alike. Both checkpointed: on CUDA plain ``torch.compile``'s checkpointed chain draws
    other masks than the same chain without checkpointing (losses 2e-2 apart under Inductor's
    random on torch 2.11's CUDA build, an H100; fxzero matched plain bitwise both ways)."""
    import test_random_ops as chain

    for fallback_random in (False, True):
        ours = chain.train("fxzero", checkpointed=True, fallback_random=fallback_random, device="cuda")
        plain = chain.train("plain", checkpointed=True, fallback_random=fallback_random, device="cuda")
        assert chain.diff(ours, plain) <= chain.EXACT, (fallback_random, chain.diff(ours, plain))


def _precision_run(options: dict, steps: int = 6) -> tuple[list[torch.Tensor], int, float]:
    """Six steps of the GPT in bf16 on CUDA with ``options``: its params, state bytes and seconds a step.
    Where fxzero's own update is compiled (the default), the compile must have worked on CUDA (no eager fallback)."""
    import time

    model = build("gpt").to("cuda", torch.bfloat16)
    opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, foreach=False, module=model,
                                      config=fxzero.Config(bucket_size=2000, **options))  # fmt: skip
    torch.manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        x, y = (t.cuda() for t in batch("gpt", step, 8))
        loss_fn("gpt", model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    fused = getattr(opt.runtime.local, "fused", None)
    assert options.get("compiled_update") is False or fused is None or fused.compiling.active, "the compiled update fell back to eager ops on CUDA"
    return [p.detach().float().cpu() for p in model.parameters()], opt.state_bytes, (time.perf_counter() - start) / steps


@pytest.mark.parametrize("compiled", [None, False], ids=["compiled", "eager"])
def test_precision_options_on_cuda(compiled: Optional[bool]) -> None:
    """Remainders bitwise the half-away fp32-master run; narrow state near fp32 with fewer bytes (CUDA kernels):
    with fxzero's own work compiled (the default: Triton kernels) and eager (``compiled_update=False``)."""
    flag = {"compiled_update": compiled}
    half_away, masters_bytes, _ = _precision_run({"param_rounding": "half_away", **flag})
    remainders, remainder_bytes, _ = _precision_run({"param_remainders": True, **flag})
    assert all(torch.equal(a, b) for a, b in zip(half_away, remainders)) and remainder_bytes < masters_bytes
    fp32, fp32_bytes, _ = _precision_run({})
    for dtype in ("bf16", "fp8"):
        params, nbytes, seconds = _precision_run({"optimizer_state_dtype": dtype, **flag})
        drift = max(float((a - b).abs().max()) for a, b in zip(params, fp32)) / 1e-2
        print(f"cuda {dtype} state ({flag}): {nbytes} bytes (fp32 state {fp32_bytes}), drift {drift:.2f} lr after 6 steps, {1e3 * seconds:.1f} ms/step")
        assert nbytes < fp32_bytes and drift < 1.5 * 6
