"""Flat buffers: params become views, shard views are made once and share storage."""

from __future__ import annotations

import pytest
import torch

import fxzero
from fxzero import ParamAndGradBuffer, plan_buckets, shard_buffer


def make_params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def test_shard_buffer_returns_views_at_exact_offsets() -> None:
    buf = torch.arange(24.0)
    shards = shard_buffer(buf, 4)
    assert [s.tolist() for s in shards] == [list(map(float, range(6 * r, 6 * r + 6))) for r in range(4)]
    for rank, shard in enumerate(shards):
        assert shard.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert shard.data_ptr() == buf.data_ptr() + rank * 6 * buf.element_size()
    shards[1].fill_(-1)
    assert buf[6:12].eq(-1).all()
    with pytest.raises(ValueError, match="not divisible"):
        shard_buffer(torch.zeros(10), 4)


def test_params_become_views_of_param_data_with_values_kept() -> None:
    params = make_params((3, 5), (7,), (2, 2, 2))
    before = [p.detach().clone() for p in params]
    plan = plan_buckets(params, dp_size=2, bucket_size=20)
    buffer = ParamAndGradBuffer(params, plan, grad_dtype=torch.float32)
    base = buffer.param_data.data_ptr()
    for param, value, (start, end, _) in zip(params, before, plan.param_ranges):
        assert torch.equal(param.detach(), value)
        assert param.data_ptr() == base + start * 4
        assert param.main_grad.data_ptr() == buffer.grad_data.data_ptr() + start * 4
        assert param.main_grad.shape == param.shape
    # padding reads as zeros in both buffers
    used = torch.zeros(plan.numel, dtype=torch.bool)
    for start, end, _ in plan.param_ranges:
        used[start:end] = True
    assert buffer.param_data[~used].eq(0).all() and buffer.grad_data.eq(0).all()


def test_bucket_shard_views_share_storage_with_their_bucket() -> None:
    params = make_params((64, 3), (100,), (33,), (5, 5))
    plan = plan_buckets(params, dp_size=4, bucket_size=150)
    buffer = ParamAndGradBuffer(params, plan, grad_dtype=None)
    assert len(buffer.buckets) >= 2
    for bucket, spec in zip(buffer.buckets, plan.buckets):
        size = spec.numel // 4
        for data, shards in ((bucket.param_data, bucket.param_shards), (bucket.grad_data, bucket.grad_shards)):
            for rank, shard in enumerate(shards):
                assert shard.numel() == size
                assert shard.data_ptr() == data.data_ptr() + rank * size * data.element_size()
                assert shard.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        assert bucket.grad_data.data_ptr() == buffer.grad_data.data_ptr() + spec.start * 4
        assert bucket.param_data.data_ptr() == buffer.param_data.data_ptr() + spec.start * 4
        # the shard views are the very same objects every time they are fetched (made once)
        assert bucket.grad_shards[1] is bucket.grad_shards[1]


def test_grad_dtype_and_param_dtype_groups() -> None:
    params = make_params((4, 4), dtype=torch.bfloat16)
    buffer = ParamAndGradBuffer(params, plan_buckets(params, dp_size=1, bucket_size=None), grad_dtype=torch.float32)
    assert buffer.param_data.dtype == torch.bfloat16 and buffer.grad_data.dtype == torch.float32
    assert params[0].main_grad.dtype == torch.float32


def test_optimizer_groups_params_by_dtype_into_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    assert [b.param_dtype for b in opt.buffers] == [torch.float32, torch.bfloat16]
    assert [b.index for b in opt.buckets] == list(range(len(opt.buckets)))
    # bf16 params keep separate fp32 main shards; fp32 params are their own mains
    assert [s.main_is_param for s in opt.shards] == [True, False]
    assert opt.shards[1].main.dtype == torch.float32


def test_receive_ring_takes_turns_in_two_buffers_sized_for_the_largest_bucket() -> None:
    from fxzero.optim.buffers import ReceiveRing

    params = make_params((200,), (64,), (300,), (8,), (200,))
    plan = plan_buckets(params, dp_size=4, bucket_size=150)
    buckets = ParamAndGradBuffer(params, plan, grad_dtype=torch.bfloat16).buckets
    assert len(buckets) >= 3
    ring = ReceiveRing(buckets, dp_size=4)
    largest = max(b.grad_data.nbytes for b in buckets)
    assert ring.slots == 2 and ring.nbytes == 2 * largest
    starts = [v.data_ptr() for v in ring.views]
    for i, (bucket, view, rows) in enumerate(zip(buckets, ring.views, ring.rows)):
        assert view.dtype == torch.bfloat16 and view.shape == (4, bucket.grad_shards[0].numel())
        assert starts[i] == starts[i % 2] and (i < 2 or starts[i] != starts[1 - i % 2])
        assert [r.data_ptr() for r in rows] == [view[r].data_ptr() for r in range(4)]
    assert len(ReceiveRing(buckets[:1], dp_size=4).views) == 1  # one bucket: one buffer
    with pytest.raises(ValueError, match="slots"):
        ReceiveRing(buckets, dp_size=4, slots=0)


def test_sum_received_adds_rows_in_rank_order_into_the_shard() -> None:
    from fxzero.optim.comm import DataParallelGroup

    rows = torch.arange(12.0).view(3, 4).unbind(0)
    shard = torch.full((4,), 99.0)
    DataParallelGroup.sum_received(shard, rows)
    assert shard.tolist() == [12.0, 15.0, 18.0, 21.0]
