"""``fxzero explain --size``: the memory per rank and the bytes on the wire of a run, without running it.

Why: the first question about a run ("will it fit, and what will it cost on the wire?")
should not need the machines. The bucket layout is pure (:func:`~fxzero.optim.layout.layout.plan_buckets`
works on meta tensors), so this plans the very buffers a :class:`~fxzero.DistributedOptimizer`
would allocate, for any data-parallel size, and adds what its step keeps per rank:

* **param buffer**: every param, in its dtype, padded as the layout pads it (each rank holds
  all params: ZeRO-1 shards only the optimizer);
* **grad buffer**: the same elements in ``Config.grad_dtype`` (fp32 by default);
* **optimizer state**: with fp32 moments, this rank's shard (``padded / shard ranks``) times the
  wrapped optimizer's per-element states (AdamW: 2) in fp32, and a 4-byte step count per param
  fragment the shard holds (torch's Adam keeps ``step`` as a tensor). With a narrow moment
  (``Config.optimizer_state_dtype``, ``exp_avg_dtype`` / ``exp_avg_sq_dtype``) or remainders, fxzero's own
  AdamW keeps each moment per run of adjacent fragments (one param group assumed): fp32 or bf16
  elements, or fp8 codes padded to whole blocks of 32 with one scale per block (the first moment's
  1-byte exponent, the second's 2-byte scale), step counts in Python;
* **fp32 masters**: of the shard, when params are not fp32 (int16 remainders with
  ``param_remainders``, and the fp32 scratch the step rebuilds one run's master in: at most one
  bucket's shard and :data:`~fxzero.optim.update.flat_update.MAX_RUN_NUMEL` elements, counted at that bound);
* **gather scratch**: 0, fxzero gathers into the param buffer in place (MXFP8 is not sized here);
* **gradient exchange scratch** (``transport="gloo"``): the chunked all-to-all's receive slots
  (:mod:`~fxzero.optim.gradients.grad_exchange`: ``SLOTS`` x ``(dp - 1)`` x ``CHUNK_BYTES``, and an
  fp32 accumulator for 16-bit grads); NCCL reduces in place and needs none;
* **activations** (with an :class:`~fxzero.explainer.activations.ActivationEstimate`): the peak
  of what one forward+backward on the rank's batch keeps alive on top of the model states, so
  the **peak per rank** is the model states plus it (the peak comes in a backward after the
  first step, when the optimizer state exists).

Tensor parallelism (``tp``) is modelled as Megatron-LM splits a transformer: each weight of 2 or
more dims is cut in ``tp`` (rounded up), 1-dim params (norms, biases) are whole on every rank.
Collective bytes are per step and per rank: each bucket's reduce-scatter reads its grad bucket,
each all-gather writes its param bucket, and a ring moves ``(n - 1) / n`` of that over each
rank's link. With a bandwidth, each collective's time is Inductor's NCCL model
(``torch._inductor.comm_analysis``, through :mod:`fxzero._torch_compat`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from .._torch_compat import nccl_collective_ms
from ..config import Config
from ..optim.gradients.grad_exchange import CHUNK_BYTES, SLOTS
from ..optim.layout.layout import plan_buckets, shard_fragments
from ..optim.update.flat_update import MAX_RUN_NUMEL, Place, plan_runs
from ..optim.update.moment_store import moment_nbytes
from .activations import ActivationEstimate

__all__ = ["SizeReport", "size_run"]


def _own_update_bytes(plans: list[tuple[torch.dtype, Any]], rank: int, first: str, second: str, remainders: bool) -> tuple[int, int]:
    """(moments, remainders) of fxzero's own update on ``rank``: kept per run of adjacent fragments
    (as :class:`~fxzero.optim.update.shard_adam.ShardAdamW` plans them, for one param group), step counts
    in Python, not tensors."""
    moments = kept = 0
    for storage, (dtype, plan) in enumerate(plans):
        places = []
        for frag in shard_fragments(plan, rank):
            bucket = plan.buckets[frag.bucket_id]
            offset = bucket.start + rank * bucket.shard_numel(plan.dp_size) + frag.shard_offset
            places.append(Place(storage, storage, 0, frag.bucket_id, offset, offset, frag.numel))
        for run in plan_runs(places):
            numel = run.stop - run.start
            moments += moment_nbytes(first, numel, second=False) + moment_nbytes(second, numel, second=True)
            kept += 2 * numel if remainders and dtype == torch.bfloat16 else 0
    return moments, kept


@dataclasses.dataclass(frozen=True)
class SizeReport:
    """Bytes per rank and per step of one run's setup (``rows()`` for the table, ``as_data()`` for JSON)."""

    model: str
    params: int
    """Param elements of the whole model (before tensor parallelism)."""
    dp: int
    tp: int
    instances: int
    buffer_elements: int
    """Elements of this rank's flat buffers (its TP part, padded)."""
    buckets: tuple[int, ...]
    """Each bucket's padded elements."""
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    master_bytes: int
    scratch_bytes: int
    collectives: tuple[dict[str, Any], ...]
    exchange_bytes: int = 0
    """The gloo gradient exchange's receive slots (0 on NCCL)."""
    transport: str = "nccl"
    activations: Optional[ActivationEstimate] = None
    """One forward+backward's activations on the rank's batch, when example inputs were given."""

    @property
    def shard_ranks(self) -> int:
        return self.dp // self.instances

    @property
    def total_bytes(self) -> int:
        """The model states per rank: buffers, optimizer state, masters and scratch."""
        states = self.param_bytes + self.grad_bytes + self.state_bytes + self.master_bytes
        return states + self.scratch_bytes + self.exchange_bytes

    @property
    def peak_bytes(self) -> Optional[int]:
        """The model states plus the activation peak; ``None`` without an activation estimate."""
        return None if self.activations is None else self.total_bytes + self.activations.peak_bytes

    def rows(self) -> list[tuple[str, int]]:
        rows = [("params (flat param buffer)", self.param_bytes), ("grads (flat grad buffer)", self.grad_bytes),
                ("optimizer state (this rank's shard)", self.state_bytes), ("fp32 masters (this rank's shard)", self.master_bytes),
                ("gather scratch", self.scratch_bytes)]  # fmt: skip
        if self.transport == "gloo":
            rows.append(("gradient exchange scratch (gloo)", self.exchange_bytes))
        rows.append(("total", self.total_bytes))
        if self.activations is not None and self.peak_bytes is not None:
            rows += [("activations saved by forward", self.activations.saved_bytes),
                     ("activations, forward+backward peak", self.activations.peak_bytes),
                     ("peak (total + activation peak)", self.peak_bytes)]  # fmt: skip
        return rows

    def as_data(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(buckets=list(self.buckets), collectives=list(self.collectives), total_bytes=self.total_bytes)
        data.update(activations=None if self.activations is None else self.activations.as_data(), peak_bytes=self.peak_bytes)
        data["bytes_per_param"] = self.total_bytes / self.params * self.tp if self.params else 0.0
        return data

    def text(self) -> str:
        head = (f"fxzero explain --size: {self.model}, {self.params:,} params; dp {self.dp} ({self.instances} instance"
                f"{'s' * (self.instances != 1)} of {self.shard_ranks} shard ranks), tp {self.tp}; "
                f"{len(self.buckets)} bucket{'s' * (len(self.buckets) != 1)}, {self.buffer_elements:,} buffer elements per rank")  # fmt: skip
        lines = [head, ""]
        if self.activations is not None:
            lines += [f"activations: one eager forward+backward on fake tensors of the batch {self.activations.inputs}", ""]
        lines.append(f"{'memory per rank':<40}{'bytes':>18}{'GiB':>10}")
        lines += [f"{name:<40}{value:>18,}{value / 2**30:>10.2f}" for name, value in self.rows()]
        per_param = self.total_bytes / (self.params / self.tp) if self.params else 0.0
        lines += [f"{'bytes per param (this rank, total / (params / tp))':<58}{per_param:>10.2f}", ""]
        lines.append(f"{'collectives per step':<34}{'count':>6}{'bytes (buffers)':>20}{'ring bytes/rank':>20}{'ms':>10}")
        for c in self.collectives:
            ms = "-" if c["ms"] is None else f"{c['ms']:.2f}"
            lines.append(f"{c['op']:<34}{c['count']:>6}{c['bytes']:>20,}{c['ring_bytes_per_rank']:>20,}{ms:>10}")
        return "\n".join(lines) + "\n"


def _local_numel(param: torch.Tensor, tp: int) -> int:
    if tp == 1 or param.dim() < 2:
        return param.numel()
    return math.ceil(param.shape[0] / tp) * math.prod(param.shape[1:])


def _stand_ins(model: torch.nn.Module, tp: int) -> list[torch.Tensor]:
    """What the planner sees: each trainable param's TP part as a flat meta tensor, tied params once."""
    out = []
    for param in model.parameters():
        if param.requires_grad:
            stand_in = torch.empty(_local_numel(param, tp), dtype=param.dtype, device="meta")
            if getattr(param, "shared_embedding", False):
                stand_in.shared_embedding = True  # type: ignore[attr-defined]
            out.append(stand_in)
    return out


def _plans(params: list[torch.Tensor], shard_ranks: int, config: Config, transport: str) -> list[tuple[torch.dtype, Any]]:
    """One plan per param dtype, in order of first appearance (as :func:`build_buffers` groups them)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    size = config.resolved_bucket_size(shard_ranks, transport)
    return [(dtype, plan_buckets(group, dp_size=shard_ranks, bucket_size=size, pad_for_high_busbw=config.pad_for_high_busbw,
                                 shard_multiple=1, grad_dtype=config.grad_dtype)) for dtype, group in groups.items()]  # fmt: skip


def _collective(op: str, kind: str, sizes: list[int], ranks: int, bandwidth: Optional[float]) -> dict[str, Any]:
    ring = sum(s * (ranks - 1) // ranks for s in sizes)
    ms = None if bandwidth is None else sum(nccl_collective_ms(s, ranks, kind, bandwidth) for s in sizes)
    return {"op": op, "count": len(sizes), "bytes": sum(sizes), "ring_bytes_per_rank": ring, "ms": ms}


def _exchange_bytes(transport: str, shard_ranks: int, config: Config, plans: list[tuple[torch.dtype, Any]]) -> int:
    """The gloo exchange's receive slots, and its fp32 accumulator when a grad is 16-bit."""
    if transport != "gloo" or shard_ranks < 2:
        return 0
    narrow = any((config.grad_dtype or dtype) in (torch.bfloat16, torch.float16) for dtype, _ in plans)
    return SLOTS * (shard_ranks - 1) * CHUNK_BYTES + (CHUNK_BYTES // 2 * 4 if narrow else 0)


def size_run(model: torch.nn.Module, dp: int, *, tp: int = 1, instances: int = 1, config: Optional[Config] = None,
             states_per_element: int = 2, step_bytes: int = 4, bandwidth_gbps: Optional[float] = None,
             rank: int = 0, transport: str = "nccl", activations: Optional[ActivationEstimate] = None) -> SizeReport:  # fmt: skip
    """Size a run of ``model`` (real or on the meta device) over ``dp`` data-parallel ranks in
    ``instances`` optimizer instances, each rank holding a ``tp``-th of each matrix.

    Args:
        model: the module whose trainable params are laid out (their data is not read).
        dp: data-parallel ranks.
        tp: tensor-parallel ranks per data-parallel rank.
        instances: optimizer instances the ``dp`` ranks form (``dp`` a multiple of it).
        config: the optimizer's :class:`~fxzero.Config` (bucket size, dtypes); default ``Config()``.
        states_per_element: the wrapped optimizer's states per param element (AdamW 2, SGD with
            momentum 1).
        step_bytes: its per-param step count's bytes (0 for SGD).
        bandwidth_gbps: per-link bandwidth (GB/s) for the predicted times.
        rank: whose shard (the fragments, hence the step counts, differ by a few bytes between ranks).
        transport: ``"nccl"`` or ``"gloo"``: the default bucket size, and gloo's exchange scratch.
        activations: :func:`~fxzero.explainer.activations.estimate_activations`' result, for the peak.

    Returns:
        The bytes per rank and per step.

    Raises:
        ValueError: ``dp``, ``tp`` or ``instances`` below 1, ``dp`` not a multiple of ``instances``,
            an unknown ``transport``, or MXFP8 param gathers in ``config`` (not sized).
    """
    config = config or Config()
    if dp < 1 or tp < 1 or instances < 1 or dp % instances:
        raise ValueError(f"size: dp ({dp}), tp ({tp}) and instances ({instances}) must be >= 1, dp a multiple of instances")
    if transport not in ("nccl", "gloo"):
        raise ValueError(f"size: transport must be 'nccl' or 'gloo', got {transport!r}")
    if config.mxfp8_param_gather:
        raise ValueError("size: MXFP8 param gathers are not sized (their scratch depends on the gather); size without it")
    shard_ranks = dp // instances
    params = _stand_ins(model, tp)
    plans = _plans(params, shard_ranks, config, transport)
    grad_item = lambda dtype: (config.grad_dtype or dtype).itemsize  # noqa: E731
    buckets = [b.numel for _, plan in plans for b in plan.buckets]
    param_bytes = sum(plan.numel * dtype.itemsize for dtype, plan in plans)
    grad_bytes = sum(plan.numel * grad_item(dtype) for dtype, plan in plans)
    shard = {dtype: plan.numel // shard_ranks for dtype, plan in plans}
    first, second = config.moment_dtypes  # each Adam moment in its own dtype (exp_avg_dtype / exp_avg_sq_dtype)
    if config.param_remainders or (first, second) != ("fp32", "fp32"):  # fxzero's own AdamW, per run
        state, kept = _own_update_bytes(plans, rank % shard_ranks, first, second, config.param_remainders)
    else:
        state = sum(n * states_per_element * 4 for n in shard.values())
        state += step_bytes * sum(len(shard_fragments(plan, rank % shard_ranks)) for _, plan in plans)
        kept = 0
    masters = kept + sum(n * 4 for dtype, n in shard.items() if dtype != torch.float32 and not (config.param_remainders and dtype == torch.bfloat16))
    if config.param_remainders and any(dtype == torch.bfloat16 for dtype in shard):  # the step's fp32 scratch: one run at most
        masters += 4 * min(MAX_RUN_NUMEL, max(b.numel // shard_ranks for dtype, plan in plans if dtype == torch.bfloat16 for b in plan.buckets))
    grad_sizes = [b.numel * grad_item(dtype) for dtype, plan in plans for b in plan.buckets]
    param_sizes = [b.numel * dtype.itemsize for dtype, plan in plans for b in plan.buckets]
    collectives = []
    if shard_ranks > 1:
        collectives.append(_collective("reduce_scatter (grads)", "reduce_scatter", grad_sizes, shard_ranks, bandwidth_gbps))
        collectives.append(_collective("all_gather (params)", "all_gather", param_sizes, shard_ranks, bandwidth_gbps))
    if instances > 1:
        shards = [s // shard_ranks for s in grad_sizes]
        collectives.append(_collective("all_reduce (shards, over instances)", "all_reduce", shards, instances, bandwidth_gbps))
    elements = sum(plan.numel for _, plan in plans)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return SizeReport(type(model).__name__, total, dp, tp, instances, elements, tuple(buckets), param_bytes, grad_bytes,
                      state, masters, 0, tuple(collectives), _exchange_bytes(transport, shard_ranks, config, plans),
                      transport, activations)  # fmt: skip
