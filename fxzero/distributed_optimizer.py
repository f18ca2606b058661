"""ZeRO-1 distributed optimizer over flat, bucketed param/grad buffers.

A step has three communication phases, all on buffers laid out once at construction:

1. **reduce-scatter** (launched during backward when :class:`~fxzero.optim.gradients.ledger.Ledger` says a bucket is ready,
   finished at the top of :meth:`DistributedOptimizer.step`): each bucket's ``grad_data``
   is averaged over ranks into this rank's pre-made shard view of it;
2. **shard update**: one small all-reduce carries each param's squared grad norm over
   this rank's fragments and a "got a gradient" flag; then the wrapped ``torch.optim``
   optimizer updates the fp32 main fragments of this rank's shards only (1/dp of the
   optimizer state per rank), skipping params that got no gradient on any rank and the
   whole update when the global norm is not finite. Under whole-param ownership
   (``Config.state_sharding``, :mod:`fxzero.optim.layout.ownership`) a rank's shard holds whole
   params, and the wrapped optimizer sees them in their own shapes;
3. **all-gather**: each bucket's updated param shard is gathered back in place into
   ``param_data``, which the model's params are views of. With
   ``Config.mxfp8_param_gather`` the shard is quantized to MXFP8 first and the gather
   moves codes and scales (optionally landing in the bucket's own grad memory,
   ``reuse_grad_buf_for_mxfp8_param_ag``), then each bucket is dequantized into the
   params right before its first read (:mod:`fxzero.mxfp8.gather`).

Padding exists so every bucket splits into dp equal, aligned shards; it is zero in both
buffers, is never handed to the wrapped optimizer, and is excluded from the norm.
At world size 1 no collective is issued.

Between backward and ``step()`` each managed param's ``.grad`` is a view of its sharded
gradient (:mod:`fxzero.optim.gradients.grad_views`), so ``clip_grad_norm_``, ``GradScaler`` and
``model.zero_grad()`` act as under DDP. ``step()`` consumes the gradients: the next
backward starts from zeroed buffers whether the loop calls ``opt.zero_grad()``,
``model.zero_grad()`` or neither. Before each update the optimizer checks that the
params are still its views and takes values written into them since into its fp32
masters (:mod:`fxzero.optim.params.param_watch`). At construction every rank checks that all
ranks lay out the same params (:mod:`fxzero.optim.layout.layout_agreement`) and starts from
rank 0's values (:mod:`fxzero.optim.params.initial_broadcast`); each step gives every rank rank 0's
module buffers, as DDP does (:mod:`fxzero.optim.params.buffer_sync`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import operator
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torch_compat as compat
from . import torch_log
from .config import Config
from .mxfp8.gather import Mxfp8Gather
from .optim.state.added_groups import carried_over, pending_gradients
from .optim.layout.group_plan import GroupPlan, plan_groups
from .compiled.binding import GraphBinding, InputBinding, OwnerRef
from .optim.params.buffer_sync import BufferSync
from .optim.layout.buffers import build_buffers, owners_of
from .optim.communication.comm import DataParallelGroup, settle
from .optim.params.ddp_guard import refuse_ddp
from .optim.update.bucketed_update import updates_param_by_param
from .optim.update.flat_update import ByBucket, FlatUpdate
from .optim.gradients.full_grads import gather_full_grads
from .optim.gradients.grad_sync import GradReductions, GradSync
from .optim.gradients.grad_views import GradViews, grad_scaler_state
from .optim.params.initial_broadcast import broadcast_initial_state
from .optim.layout.layout_agreement import check_ranks_agree, describe_layout
from .optim.gradients.ledger import Ledger
from .optim.layout.mesh import local_of
from .optim.gradients.module_no_sync import install_no_sync
from .optim.params.param_sync import Gather, ParamSync, PlainGather, Publish
from .optim.params.param_waits import install_param_waits
from .optim.layout.ownership import Balance, balance
from .optim.layout.param_table import ParamTable
from .optim.params.param_watch import ParamWatch
from .optim.state.rank_state import RankState
from .optim.gradients.reduced_grads import ReducedGrads
from .optim.state.sharded_state import ShardedState
from .optim.layout.shards import build_shards
from .optim.update.step_result import StepResult, warn_no_gradients
from .optim.state.state_dict import NOT_HYPERPARAMETERS, hyperparameters
from .optim.layout.validation import check_leaves, check_param_groups_kept, resolve_state_sharding

__all__ = ["DistributedOptimizer", "StepResult", "find_distributed_optimizer"]

log = logging.getLogger(__name__)


class DistributedOptimizer(ShardedState, torch.optim.Optimizer):
    """Shard ``optimizer_class``'s state over a data-parallel group (ZeRO-1).

    ``params`` and ``**defaults`` follow ``torch.optim`` conventions (param-group dicts
    with their own hyperparameters, ``named_parameters()`` pairs). ``param_groups``
    holds the model's params and is what LR schedulers edit; the values are copied
    to the wrapped per-rank optimizer at every step.

    Buckets are laid out in reverse param order, which should be the order backward
    produces gradients. Pass ``module=model`` whenever param groups split the model
    (weight-decay groups do): the layout then follows the module's registration order,
    as Megatron-LM's does, instead of group order, which would put first- and
    last-layer params in one bucket and leave no reduce-scatter to overlap backward.

    ``process_group`` is the data-parallel group, or a 1-D ``DeviceMesh`` (``mesh["dp"]``);
    DTensor params placed over the mesh's other dims (tensor parallelism) train eagerly or
    compiled (``backend="fxzero"``), their local tensors in the buffers, the gradient norm taken over the whole mesh
    (:mod:`fxzero.optim.layout.mesh`).
    """

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` then always calls :meth:`step`, with ``grad_scale``
    and ``found_inf`` set on the optimizer, so a skipped step still consumes the gradients."""

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        process_group: "Optional[dist.ProcessGroup | DeviceMesh]" = None,
        config: Optional[Config] = None,
        module: Optional[torch.nn.Module] = None,
        **defaults: Any,
    ) -> None:
        self.config = config if config is not None else Config()
        if not isinstance(self.config, Config):
            raise TypeError(f"config must be a fxzero.Config, got {type(self.config).__name__}")
        self.whole_params = resolve_state_sharding(optimizer_class, self.config.state_sharding)
        """Whether each param is owned whole by one rank (``Config.state_sharding``), not split in fragments."""
        self.dp = DataParallelGroup.resolve(process_group, self.config.grad_collective)
        self.optimizer_class = optimizer_class
        self._kwargs = dict(defaults)
        self._module = weakref.ref(module) if isinstance(module, torch.nn.Module) else None
        self._constructing = True
        self._consolidated: Optional[dict[str, Any]] = None
        """The whole state :meth:`consolidate_state_dict` left on this rank; dropped at the next ``step()``."""
        super().__init__(params, defaults={})
        self._constructing = False
        self._teardown: list[weakref.finalize] = []
        planned = self._plan(module)
        self._agree(planned)
        self._build(planned, module, first=True)

    # ---- construction -----------------------------------------------------------
    def _plan(self, module: Optional[torch.nn.Module]) -> GroupPlan:
        plan = plan_groups(self.param_groups, module, self.optimizer_class, self._kwargs, self.dp, whole_params=self.whole_params, adding_to=self)
        self.defaults = plan.defaults
        return plan

    def _agree(self, plan: GroupPlan) -> None:
        """Every rank lays out the same params (collective; raises on every rank otherwise)."""
        check_ranks_agree(self.dp, describe_layout(plan.layout, self.param_groups, plan.names, self._settings()), plan.params[0].device)

    def _build(self, planned: GroupPlan, module: Optional[torch.nn.Module], *, first: bool) -> None:
        """Lay out the buffers and assemble the runtime over ``planned``: at construction
        (``first``) and again for a param group added later (:meth:`add_param_group`)."""
        from .compiled import ops  # defines the fxzero:: ops its hooks and compiled graphs call: on first use, not on import

        torch_log.register()
        params, layout = planned.params, planned.layout
        self._consolidated = None  # a state gathered for the layout before an added group
        self.mesh_params = planned.mesh_params
        """The DTensor params (tensor parallelism) and the mesh dims other than DP they are placed over."""
        if self.mesh_params.dtensor_slots:
            ops.accept_dtensor_params()
        # Eager reads can only be made to wait through the module's hooks: no module, no overlap.
        overlap = self.config.overlap_param_gather and module is not None
        if self.config.overlap_param_gather and module is None and self.dp.size > 1 and first:
            log.info("overlap_param_gather needs module=...; step() waits for its all-gathers")
        self.buffers = build_buffers(layout, self.config, self.dp, whole_params=self.whole_params)
        self.buffer_sync = BufferSync(module, self.dp, self.config.broadcast_buffers)
        if self.config.init_sync:  # later: the new params start from rank 0's values, the others are already alike
            broadcast_initial_state(self.dp, [b.param_data for b in self.buffers], module if first else None, params)
        elif first:  # DDP syncs buffers before the first forward even without init_sync
            self.buffer_sync.broadcast()
        self.buckets = tuple(b for buffer in self.buffers for b in buffer.buckets)
        bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        self.param_table = ParamTable.build(self.param_groups, planned.names, bucket_of, owners_of(self.buffers))
        """Every managed param's slot, name, group and bucket: what the other parts look params up in."""
        self.params = self.param_table.params
        self._built_groups = tuple(tuple(group["params"]) for group in self.param_groups)
        if self.whole_params:
            log.info("fxzero: %s", self.balance.describe())  # type: ignore[union-attr]
        self._build_runtime(overlap)
        if module is not None:
            handles = [*install_param_waits(module, self.param_table, self.param_sync), module.register_forward_pre_hook(refuse_ddp)]
            self._teardown.append(weakref.finalize(self, _remove_handles, handles))
            # Accelerate's and Trainer's accumulation look for model.no_sync
            self._teardown.append(weakref.finalize(self, install_no_sync(module, self.grad_sync.no_sync)))

    def _settings(self) -> tuple[Any, ...]:
        """Everything besides the params that shapes the buckets and collectives."""
        c = self.config
        return (c.resolved_bucket_size(self.dp.size, self.dp.backend), c.pad_for_high_busbw, c.shard_multiple, c.grad_dtype,
                self.dp.grad_collective, c.mxfp8_param_gather, c.reuse_grad_buf_for_mxfp8_param_ag, self.whole_params)  # fmt: skip

    def _build_runtime(self, overlap: bool) -> None:
        """Assemble the parts; each gets what it needs at construction (no callback is
        assigned later). Hooks and compiled graphs hold the parts, never the optimizer:
        when the optimizer goes away its hooks go too, or a successor optimizer would see
        every gradient twice."""
        table, dp = self.param_table, self.dp
        described = [table.describe(table.slots(b.params)) for b in self.buckets]
        self.gather = self._build_gather()
        self.param_sync = ParamSync(self.buckets, dp, overlap=overlap, gather=self.gather, described=described)
        self._reuse = self.config.reuse_grad_buf_for_mxfp8_param_ag
        # gather bytes sit in the grad buffer: land a bucket before touching its grads
        before_grad_write = self.param_sync.wait if self._reuse else None
        requires_grad = functools.partial(_requires_grad, table.params)
        self.ledger = Ledger(table.bucket_of_slot, len(self.buckets), label=table.label, requires_grad=requires_grad)
        self.reductions = GradReductions(self.buckets, dp, self.ledger, described=described, before_grad_write=before_grad_write,
                                         divide_factor=self.config.gradient_divide_factor)
        self.shards, self.fragments = build_shards(self.buffers, table, dp.rank, separate_mains=self.config.mxfp8_param_gather)
        """``fragments``: this rank's pieces of the params, each its slot, where it lies in the
        param (``where``) and the fp32 master view the wrapped optimizer steps (``param``)."""
        self.local = self._build_local_optimizer()
        self._local_step = compat.unhooked_step(self.local)  # step hooks run once per step, for this optimizer
        self.update = FlatUpdate(self.local, self.fragments, [table.rows[f.slot].group for f in self.fragments],
                                 [table.bucket_of_slot[f.slot] for f in self.fragments], self._kwargs, bucket_count=len(self.buckets))
        """Runs of adjacent fragments step as one tensor where that gives the same bits (:mod:`fxzero.optim.update.flat_update`)."""
        self._publish = Publish(self.param_sync, [shard.main for shard in sorted(self.shards, key=lambda shard: shard.bucket.index)])
        self._by_bucket = self._plan_by_bucket()
        self._rank_state = RankState(table, self.fragments, self.local)
        mesh_norms = self.mesh_params.norms(len(self.params), self.params[0].device)
        self.reduced = ReducedGrads(self.ledger, self.reductions, self.shards, self.fragments, dp, mesh_norms, self.param_sync.take_written)
        self.param_watch = ParamWatch(table, self.shards, self.gather, dp.rank, self.ledger.compiled, adopt_copies=not overlap)
        self.grad_views = GradViews(table, self.reduced, self.param_watch.check, reset=_weakly(self.zero_grad))
        self.grad_sync = GradSync(
            self.params, self.ledger, self.reductions, before_grad_write=before_grad_write, after_backward=self.grad_views.install,
            reset_if_cleared=self.grad_views.reset_if_cleared, local_grads=self.mesh_params.dtensor_slots,
        )
        self.binding = GraphBinding(table, self.ledger, self.grad_sync, self.param_sync)
        """What compiled graphs call into (:mod:`fxzero.compiled.binding`); dies with the optimizer."""
        for slot, param in enumerate(self.params):
            param._fxzero_owner = OwnerRef(self)
            if slot in self.mesh_params.dtensor_slots:  # compiled graphs see its local tensor
                local = local_of(param)
                local._fxzero_owner = OwnerRef(self)
        # runs when the optimizer is collected and at interpreter exit: no collective dies mid-flight
        self._teardown.append(weakref.finalize(self, _settle_in_flight, self.reductions, self.param_sync))
        self.grad_sync.install_hooks()
        self._teardown.append(weakref.finalize(self, self.grad_sync.remove_hooks))
        self._teardown.append(weakref.finalize(self, self.grad_views.remove))

    def _plan_by_bucket(self) -> Optional[ByBucket]:
        """Whether the step updates one bucket at a time, launching each bucket's gather as
        soon as its shard is done (:mod:`fxzero.optim.update.bucketed_update`): when there are
        gathers and the wrapped class updates each param on its own."""
        if not (self.config.overlap_param_gather_with_optimizer_step and self.dp.size > 1):
            return None
        if not updates_param_by_param(self.optimizer_class):
            log.info("fxzero: %s may couple params in its step: every shard is updated before the gathers start", self.optimizer_class.__name__)
            return None
        return ByBucket(self.param_sync.order, self._publish)

    def _build_gather(self) -> Gather:
        """The one place the gather is chosen: ``optim`` defines the protocol, ``mxfp8`` implements one."""
        if not self.config.mxfp8_param_gather:
            return PlainGather(self.buckets, self.dp)
        return Mxfp8Gather(self.buckets, self.dp, reuse_grad_buffer=self.config.reuse_grad_buf_for_mxfp8_param_ag)

    def _build_local_optimizer(self) -> torch.optim.Optimizer:
        local_groups = [hyperparameters(group) | {"params": []} for group in self.param_groups]
        for frag in self.fragments:
            local_groups[self.param_table.rows[frag.slot].group]["params"].append(frag.param)
        return self.optimizer_class(local_groups, **self._kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's, after construction too (LoRA adapters added later, a group of
        layers unfrozen later): collective, every rank adds the same group between steps.
        The buffers are laid out anew over every group; each existing param keeps its
        optimizer state and fp32 master bitwise (:mod:`fxzero.optim.state.added_groups`), and
        compiled graphs resolve their params against the new layout at their next call
        (:mod:`fxzero.compiled.binding`)."""
        check_leaves(param_group, len(self.param_groups))
        if self._constructing:
            super().add_param_group(param_group)
            return
        module = self._module() if self._module is not None else None
        count, problem, planned = len(self.param_groups), pending_gradients(self.ledger.written or self.grad_views.installed), None
        try:
            if problem is None:
                self._refuse_param_shaped_state("add_param_group after construction")
                super().add_param_group(param_group)
                planned = self._plan(module)
        except (ValueError, TypeError, KeyError, NotImplementedError) as error:
            problem = str(error)
        try:
            self.dp.agree(problem, "add_param_group")
            self._agree(planned)  # type: ignore[arg-type]
        except Exception:
            del self.param_groups[count:]
            raise
        self.finish_param_sync()
        whole = self.consolidated_state_dict()  # collective; the fp32 masters too, where they are apart
        for teardown in self._teardown:
            teardown()
        self._teardown.clear()
        self._build(planned, module, first=False)  # type: ignore[arg-type]
        with self._replacing_state():
            self._load_whole_states(carried_over(whole, self.param_table, self.fragments))

    def _bind(self, example_inputs: Sequence[Any]) -> InputBinding:
        """Which of a graph's ``example_inputs`` this optimizer manages, and their buckets:
        what the ``fxzero`` backend plans its passes with. Compiled graphs keep only this
        plain data; at run time their ops find the optimizer through the params."""
        return self.binding.describe(example_inputs)

    # ---- the step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> StepResult:  # type: ignore[override]
        """Finish grad reduce-scatters, update this rank's shards, gather params.
        The gradients are consumed: the next backward starts from zero. A tensor assigned to
        ``p.grad`` is used as is, not averaged, as under DDP (:mod:`fxzero.optim.gradients.hand_grads`)."""
        check_param_groups_kept(self.param_groups, self._built_groups)
        self._consolidated = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.buffer_sync.broadcast()  # after the step's last forward, before the next (DDP's broadcast_buffers)
        self.param_sync.finish()  # a bucket the forward never read may still be gathering
        self.param_watch.check()
        self.param_watch.adopt_outside_writes()
        dropped, hand = self.grad_views.collect()
        self.reduced.use_as_is(hand)
        result = self._update(dropped, loss)
        self._zero_grads()
        return result

    def _update(self, dropped: list[int], loss: Any) -> StepResult:
        grads = self.reduced
        norm, absent = grads.total_norm(dropped), grads.absent(dropped)
        self.ledger.start_step()
        grad_scale, found_inf = grad_scaler_state(self)
        if len(absent) == len(self.params):
            warn_no_gradients(dropped)
            return StepResult(skipped=True, grad_norm=0.0, loss=loss, reason="no_gradients")
        if found_inf:
            return StepResult(skipped=True, grad_norm=norm / grad_scale, loss=loss, reason="found_inf")
        norm /= grad_scale
        if not math.isfinite(norm):
            return StepResult(skipped=True, grad_norm=norm, loss=loss, reason="non_finite")
        grads.apply(self._clip_coefficient(norm) / grad_scale)
        self._sync_hyperparameters()
        by_bucket = self._by_bucket
        if by_bucket is not None:  # each bucket's gather starts as soon as its shard is updated
            self.param_sync.begin()
        if absent:
            with grads.hidden(absent):
                self.update.step_apart(self._local_step, by_bucket)
        else:  # the common case: nothing to hide, no context manager to enter
            self.update.step(self._local_step, by_bucket)
        self._rank_state.held = True
        if by_bucket is None:
            self._publish_and_gather()
        else:
            self.param_sync.end()
        return StepResult(skipped=False, grad_norm=norm, loss=loss)

    def _clip_coefficient(self, norm: float) -> float:
        """``Config.clip_grad``'s factor, by the formula of ``torch.nn.utils.clip_grad_norm_``."""
        if self.config.clip_grad is None:
            return 1.0
        return min(1.0, self.config.clip_grad / (norm + 1e-6))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over every rank (as
        ``torch.nn.utils.clip_grad_norm_`` would under DDP, or FSDP's method); returns
        the norm before clipping. Call it between backward and :meth:`step`."""
        return torch.tensor(self.reduced.clip(float(max_norm), float(norm_type)), dtype=torch.float32)

    def _sync_hyperparameters(self) -> None:
        """Copy (possibly scheduler-edited) hyperparameters to the wrapped optimizer: every
        key of each group, not only the class's defaults, since an optimizer may read a
        group key it has no default for."""
        for group, local in zip(self.param_groups, self.local.param_groups):
            for name, value in group.items():
                if name not in NOT_HYPERPARAMETERS:
                    local[name] = value


    def _publish_and_gather(self) -> None:
        """Every bucket's fp32 masters -> the gather's input (param shard or MXFP8 row); gather."""
        self.param_sync.begin()
        for index in self.param_sync.order:
            self._publish(index)
        self.param_sync.end()

    def start_param_sync(self) -> None:
        """Gather every bucket's updated shard from its pre-made view: with
        ``overlap_param_gather`` all are launched and the forward waits for each,
        otherwise all are gathered before returning."""
        self.param_sync.start()

    def finish_param_sync(self) -> None:
        """Make every param current (waits for, and launches, the remaining gathers).
        Call it before reading params outside a forward, e.g. to evaluate them by hand."""
        self.param_sync.finish()

    # ---- gradient accumulation and zeroing --------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context manager for all but the last microbatch: grads accumulate into
        ``main_grad`` and no reduce-scatter is launched."""
        return self.grad_sync.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers (``main_grad``); a no-op after ``step()``, which
        consumed them. Managed params' ``.grad`` becomes ``None`` either way (between
        backward and step it is a view of the sharded gradient, never a tensor of its own).
        With ``set_to_none=False`` every param holds a zero gradient until the next
        ``step()``, as in torch.optim: a step with no backward, or params a backward does
        not reach, still get weight decay and momentum."""
        self.grad_views.clear()
        self._zero_grads()
        if not set_to_none:
            self.ledger.all_present()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every managed param's whole averaged gradient by name (module path with
        ``module=``), between backward and :meth:`step`, for logging (``.abs()``,
        ``torch.histc``, TensorBoard histograms): what ``p.grad`` holds under DDP, with
        clipping and unscaling applied so far; params without a gradient are left out. A
        collective (one all-gather per bucket): call it on every rank. Fresh fp32 tensors,
        one copy of the gradients; the step is not changed (:mod:`fxzero.optim.gradients.full_grads`)."""
        return gather_full_grads(self.param_table, self.grad_views, self.reduced, self.dp)

    def _zero_grads(self) -> None:
        self.reductions.finish_launched()
        if self.ledger.written:
            if self._reuse:
                # a bucket whose gather is pending holds gather bytes: landing zeroes it
                for bucket in self.buckets:
                    if not self.param_sync.is_pending(bucket.index):
                        bucket.grad_data.zero_()
            else:
                for buffer in self.buffers:
                    buffer.grad_data.zero_()
            self.ledger.zeroed()
        self.ledger.start_step()
        self.reduced.reset()

    @property
    def balance(self) -> Optional[Balance]:
        """Under whole-param ownership, how evenly the params (and so the optimizer state) are
        spread over ranks, and the padding that costs; ``None`` for fragments (even by construction)."""
        if not self.whole_params:
            return None
        return balance([b.plan for b in self.buffers], [b.params for b in self.buffers])

    @property
    def runtime_bytes(self) -> int:
        """Bytes of the runtime's own buffers on this rank: flat param and grad buffers,
        the chunked all-to-all reduction's receive slots (gloo), the MXFP8 gather's (only this
        rank's row when it reuses the grad buffer) and the scratch that checks bf16/fp16 or
        MXFP8 params for values written outside the optimizer."""
        exchange = self.reductions.exchange.nbytes if self.reductions.exchange is not None else 0
        return sum(b.nbytes for b in self.buffers) + exchange + self.gather.nbytes + self.param_watch.nbytes + self.param_sync.nbytes

    @property
    def collectives_per_step(self) -> dict[str, int]:
        """Collectives one training step issues on this rank with ``Config.clip_grad`` or no
        clipping, by ``c10d`` op name: the gradient reductions, the all-reduce of the norm and
        gradient flags, the param gathers, the module buffers' broadcast. None at world size 1."""
        counts = collections.Counter({"allreduce": 1} if self.dp.size > 1 else {})
        if self.reduced.mesh_norms is not None:  # the norms' all-reduce over each other mesh dim
            counts.update(self.reduced.mesh_norms.collectives_per_step())
        for part in (self.reductions, self.param_sync, self.buffer_sync):
            counts.update(part.collectives_per_step())
        return dict(counts)


def find_distributed_optimizer(optimizer: Any) -> Optional[DistributedOptimizer]:
    """The DistributedOptimizer inside Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer`` (and any wrapper that keeps the one it wraps as ``.optimizer``), or ``None``."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, DistributedOptimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return optimizer if isinstance(optimizer, DistributedOptimizer) else None


def _settle_in_flight(reductions: GradReductions, param_sync: ParamSync) -> None:
    settle(reductions.pending_works() + param_sync.pending_works())


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _requires_grad(params: Sequence[torch.Tensor]) -> bytes:
    """Each param's ``requires_grad``, in one C-level pass (what the ledger asks per backward)."""
    return bytes(map(_REQUIRES_GRAD, params))


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()

