"""``fxzero explain --size`` (:func:`fxzero.explainer.sizing.size_run`): bytes per rank derived by
hand for a layout with no padding, Megatron-LM's bytes-per-param formula on Llama-3-8B's shapes,
the prediction against the buffers, state and scratch a real DistributedOptimizer allocates at world 2
and 4 (the main job's GPT, ``examples/train_gpt.py``), activations derived by hand for a small MLP, and
the predicted peak per rank against the peak of torch's allocated bytes in real training steps."""

from __future__ import annotations

import sys
from typing import Any
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxzero
from fxzero.explainer.activations import estimate_activations
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
    longest_run = max(remainders.buckets) // 4  # a run lies in one bucket's shard (and MAX_RUN_NUMEL is larger here)
    # fxzero's own AdamW keeps its step counts in Python: no tensor bytes for them
    assert (remainders.master_bytes, remainders.state_bytes) == (n // 4 * 2 + 4 * longest_run, n // 4 * 2 * 2)
    # each moment in its own dtype: a bf16 first moment beside an fp32 second one
    mixed = size_run(model, 4, config=fxzero.Config(exp_avg_dtype="bf16"))
    assert mixed.state_bytes == n // 4 * (2 + 4)
    # fp8: codes padded to blocks of 32 per run, a 1-byte exponent (first) or 2-byte scale (second) per block;
    # the runs here are whole weights (multiples of 32) cut at the shard's ends (multiples of 32 too)
    fp8 = size_run(model, 4, config=fxzero.Config(optimizer_state_dtype="fp8"))
    assert fp8.state_bytes == n // 4 * 2 + n // 4 // 32 * (1 + 2)


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


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_activations_of_a_small_mlp_derived_by_hand(device: str) -> None:
    """Linear(16, 32) -> ReLU -> Linear(32, 4), no biases, batch 8, fp32, backward from the sum.
    When the forward returns, alive: ReLU's output r (8 x 32 x 4 = 1024 bytes, saved for its
    backward and the second matmul's), the output (8 x 4 x 4 = 128) and the sum (4); the first
    matmul's output died when ReLU replaced it. The backward's peak, at ReLU's backward: r, the
    sum, its gradient (4: a ones scalar, expanded as a view), r's gradient (1024) and the
    first matmul's output's gradient (1024); the output and the weights' gradients are gone
    (dropped once accumulated, as fxzero hands them to its buffer)."""
    with torch.device(device):
        model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))
        x = torch.empty(8, 16)
    estimate = estimate_activations(model, (x,))
    assert estimate.saved_bytes == 1024 + 128 + 4
    assert estimate.peak_bytes == 1024 + 4 + 4 + 1024 + 1024
    assert estimate.inputs == "(8, 16) float32"
    assert all(p.grad is None for p in model.parameters())  # the model's own params were not touched


def test_a_forward_that_reads_values_is_one_error_naming_the_way_out() -> None:
    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w * x[: int(x.sum().item())]

    with pytest.raises(RuntimeError, match="could not run on fake tensors .* without example inputs"):
        estimate_activations(ReadsValues(), (torch.ones(3),))


_PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16 state": {"optimizer_state_dtype": "bf16"},
    "fp8 state": {"optimizer_state_dtype": "fp8"},
    "fp8 second moment": {"exp_avg_sq_dtype": "fp8"},
    "bf16 state, compiled": {"optimizer_state_dtype": "bf16", "compiled_update": True},
    "remainders, bf16 params": {"param_remainders": True, "optimizer_state_dtype": "fp8", "bf16": True},
}


def _gpt(bf16: bool = False) -> torch.nn.Module:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=256, block_size=64, dim=64, n_layer=2, n_head=4))
    return model.to(torch.bfloat16) if bf16 else model


def _measured(options: dict[str, Any]) -> dict[str, int]:
    options = dict(options)
    model = _gpt(options.pop("bf16", False))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model, config=fxzero.Config(**options))
    ids = torch.randint(0, 256, (2, 16))
    model(ids, ids).float().backward()
    opt.step()  # AdamW makes its state
    buffers = sum(b.nbytes for b in opt.buffers)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"buffers": buffers, "state": opt.state_bytes, "scratch": opt.runtime_bytes - buffers, "rank": rank}


@pytest.mark.parametrize("precision", sorted(_PRECISIONS))
def test_the_state_predicted_in_every_precision_is_what_the_optimizer_allocates(precision: str) -> None:
    """fxzero's own AdamW keeps its moments per run (fp8 in blocks of 32 with their scales): at world 1."""
    options = _PRECISIONS[precision]
    measured = _measured(options)
    config = fxzero.Config(**{k: v for k, v in options.items() if k != "bf16"})
    predicted = size_run(_gpt(options.get("bf16", False)), 1, transport="gloo", config=config)
    assert measured["state"] == predicted.state_bytes + predicted.master_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_prediction_is_what_the_optimizer_allocates(world: int) -> None:
    model = _gpt()
    for options in ({}, _PRECISIONS["fp8 state"]):  # fp8: each rank's runs cut at its shard's ends
        for measured in run_ranks(world, _measured, options):
            predicted = size_run(model, world, transport="gloo", rank=measured["rank"], config=fxzero.Config(**options))
            assert measured["buffers"] == predicted.param_bytes + predicted.grad_bytes
            assert measured["state"] == predicted.state_bytes + predicted.master_bytes, (options, measured["rank"])
            slots = 4 * (world - 1) * 2**20  # 4 receive slots of a 1 MiB chunk from each other rank
            assert measured["scratch"] == predicted.exchange_bytes == slots


def _size_check():
    """benchmarks/size_check.py, imported on a rank too (a reused rank pool has the sys.path it started with)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import size_check

    return size_check


def _peak_on_rank(args: dict, batch: tuple[int, int]) -> dict:
    return _size_check().work(args, batch, 2)


@pytest.mark.slow
def test_predicted_peak_is_within_10_percent_of_the_allocated_peak_of_training_steps() -> None:
    """Measured: the most bytes torch's allocator held at once (the profiler's memory records,
    every tensor from before the model is built) in the forward, backward and step of two eager
    steps on 2 gloo ranks; predicted on the meta device with the same per-rank batch."""
    args = dict(vocab_size=256, block_size=64, dim=64, n_layer=2, n_head=4)
    for measured in run_ranks(2, _peak_on_rank, args, (4, 64), timeout=300):
        report = _size_check().predicted(args, 2, measured["rank"], (4, 64))
        assert report.activations is not None and report.activations.peak_bytes > 0.2 * report.peak_bytes  # activations matter here
        assert measured["peak"] == pytest.approx(report.peak_bytes, rel=0.10), measured["where"]


def test_cli_sizes_the_activations_of_the_targets_batch_or_of_batch_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/size_gpt.py returns a meta GPT and a 2 x 64 batch; ``--batch 4`` doubles the
    batch, so every activation tensor (all have the batch dim) doubles: the peak too."""
    import json

    from fxzero.cli import main

    monkeypatch.chdir(ROOT)
    sizes = {}
    for batch in ([], ["--batch", "4"]):
        out = tmp_path / f"size{len(batch)}.json"
        assert main(["explain", "examples/size_gpt.py", "--size", "--world-size", "2", *batch, "--json", str(out)]) == 0
        sizes[len(batch)] = json.loads(out.read_text())["size"]
    two, four = sizes[0]["activations"], sizes[2]["activations"]
    assert (two["inputs"], four["inputs"]) == ("(2, 64) int64, (2, 64) int64", "(4, 64) int64, (4, 64) int64")
    assert four["saved_bytes"] == pytest.approx(2 * two["saved_bytes"], rel=0.01)
    assert sizes[0]["peak_bytes"] == sizes[0]["total_bytes"] + two["peak_bytes"]
