"""Memory fxzero adds around its buffers: communication scratch is a small constant.

The peak-memory comparison with DDP, ZeroRedundancyOptimizer and FSDP2 is
``benchmarks/memory.py`` (minutes); these tests pin the mechanisms it relies on.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.gradients import grad_exchange
from fxzero.testing import run_ranks


def _status_mib(key: str) -> float:
    """``VmHWM`` (peak resident set since the last reset) or ``VmRSS``, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def _gloo_communication(bucket_size: object) -> dict:
    """One 12M-element bucket (48 MiB of fp32, above glibc's mmap threshold, so a temporary
    of its size shows in the resident set): the peak RSS the gradient reduction and the
    param gather add, after one warm-up round."""
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(3)])
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=bucket_size))
    for p in model.parameters():
        p.main_grad.normal_()

    def communicate() -> None:
        opt.runtime.reductions.finish()
        opt.runtime.ledger.start_step()
        opt.start_param_sync()
        opt.finish_param_sync()

    communicate()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_mib("VmRSS")
    communicate()
    reduction = opt.runtime.reductions.reduction
    exchange = reduction if isinstance(reduction, grad_exchange.GradExchange) else None
    return {
        "added_mib": _status_mib("VmHWM") - before,
        "buckets": len(opt.runtime.buckets),
        "largest_mib": max(b.grad_data.nbytes for b in opt.runtime.buckets) / 2**20,
        "exchange_bytes": exchange.nbytes if exchange is not None else None,
        "runtime_extra": opt.runtime_bytes - sum(b.nbytes for b in opt.buffers),
        "bucket_size": opt.config.resolved_bucket_size(opt.dp.size, opt.dp.backend),
    }


def test_gloo_reduction_and_gather_add_no_scratch_of_the_buckets_size() -> None:
    """gloo's all-gather copied through a temporary of the whole bucket, and the all-to-all
    received into two buffers of the largest bucket: now the gather broadcasts in place
    and the all-to-all runs in chunks through 4 receive slots of 1 MiB per peer."""
    for result in run_ranks(2, _gloo_communication, None):
        assert result["buckets"] == 1 and result["largest_mib"] == 48
        assert result["exchange_bytes"] == grad_exchange.SLOTS * grad_exchange.CHUNK_BYTES == 4 * 2**20
        assert result["runtime_extra"] == result["exchange_bytes"]  # nothing else beside the buffers
        assert result["added_mib"] < 4, result


def test_default_bucket_size_on_gloo() -> None:
    for result in run_ranks(2, _gloo_communication, "auto"):
        assert result["bucket_size"] == fxzero.default_bucket_size(2, "gloo") == 4_000_000
        assert result["buckets"] == 3  # one 4M-element weight each


def _construction_peak() -> dict:
    """Peak RSS the optimizer's construction adds over a model of three 16 MiB weights. glibc's
    mmap threshold is fixed first (as ``benchmarks/memory.py`` does), so a freed tensor leaves
    the resident set: otherwise a pool process that already freed large blocks keeps them in
    its heap, and RSS shows the allocator's history instead of the tensors held."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, no dynamic raise
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # its first use imports torch._dynamo (~27 MiB)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(3)])
    params_mib = sum(p.nbytes for p in model.parameters()) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_mib("VmRSS")
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, config=fxzero.Config(bucket_size=None))
    return {"added_mib": _status_mib("VmHWM") - before, "params_mib": params_mib, "buffers_mib": opt.runtime_bytes / 2**20}


def test_construction_peaks_at_two_copies_of_the_params() -> None:
    """The params move into their flat buffer (their old storages freed) before the grad
    buffer exists: construction adds one model's worth at its peak (the new param buffer,
    then the grad buffer), not two (both buffers beside the old params)."""
    (result,) = run_ranks(1, _construction_peak)
    assert result["params_mib"] == 48 and result["buffers_mib"] == 96, result
    assert result["added_mib"] < 1.3 * result["params_mib"], result
