"""``fxzero explain --size`` (:func:`fxzero.explainer.sizing.size_run`): bytes per rank derived by
hand for a layout with no padding, Megatron-LM's bytes-per-param formula on Llama-3-8B's shapes,
and the prediction against the buffers and state a real DistributedOptimizer allocates at world 2
and 4 (the main job's GPT, ``examples/train_gpt.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.explainer.sizing import size_run
from fxzero.testing import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def _llama3_8b_shapes() -> nn.Module:
    """Llama-3-8B's params by shape (its published config: hidden 4096, 32 layers, 32 heads of
    128, 8 KV heads, FFN 14336, vocab 128256, untied head), bf16 on the meta device."""
    h, kv, ffn, vocab = 4096, 1024, 14336, 128256
    layer = [(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn), (h,), (h,)]
    shapes = [(vocab, h)] + layer * 32 + [(h,), (vocab, h)]
    model = nn.Module()
    model.weights = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta", dtype=torch.bfloat16)) for s in shapes)
    return model


def test_bytes_of_a_layout_without_padding_derived_by_hand() -> None:
    """128 x 128 weights start on multiples of 64 and fill buckets to multiples of lcm(4, 128):
    no padding, so every figure is a product of the element count."""
    model = nn.Sequential(*(nn.Linear(128, 128, bias=False) for _ in range(6))).to(torch.bfloat16)
    n = 6 * 128 * 128
    report = size_run(model, 4, bandwidth_gbps=100.0)
    assert (report.buffer_elements, report.param_bytes, report.grad_bytes) == (n, 2 * n, 4 * n)
    assert report.state_bytes == n // 4 * 2 * 4 + 4 * 2  # two fp32 moments of a quarter; rank 0 holds 1.5 weights: 2 step counts
    assert report.master_bytes == n // 4 * 4  # fp32 masters of bf16 params
    rs, ag = report.collectives
    assert (rs["bytes"], rs["ring_bytes_per_rank"], ag["bytes"]) == (4 * n, 3 * n, 2 * n)
    assert rs["ms"] > ag["ms"] > 0  # Inductor's NCCL model: twice the bytes take longer
    remainders = size_run(model, 4, config=fxzero.Config(param_remainders=True, optimizer_state_dtype="bf16"))
    assert (remainders.master_bytes, remainders.state_bytes) == (n // 4 * 2, n // 4 * 2 * 2 + 8)


@pytest.mark.parametrize(("dp", "tp"), [(64, 1), (8, 8)])
def test_llama3_8b_matches_megatrons_bytes_per_param(dp: int, tp: int) -> None:
    """Megatron-LM (docs, distributed optimizer, bf16 params, fp32 grads): 2 + 4 bytes per param on
    every rank, and 12 (fp32 master + two moments) divided by dp."""
    model = _llama3_8b_shapes()
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    report = size_run(model, dp, tp=tp)
    local = report.buffer_elements  # this rank's elements, padding included
    assert report.param_bytes + report.grad_bytes == 6 * local
    steps = 4 * len(list(model.parameters()))  # at most one 4-byte step count per param
    assert 0 <= report.state_bytes + report.master_bytes - 12 * local // dp <= steps
    megatron = (6 + 12 / dp) * 8_030_261_248 / tp
    assert report.total_bytes == pytest.approx(megatron, rel=0.01)  # padding, and 1-dim params whole under tp


def _measured(_: object) -> dict[str, int]:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=256, block_size=64, dim=64, n_layer=2, n_head=4))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model)
    ids = torch.randint(0, 256, (2, 16))
    model(ids, ids).backward()
    opt.step()  # AdamW makes its state
    buffers = sum(b.nbytes for b in opt.buffers)
    return {"buffers": buffers, "state": opt.state_bytes, "scratch": opt.runtime_bytes - buffers}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_prediction_is_what_the_optimizer_allocates(world: int) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import ModelArgs, Transformer

    model = Transformer(ModelArgs(vocab_size=256, block_size=64, dim=64, n_layer=2, n_head=4))
    for rank, measured in enumerate(run_ranks(world, _measured, None)):
        predicted = size_run(model, world, config=fxzero.Config(bucket_size=None), rank=rank)  # one bucket: gloo's default
        assert measured["buffers"] == predicted.param_bytes + predicted.grad_bytes
        assert measured["state"] == predicted.state_bytes + predicted.master_bytes
