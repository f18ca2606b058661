"""What a :class:`~fxzero.DistributedOptimizer` runs on, built by one function, :func:`build_runtime`.

A step has three communication phases, all on buffers laid out once at construction:

1. **reduce-scatter** (launched during backward when :class:`~fxzero.optim.gradients.ledger.Ledger`
   says a bucket is ready, finished by ``step()``'s ``finish_grad_sync``): each bucket's ``grad_data`` is
   averaged over ranks into this rank's pre-made shard view of it (:attr:`Runtime.reductions`; the
   collective is a :class:`~fxzero.optim.gradients.reduction.Reduction`, picked here as the gather is);
2. **shard update**: one small all-reduce carries each param's squared grad norm over this rank's
   fragments and a "got a gradient" flag (:attr:`Runtime.reduced`); then the wrapped ``torch.optim``
   optimizer (:attr:`Runtime.local`) updates the fp32 main fragments of this rank's shards only
   (1/dp of the optimizer state per rank), skipping params that got no gradient on any rank and
   the whole update when the global norm is not finite. Under whole-param ownership
   (``Config.state_sharding``, :mod:`fxzero.optim.layout.ownership`) a rank's shard holds whole
   params, and the wrapped optimizer sees them in their own shapes;
3. **all-gather** (:attr:`Runtime.param_sync`): each bucket's updated param shard is gathered back
   in place into ``param_data``, which the model's params are views of. With
   ``Config.mxfp8_param_gather`` the shard is quantized to MXFP8 first and the gather moves codes
   and scales (optionally landing in the bucket's own grad memory), then each bucket is
   dequantized into the params right before its first read (:mod:`fxzero.mxfp8.gather`).

Between backward and ``step()`` each managed param's ``.grad`` is a view of its sharded gradient
(:attr:`Runtime.grad_views`). Before each update the optimizer checks that the params are still
its views and takes values written into them since into its fp32 masters (:attr:`Runtime.param_watch`).
Each step gives every rank rank 0's module buffers, as DDP does (:attr:`Runtime.buffer_sync`).

``step()`` runs them as named phases: finish param sync, finish grad sync, measure,
:meth:`Runtime.update_and_gather`, :meth:`Runtime.end_step`.

Why one function: it is the one place that reads the :class:`~fxzero.Config` for the runtime;
every part gets plain values (a flag, a factor) and the parts it needs, at construction, not
callbacks (the one left is the ``.grad`` views' weak call of ``opt.zero_grad()``, the only
upward call), and none is assigned later. Hooks and compiled graphs hold the parts, never the optimizer: when
the optimizer goes away its hooks go too, or a successor optimizer would see every gradient twice.

``opt.runtime`` is a read-only surface for tests, benchmarks and tools (``opt.runtime.ledger``,
``opt.runtime.buckets``): its parts may change between releases.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from . import _torch_compat as compat
from . import torch_log
from .compiled.binding import GraphBinding, ManagerRef, manager_of
from .config import Config
from .mxfp8.gather import Mxfp8Gather
from .optim.communication.comm import DataParallelGroup, settle
from .optim.gradients.grad_reductions import GradReductions
from .optim.gradients.grad_sync import GradSync
from .optim.gradients.grad_views import GradViews
from .optim.gradients.ledger import Ledger
from .optim.gradients.module_no_sync import install_no_sync
from .optim.gradients.reduced_grads import ReducedGrads
from .optim.gradients.reduction import reduction_for
from .optim.gradients.held_grads import HeldGrads
from .optim.gradients.stale_grads import StaleGrads
from .optim.layout.buffers import Bucket, ParamAndGradBuffer
from .optim.layout.mesh import MeshParams, local_of
from .optim.layout.param_table import ParamTable
from .optim.layout.shards import BucketShard, FragmentTensor, build_shards
from .optim.params.buffer_sync import BufferSync
from .optim.params.ddp_guard import refuse_ddp
from .optim.params.initial_broadcast import broadcast_initial_state
from .optim.params.param_sync import Gather, ParamSync, PlainGather
from .optim.params.param_waits import install_param_waits
from .optim.params.param_watch import ParamWatch
from .optim.state.state_check import StateProbe
from .optim.state.sharded_state import ShardedState
from .optim.update.bucketed_update import ByBucket
from .optim.update.flat_update import FlatUpdate, place_of
from .optim.update.publish import Publish
from .optim.update.update_plan import build_update, by_bucket, plan_update
from .optim.state.fragment_store import TorchOptimStore

__all__ = ["Runtime", "build_runtime"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Runtime:
    """The parts one layout of a DistributedOptimizer runs on (``opt.runtime``; rebuilt whole by
    ``add_param_group``). Read-only: the fields are not reassigned; each part keeps its own state."""

    whole_params: bool
    """Whether each param is owned whole by one rank (``Config.state_sharding``), not split in fragments."""
    mesh_params: MeshParams
    """The DTensor params (tensor parallelism) and the mesh dims other than DP they are placed over."""
    buffers: tuple[ParamAndGradBuffer, ...]
    """The flat buffers, one per param dtype (the optimizer's ``buffers``)."""
    buckets: tuple[Bucket, ...]
    buffer_sync: BufferSync
    gather: Gather
    param_sync: ParamSync
    ledger: Ledger
    reductions: GradReductions
    shards: tuple[BucketShard, ...]
    fragments: tuple[FragmentTensor, ...]
    """This rank's pieces of the params, each its slot, where it lies in the param (``where``) and
    the fp32 master view the wrapped optimizer steps (``param``)."""
    local: torch.optim.Optimizer
    """The wrapped optimizer over this rank's fragments."""
    local_step: Callable[[], Any]
    """``local.step`` without its step hooks (they run once per step, for the DistributedOptimizer)."""
    update: FlatUpdate
    """Runs of adjacent fragments step as one tensor where that gives the same bits (:mod:`fxzero.optim.update.flat_update`)."""
    publish: Publish
    by_bucket: Optional[ByBucket]
    """The bucket-at-a-time step (:mod:`fxzero.optim.update.bucketed_update`), or ``None``."""
    reduced: ReducedGrads
    param_watch: ParamWatch
    grad_views: GradViews
    grad_sync: GradSync
    binding: GraphBinding
    """What compiled graphs call into (:mod:`fxzero.compiled.binding`); dies with the optimizer."""
    sharded_state: ShardedState
    """The state API the optimizer delegates to (``state_dict`` and friends, what checkpoints use)."""
    reuse_grad_buffer: bool
    """Whether MXFP8 gathers land in the grad buffer (a bucket is landed before its grads are touched)."""
    held: HeldGrads
    """The params holding a gradient in torch.optim's terms: what ``zero_grad(set_to_none=False)`` zeroes."""
    stale: Optional[StaleGrads] = None
    """The consumed gradients left in the grad buffers (``None`` with :attr:`reuse_grad_buffer`: zeroed instead)."""
    teardown: list[weakref.finalize] = dataclasses.field(default_factory=list)

    def update_and_gather(self, absent: Sequence[int]) -> None:
        """The step's fourth phase: update this rank's shards, publish each bucket's fp32 masters
        and launch its gather; bucket by bucket where the class allows (:attr:`by_bucket`), so
        the gathers run under the rest of the update. ``absent``: params that got no gradient."""
        by_bucket = self.by_bucket
        if by_bucket is not None:  # each bucket's gather starts as soon as its shard is updated
            self.param_sync.begin()
        if absent:
            with self.reduced.hidden(absent):
                self.update.step_apart(self.local_step, by_bucket)
        else:  # the common case: nothing to hide, no context manager to enter
            self.update.step(self.local_step, by_bucket)
        self.sharded_state.stepped()
        if by_bucket is None:
            self.publish.all()  # every bucket's fp32 masters -> the gather's input (param shard or MXFP8 row); gather
        else:
            self.param_sync.end()

    def end_step(self) -> None:
        """The step's last phase, and all of ``opt.zero_grad()`` but the ``.grad`` views: mark
        what backward wrote into the grad buffers stale (the next gradient overwrites it,
        :mod:`~fxzero.optim.gradients.stale_grads`; zeroed where MXFP8 gathers reuse the
        buffer), forget this step's measures and start the ledger's next step (one per
        ``step()``, one per ``zero_grad()``). Idempotent."""
        self.reductions.finish_launched()
        if self.ledger.written:
            if self.stale is not None:  # overwritten by the next gradient, or zeroed before a read (:mod:`.stale_grads`)
                self.stale.consumed(self.reduced.present_counts)
            else:  # reuse_grad_buffer: a bucket whose gather is pending holds gather bytes; landing zeroes it
                for bucket in self.buckets:
                    if not self.param_sync.is_pending(bucket.index):
                        bucket.grad_data.zero_()
            self.ledger.zeroed()
        counts = self.reduced.present_counts  # the gradients torch.optim's params would now hold
        self.held.add(self.ledger.presence if counts is None else counts)
        self.reduced.reset()
        self.ledger.start_step()

    def nbytes(self) -> int:
        """Bytes of the parts' own scratch: exchange slots, gather rows, param-watch copies."""
        return self.reductions.reduction.nbytes + self.gather.nbytes + self.param_watch.nbytes + self.param_sync.nbytes

    def collectives_per_step(self, dp_size: int) -> dict[str, int]:
        counts = collections.Counter({"allreduce": 1} if dp_size > 1 else {})
        if self.reductions.dp.replica_count > 1:  # the gradient flags' all-reduce over the instances
            counts["allreduce"] += 1
        if self.reduced.mesh_norms is not None:  # the norms' all-reduce over each other mesh dim
            counts.update(self.reduced.mesh_norms.collectives_per_step())
        for part in (self.reductions, self.param_sync, self.buffer_sync):
            counts.update(part.collectives_per_step())
        return dict(counts)

    def close(self) -> None:
        """Remove the hooks and settle the collectives in flight (before a new layout's runtime)."""
        for teardown in self.teardown:
            teardown()
        self.teardown.clear()


def build_runtime(
    manager: torch.optim.Optimizer, config: Config, dp: DataParallelGroup, table: ParamTable, buffers: Sequence[ParamAndGradBuffer],
    *, mesh_params: MeshParams, module: Optional[torch.nn.Module], optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any], whole_params: bool, first: bool,
) -> Runtime:  # fmt: skip
    """Assemble the parts over ``buffers`` and ``table`` for ``manager`` (the DistributedOptimizer:
    the params point back at it weakly, and its collection tears the hooks down). ``first``: at
    construction, not for a group added later; module buffers are synced from rank 0 then."""
    from .compiled import ops  # defines the fxzero:: ops its hooks and compiled graphs call: on first use, not on import

    torch_log.register()
    if mesh_params.dtensor_slots:
        ops.accept_dtensor_params()
    # Eager reads can only be made to wait through the module's hooks: no module, no overlap.
    overlap = config.overlap_param_gather and module is not None
    if config.overlap_param_gather and module is None and dp.size > 1 and first:
        log.info("overlap_param_gather needs module=...; step() waits for its all-gathers")
    buffer_sync = BufferSync(module, dp) if config.broadcast_buffers else BufferSync(None, dp)  # no module: nothing to sync
    if config.init_sync:  # later: the new params start from rank 0's values, the others are already alike
        broadcast_initial_state(dp, [b.param_data for b in buffers], module if first else None, table.params)
    elif first:  # DDP syncs buffers before the first forward even without init_sync
        buffer_sync.broadcast()
    buckets = tuple(b for buffer in buffers for b in buffer.buckets)
    described = [table.describe(table.slots(b.params)) for b in buckets]
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    if config.mxfp8_param_gather:
        gather: Gather = Mxfp8Gather(buckets, dp, reuse_grad_buffer=reuse)
    else:
        gather = PlainGather(buckets, dp, config.resolved_param_rounding, compiled=config.compiled_update)
    param_sync = ParamSync(buckets, dp, overlap=overlap, gather=gather, described=described)
    ledger = Ledger(table, len(buckets))
    stale = None if reuse else StaleGrads([p.main_grad for p in table.params], table.bucket_of_slot, buckets)
    reductions = GradReductions(buckets, dp, ledger, reduction_for(buckets, dp, described), described=described,
                                landing=param_sync if reuse else None,  # gather bytes sit in the grad buffer: land a bucket first
                                divide_factor=config.gradient_divide_factor, stale=stale)  # fmt: skip
    plan = plan_update(optimizer_class, manager.param_groups, [p.dtype for p in table.params], table.label,
                       state_dtypes=config.moment_dtypes, remainders=config.param_remainders, compiled=config.compiled_update,
                       rounding=config.param_rounding, stepwise=config.overlap_param_gather_with_optimizer_step and dp.size > 1,
                       option=_precision_option(config))  # fmt: skip
    shards, fragments = build_shards(buffers, table, dp.rank, separate_mains=config.mxfp8_param_gather, remainders=config.param_remainders)
    group_of, bucket_of = [table.rows[f.slot].group for f in fragments], [table.bucket_of_slot[f.slot] for f in fragments]
    local, update = build_update(plan, optimizer_class, kwargs, manager.param_groups, fragments, group_of, bucket_of,
                                 lambda: [place_of(f, g, b) for f, g, b in zip(fragments, group_of, bucket_of)], bucket_count=len(buckets))  # fmt: skip
    publish = Publish(param_sync, [shard.main for shard in sorted(shards, key=lambda shard: shard.bucket.index)])
    reduced = ReducedGrads(ledger, reductions, shards, fragments, dp, mesh_params.norms(len(table.params), table.params[0].device), param_sync)
    param_watch = ParamWatch(table, shards, gather, dp.rank, ledger.compiled, overlapped=param_sync if overlap else None)
    grad_views = GradViews(table, reduced, param_watch, reset=_weakly(manager.zero_grad))
    grad_sync = GradSync(table.params, ledger, reductions, views=grad_views, local_grads=mesh_params.dtensor_slots)
    state = ShardedState(dp=dp, table=table, param_groups=manager.param_groups, buffers=buffers, shards=shards, fragments=fragments,
                         local=local, mesh_params=mesh_params, timeout=config.state_dict_timeout, republish=publish,
                         store=local if plan.own else TorchOptimStore(local, fragments), probe=StateProbe(optimizer_class, dict(kwargs)))  # fmt: skip
    runtime = Runtime(
        whole_params=whole_params, mesh_params=mesh_params, buffers=tuple(buffers), buckets=buckets, buffer_sync=buffer_sync, gather=gather,
        param_sync=param_sync, ledger=ledger, reductions=reductions, shards=tuple(shards), fragments=tuple(fragments), local=local,
        local_step=compat.unhooked_step(local), update=update, publish=publish,
        by_bucket=by_bucket(plan, param_sync.order, publish), reduced=reduced, param_watch=param_watch,
        grad_views=grad_views, grad_sync=grad_sync, binding=GraphBinding(table, ledger, grad_sync, param_sync), sharded_state=state,
        reuse_grad_buffer=reuse, held=HeldGrads(len(table.params)), stale=stale,
    )
    _attach(manager, runtime, table, module)
    return runtime


def _precision_option(config: Config) -> str:
    """The option that asks for fxzero's own update, as the user set it (refusals name it)."""
    for name in ("optimizer_state_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(config, name) not in (None, "fp32"):
            return f"Config.{name}={getattr(config, name)!r}"
    return "Config.param_remainders=True"


def _attach(manager: torch.optim.Optimizer, runtime: Runtime, table: ParamTable, module: Optional[torch.nn.Module]) -> None:
    """Point the params at ``manager``, install the hooks, and tie their removal to ``manager``'s life."""
    for slot, param in enumerate(table.params):
        param._fxzero_manager = ManagerRef(manager)
        if slot in runtime.mesh_params.dtensor_slots:  # compiled graphs see its local tensor
            local = local_of(param)
            local._fxzero_manager = ManagerRef(manager)  # the param table maps it to its slot
    teardown = runtime.teardown
    # runs when the optimizer is collected and at interpreter exit: no collective dies mid-flight
    teardown.append(weakref.finalize(manager, _settle_in_flight, runtime.reductions, runtime.param_sync))
    runtime.grad_sync.install_hooks()
    teardown.append(weakref.finalize(manager, runtime.grad_sync.remove_hooks))
    teardown.append(weakref.finalize(manager, runtime.grad_views.remove))
    if module is not None:
        _name_for_others(manager, module)
        handles = [*install_param_waits(module, table, runtime.param_sync), module.register_forward_pre_hook(refuse_ddp)]
        teardown.append(weakref.finalize(manager, _remove_handles, handles))
        # Accelerate's and Trainer's accumulation look for model.no_sync
        teardown.append(weakref.finalize(manager, install_no_sync(module, runtime.grad_sync.no_sync)))


def _name_for_others(manager: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Params of ``module`` that another DistributedOptimizer built without ``module=`` manages
    (an actor-critic's critic optimizer): its messages name them by their path in ``module``."""
    for path, param in module.named_parameters():
        other = manager_of(param)
        if other is not None and other is not manager:
            other.param_table.learn_alias(param, path)


def _settle_in_flight(reductions: GradReductions, param_sync: ParamSync) -> None:
    settle(reductions.pending_works() + param_sync.pending_works())


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
