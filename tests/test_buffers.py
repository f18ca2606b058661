"""Flat buffers: params become views, shard views are made once and share storage."""

from __future__ import annotations

import pytest
import torch

import fxzero
from fxzero.optim import ParamAndGradBuffer, plan_buckets, shard_buffer


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


@pytest.mark.parametrize("grad_collective", ["reduce_scatter", "all_reduce"])
def test_each_steps_collectives_use_the_shard_views_made_at_construction(
    monkeypatch: pytest.MonkeyPatch, grad_collective: str
) -> None:
    """The shard views are made once and reused on every call (slicing anew would cost dispatcher
    time per bucket per step: ``benchmarks/runtime_overhead.py``): rank 2 of 4's reductions and
    gathers hand torch.distributed the very tensor objects its buckets made at construction, on
    every step, and the values published through them land in the flat buffer."""
    import torch.distributed as dist

    from fxzero.optim.communication.comm import DataParallelGroup
    from fxzero.optim.gradients.grad_reductions import GradReductions
    from fxzero.optim.gradients.reduction import reduction_for
    from fxzero.optim.params.param_sync import PlainGather

    handed: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def record(kind: str):  # a collective that records what it is handed and returns a finished work
        return lambda out, tensor, *args, **kwargs: handed.append((kind, out, tensor))

    monkeypatch.setattr(dist, "reduce_scatter_single", record("reduce_scatter"))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: handed.append(("all_reduce", tensor, tensor)))
    monkeypatch.setattr(dist, "all_gather_single", record("all_gather"))
    params = make_params((64, 3), (100,), (33,), (5, 5))
    buckets = ParamAndGradBuffer(params, plan_buckets(params, dp_size=4, bucket_size=150), grad_dtype=None).buckets
    dp = DataParallelGroup(None, 4, 2, grad_collective, backend="nccl")
    reductions = GradReductions(buckets, dp, None, reduction_for(buckets, dp, ()))  # type: ignore[arg-type]
    gather = PlainGather(buckets, dp)
    expected = []
    for bucket in buckets:
        reduced = (bucket.grad_shards[2], bucket.grad_data) if grad_collective == "reduce_scatter" else (bucket.grad_data,) * 2
        expected += [(grad_collective, *reduced), ("all_gather", bucket.param_data, bucket.param_shards[2])]
    for step in range(2):
        handed.clear()
        for index, bucket in enumerate(buckets):
            reductions.launch(range(index, index + 1))
            gather.publish(index, torch.full_like(bucket.param_shards[2], float(step)))
            gather.launch(index)
        assert [(kind, id(out), id(t)) for kind, out, t in handed] == [(kind, id(out), id(t)) for kind, out, t in expected]
        assert all(bucket.param_shards[2].eq(step).all() for bucket in buckets)


def test_grad_dtype_and_param_dtype_groups() -> None:
    params = make_params((4, 4), dtype=torch.bfloat16)
    buffer = ParamAndGradBuffer(params, plan_buckets(params, dp_size=1, bucket_size=None), grad_dtype=torch.float32)
    assert buffer.param_data.dtype == torch.bfloat16 and buffer.grad_data.dtype == torch.float32
    assert params[0].main_grad.dtype == torch.float32


def test_optimizer_groups_params_by_dtype_into_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    assert [b.param_dtype for b in opt.buffers] == [torch.float32, torch.bfloat16]
    assert [b.index for b in opt.runtime.buckets] == list(range(len(opt.runtime.buckets)))
    # bf16 params keep separate fp32 main shards; fp32 params are their own mains
    assert [s.main_is_param for s in opt.runtime.shards] == [True, False]
    assert opt.runtime.shards[1].main.dtype == torch.float32


def _exchange(dp_size: int, rank: int, chunk_bytes: int, slots: int = 2):
    from fxzero.optim.communication.comm import DataParallelGroup
    from fxzero.optim.gradients.grad_exchange import GradExchange

    params = make_params((200,), (64,), (3000,), (8,), (200,))
    plan = plan_buckets(params, dp_size=dp_size, bucket_size=150)
    buckets = ParamAndGradBuffer(params, plan, grad_dtype=torch.bfloat16).buckets
    dp = DataParallelGroup(None, dp_size, rank, "all_to_all")
    return buckets, GradExchange(buckets, dp, chunk_bytes=chunk_bytes, slots=slots)


def test_exchange_scratch_is_its_slots_whatever_the_bucket_sizes() -> None:
    buckets, small = _exchange(4, 2, chunk_bytes=256)
    largest = max(b.grad_data.nbytes for b in buckets)
    assert largest > 2 * 3 * 256  # the old receive buffers: two of the largest bucket
    wide = 256 // 2 * 4  # bf16 grads: the fp32 accumulator of one chunk
    assert small.nbytes == 2 * 3 * 256 + wide  # slots x (dp - 1) rows x chunk bytes
    _, one_slot = _exchange(4, 2, chunk_bytes=256, slots=1)
    assert one_slot.nbytes == 3 * 256 + wide
    with pytest.raises(ValueError, match="slots"):
        _exchange(4, 2, chunk_bytes=256, slots=0)


def test_exchange_chunks_send_views_of_the_buffer_and_receive_into_the_slots() -> None:
    buckets, ex = _exchange(4, 2, chunk_bytes=256)
    slots = [m.data_ptr() for m in ex._memory]
    for bucket, chunks in zip(buckets, ex.chunks):
        own = bucket.grad_shards[2]
        assert sum(c.own.numel() for c in chunks) == own.numel()
        assert all(c.own.numel() <= 128 for c in chunks)  # 256 bytes of bf16
        for chunk in chunks:
            offset = chunk.own.data_ptr() - own.data_ptr()
            # round s sends rank (2 + s) % 4 the same range of its shard, a view of the bucket
            sent_to = [(2 + s) % 4 for s in range(1, 4)]
            assert [v.data_ptr() - bucket.grad_shards[q].data_ptr() for (v, _), q in zip(chunk.sends, sent_to)] == [offset] * 3
            assert [splits for _, splits in chunk.sends] == [[0] * q + [chunk.own.numel()] + [0] * (3 - q) for q in sent_to]
            for slot, rows in enumerate(chunk.receives):
                assert {v.untyped_storage().data_ptr() for v, _ in rows} == {ex._memory[slot].data_ptr()}
            # rows in rank order: from ranks 0, 1 (before this rank, 2), then 3
            received_from = [(2 - s) % 4 for s in range(1, 4)]
            assert chunk.before == 2
            assert [r.data_ptr() for r in chunk.rows[0]] == [chunk.receives[0][received_from.index(q)][0].data_ptr() for q in (0, 1, 3)]
    assert len(set(slots)) == 2


def test_exchange_sums_in_rank_order_in_place() -> None:
    from fxzero.optim.gradients.grad_exchange import _sum_in_rank_order

    # float32 addition is not associative here: only rank order gives (1e8 + 1) - 1e8 + 1 = 1 ... exactly
    copies = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    expected = ((copies[0] + copies[1]) + copies[2]) + copies[3]
    for rank in range(4):
        own = copies[rank].clone()
        rows = [copies[q].clone() for q in range(4) if q != rank]
        _sum_in_rank_order(own, rows, before=rank)
        assert own.item() == expected.item(), rank
    assert ((copies[0] + copies[2]) + (copies[1] + copies[3])).item() != expected.item()  # the order matters


def test_16_bit_gradients_are_summed_in_fp32_and_rounded_once() -> None:
    """bf16 copies of 4 ranks: the exchange's sum is the fp32 sum in rank order rounded once to
    bf16, closer to the exact sum than a chain of bf16 additions, whose error grows with ranks."""
    from fxzero.optim.gradients.grad_exchange import _sum_in_rank_order

    copies = [torch.randn(4096, generator=torch.Generator().manual_seed(q)).to(torch.bfloat16) for q in range(4)]
    exact = sum(c.double() for c in copies)
    wide = torch.empty(4096, dtype=torch.float32)
    for rank in range(4):
        own, rows = copies[rank].clone(), [copies[q].clone() for q in range(4) if q != rank]
        chained = own.clone()
        _sum_in_rank_order(chained, [r.clone() for r in rows], before=rank)
        _sum_in_rank_order(own, rows, before=rank, acc=wide)
        in_order = ((copies[0].float() + copies[1].float()) + copies[2].float()) + copies[3].float()
        assert torch.equal(own, in_order.to(torch.bfloat16)), rank
        assert (own.double() - exact).abs().sum() < (chained.double() - exact).abs().sum(), rank


def _bf16_grads_by(collective: str) -> list[torch.Tensor]:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    config = fxzero.Config(grad_dtype=torch.bfloat16, grad_collective=collective, bucket_size=4000)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model, config=config)
    for step in range(3):
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_16_bit_exchange_at_two_ranks_trains_bitwise_like_the_16_bit_reduce_scatter() -> None:
    """The exchange's fp32 accumulator in a real step: at 2 ranks one add rounds once either way."""
    from fxzero.testing import run_ranks

    exchanged, scattered = (run_ranks(2, _bf16_grads_by, collective, timeout=200) for collective in ("all_to_all", "reduce_scatter"))
    for a, b in zip(exchanged, scattered):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _TinyParams(torch.nn.Module):
    """1,000 params of 4 elements (per-channel scales, gates, LoRA-like vectors) and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(1000))
        self.proj = torch.nn.Linear(4, 80)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ torch.stack(list(self.scales)).T).square().mean() + self.proj(x).square().mean()


def test_many_tiny_params_train_bitwise_like_adamw_in_their_own_size() -> None:
    import copy

    model = _TinyParams()
    reference = copy.deepcopy(model)
    opt = fxzero.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, module=model, config=fxzero.Config(overlap_param_gather=False)
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    (buffer,) = opt.buffers
    # bias 80 at 0, weight 320 at 128, the scales packed from 448 on; 64,448 with 64-element starts
    assert buffer.param_data.numel() == 4480
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
