"""ZeRO-1 distributed optimizer over flat, bucketed param/grad buffers.

A step reduce-scatters the gradients bucket by bucket during backward, updates this rank's
shard of each bucket with the wrapped ``torch.optim`` optimizer (1/dp of its state per rank),
and all-gathers the updated params back into the buffers the model's params are views of. The
parts it runs on are its :class:`~fxzero.runtime.Runtime` (``opt.runtime``), built by one
function, :func:`~fxzero.runtime.build_runtime`, where the phases are described.

Padding exists so every bucket splits into dp equal, aligned shards; it is zero in both
buffers, is never handed to the wrapped optimizer, and is excluded from the norm.
At world size 1 no collective is issued.

``step()`` consumes the gradients: the next backward starts from zeroed buffers whether the
loop calls ``opt.zero_grad()``, ``model.zero_grad()`` or neither; between backward and
``step()`` ``clip_grad_norm_``, ``GradScaler`` and ``model.zero_grad()`` act as under DDP
(:mod:`fxzero.optim.gradients.grad_views`). At construction every rank checks that all ranks
lay out the same params (:mod:`fxzero.optim.layout.layout_agreement`) and starts from rank 0's
values (:mod:`fxzero.optim.params.initial_broadcast`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._torch_compat import with_load_state_dict_hooks, with_state_dict_hooks
from .config import Config
from .optim.communication.comm import DataParallelGroup
from .optim.gradients.full_grads import gather_full_grads
from .optim.gradients.grad_views import grad_scaler_state
from .optim.layout.buffers import build_buffers, owners_of
from .optim.layout.group_plan import GroupPlan, plan_groups
from .optim.layout.layout_agreement import check_ranks_agree, describe_layout
from .optim.layout.ownership import Balance, balance
from .optim.layout.param_table import ParamTable
from .optim.params.ddp_guard import refuse_ddp_module
from .optim.layout.optimizer_classes import resolve_state_sharding
from .optim.layout.validation import check_leaves, check_param_groups_kept
from .optim.state.added_groups import carried_over, pending_gradients
from .optim.state.rank_state import RankState
from .optim.state.state_dict import copy_hyperparameters
from .optim.update.step_result import StepResult, warn_no_gradients
from .runtime import Runtime, build_runtime

__all__ = ["DistributedOptimizer", "StepResult", "find_distributed_optimizer"]

log = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer):
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

    Args:
        params: params, ``named_parameters()`` pairs or param-group dicts.
        optimizer_class: the ``torch.optim.Optimizer`` subclass each rank runs on its shard.
        process_group: the data-parallel group or a 1-D ``DeviceMesh`` (default: the world).
        config: :class:`fxzero.Config` (default ``Config()``).
        module: the model, so the layout follows its registration order.
        **defaults: the wrapped optimizer's hyperparameters (``lr=1e-3``, ``weight_decay=0.1``).

    Raises:
        TypeError: ``config`` is not a Config, ``optimizer_class`` not an Optimizer subclass,
            or ``process_group`` neither a group, a 1-D mesh nor ``None``.
        ValueError: an empty param list, or ranks that lay out different params (raised on
            every rank, naming the difference).

    Example::

        opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model)
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
        refuse_ddp_module(module)
        self.config = config if config is not None else Config()
        if not isinstance(self.config, Config):
            raise TypeError(f"config must be a fxzero.Config, got {type(self.config).__name__}")
        self._whole_params = resolve_state_sharding(optimizer_class, self.config.state_sharding)
        self.dp = DataParallelGroup.resolve(process_group, self.config.grad_collective)
        self.optimizer_class = optimizer_class
        self._kwargs = dict(defaults)
        self._module = weakref.ref(module) if isinstance(module, torch.nn.Module) else None
        self._constructing = True
        super().__init__(params, defaults={})
        self._constructing = False
        planned = self._plan(module)
        self._agree(planned)
        self._build(planned, module, first=True)

    # ---- construction -----------------------------------------------------------
    def _plan(self, module: Optional[torch.nn.Module]) -> GroupPlan:
        plan = plan_groups(self.param_groups, module, self.optimizer_class, self._kwargs, self.dp, whole_params=self._whole_params, adding_to=self)
        self.defaults = plan.defaults
        return plan

    def _agree(self, plan: GroupPlan) -> None:
        """Every rank lays out the same params (collective; raises on every rank otherwise)."""
        check_ranks_agree(self.dp, describe_layout(plan.layout, self.param_groups, plan.names, self._settings()), plan.params[0].device)

    def _build(self, planned: GroupPlan, module: Optional[torch.nn.Module], *, first: bool) -> None:
        """Lay out the buffers and the param table over ``planned`` and build the runtime on them: at
        construction (``first``) and again for a param group added later (:meth:`add_param_group`)."""
        c = self.config
        self.buffers = build_buffers(planned.layout, self.dp, bucket_size=c.resolved_bucket_size(self.dp.size, self.dp.backend),
                                     pad_for_high_busbw=c.pad_for_high_busbw, shard_multiple=c.shard_multiple, grad_dtype=c.grad_dtype,
                                     whole_params=self._whole_params)  # fmt: skip
        bucket_of = {id(p): b.index for buffer in self.buffers for b in buffer.buckets for p in b.params}
        self.param_table = ParamTable.build(self.param_groups, planned.names, bucket_of, owners_of(self.buffers))
        """Every managed param's slot, name, group and bucket: what the other parts look params up in."""
        self._built_groups = tuple(tuple(group["params"]) for group in self.param_groups)
        if self._whole_params:
            log.info("fxzero: %s", self.balance.describe())  # type: ignore[union-attr]
        self.runtime: Runtime = build_runtime(
            self, c, self.dp, self.param_table, self.buffers, mesh_params=planned.mesh_params, module=module,
            optimizer_class=self.optimizer_class, kwargs=self._kwargs, whole_params=self._whole_params, first=first,
        )  # fmt: skip
        """The parts the optimizer runs on (:class:`~fxzero.runtime.Runtime`): a read-only surface."""

    def _settings(self) -> tuple[Any, ...]:
        """Everything besides the params that shapes the buckets and collectives."""
        c = self.config
        return (c.resolved_bucket_size(self.dp.size, self.dp.backend), c.pad_for_high_busbw, c.shard_multiple, c.grad_dtype,
                self.dp.grad_collective, c.mxfp8_param_gather, c.reuse_grad_buf_for_mxfp8_param_ag, self._whole_params)  # fmt: skip

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
        runtime = self.runtime
        count, problem, planned = len(self.param_groups), pending_gradients(runtime.ledger.written or runtime.grad_views.installed), None
        try:
            if problem is None:
                runtime.sharded_state.refuse_param_shaped_state("add_param_group after construction")
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
        runtime.close()
        old_params = self.param_table.params
        self._build(planned, module, first=False)  # type: ignore[arg-type]
        self.runtime.held.carry(runtime.held, old_params, self.param_table.params)
        state = self.runtime.sharded_state
        with state.replacing():
            state.load_whole_states(carried_over(whole, self.param_table, state.fragments))

    # ---- the step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> StepResult:  # type: ignore[override]
        """Finish the gathers and the reductions, measure, update this rank's shards and gather
        them, end the step: each phase a method of the part that owns its state.
        The gradients are consumed: the next backward starts from zero. A tensor assigned to
        ``p.grad`` is used as is, not averaged, as under DDP (:mod:`fxzero.optim.gradients.hand_grads`)."""
        check_param_groups_kept(self.param_groups, self._built_groups)
        rt = self.runtime
        rt.sharded_state.begin_step()  # a consolidated state is stale from here
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt.buffer_sync.broadcast()  # after the step's last forward, before the next (DDP's broadcast_buffers)
        rt.param_sync.finish()  # 1. finish param sync: a bucket the forward never read may still be gathering
        rt.param_watch.check()
        rt.param_watch.adopt_outside_writes()
        dropped, hand = rt.grad_views.collect()
        rt.reduced.finish_grad_sync()  # 2. finish grad sync: every reduction of this step done
        rt.reduced.use_as_is(hand)
        if self.config.measure_grad_norm:  # 3. measure: norms and presence, one all-reduce
            norm, absent = rt.reduced.measure(dropped)
        else:
            norm, absent = None, rt.reduced.absent(dropped)
        result = self._update(rt, norm, absent, dropped, loss)  # 4. update, publish, gather
        rt.end_step()  # 5. the gradients are consumed
        return result

    def _update(self, rt: Runtime, norm: Optional[float], absent: list[int], dropped: list[int], loss: Any) -> StepResult:
        """Skip the step (no gradient anywhere, an inf found by ``GradScaler``, a non-finite
        norm) or clip, unscale and update. ``norm`` is ``None`` under
        ``Config.measure_grad_norm=False`` (which refuses ``clip_grad``)."""
        grad_scale, found_inf = grad_scaler_state(self)
        if len(absent) == len(self.param_table.params):
            warn_no_gradients(dropped)
            return StepResult(skipped=True, grad_norm=None if norm is None else 0.0, loss=loss, reason="no_gradients")
        if norm is not None:
            norm /= grad_scale
        if found_inf:
            return StepResult(skipped=True, grad_norm=norm, loss=loss, reason="found_inf")
        if norm is not None and not math.isfinite(norm):
            return StepResult(skipped=True, grad_norm=norm, loss=loss, reason="non_finite")
        rt.reduced.apply((1.0 if norm is None else self._clip_coefficient(norm)) / grad_scale)
        self._sync_hyperparameters(rt.local)
        rt.update_and_gather(absent)
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
        return torch.tensor(self.runtime.reduced.clip(float(max_norm), float(norm_type)), dtype=torch.float32)

    def _sync_hyperparameters(self, local: torch.optim.Optimizer) -> None:
        """Copy (possibly scheduler-edited) hyperparameters to the wrapped optimizer: every
        key of each group, not only the class's defaults, since an optimizer may read a
        group key it has no default for."""
        for group, local_group in zip(self.param_groups, local.param_groups):
            copy_hyperparameters(group, local_group)

    def start_param_sync(self) -> None:
        """Gather every bucket's updated shard from its pre-made view: with
        ``overlap_param_gather`` all are launched and the forward waits for each,
        otherwise all are gathered before returning."""
        self.runtime.param_sync.start()

    def finish_param_sync(self) -> None:
        """Make every param current (waits for, and launches, the remaining gathers).
        Call it before reading params outside a forward, e.g. to evaluate them by hand, and
        before writing them (``p.data.copy_(t)``, or ``p.data = t`` with a tensor of its shape)."""
        self.runtime.param_sync.finish()
        self.runtime.param_watch.note_synced()

    # ---- gradient accumulation and zeroing --------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context manager for all but the last microbatch: grads accumulate into
        ``main_grad`` and no reduce-scatter is launched."""
        return self.runtime.grad_sync.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in the flat grad buffers (``main_grad``: marked stale, so the
        next backward overwrites them, :mod:`fxzero.optim.gradients.stale_grads`); a no-op
        after ``step()``, which consumed them. Managed params' ``.grad`` becomes ``None`` either way (between
        backward and step it is a view of the sharded gradient, never a tensor of its own).
        With ``set_to_none=False`` every param that holds a gradient in torch.optim's terms (one
        since the last ``zero_grad()`` that set them to ``None``, :mod:`fxzero.optim.gradients.held_grads`)
        holds a zero gradient until the next ``step()``, as in torch.optim: a step with no
        backward, or params a backward does not reach, still get weight decay and momentum;
        a param without one stays without."""
        rt = self.runtime
        rt.grad_views.clear()
        rt.end_step()
        if set_to_none:
            rt.held.release()
        else:
            rt.ledger.mark_present(rt.held.flags())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every managed param's whole averaged gradient by name (module path with
        ``module=``), between backward and :meth:`step`, for logging (``.abs()``,
        ``torch.histc``, TensorBoard histograms): what ``p.grad`` holds under DDP, with
        clipping and unscaling applied so far; params without a gradient are left out. A
        collective (one all-gather per bucket): call it on every rank. Fresh fp32 tensors,
        one copy of the gradients; the step is not changed (:mod:`fxzero.optim.gradients.full_grads`)."""
        return gather_full_grads(self.param_table, self.runtime.grad_views, self.runtime.reduced, self.dp)

    # ---- state (:mod:`fxzero.optim.state.sharded_state` does the work) ----------
    @property
    def state(self) -> RankState:  # type: ignore[override]
        """Each managed param's state as this rank holds it (:mod:`fxzero.optim.state.rank_state`)."""
        return self.runtime.sharded_state.rank_state

    @state.setter
    def state(self, value: Any) -> None:
        if value:  # torch.optim.Optimizer.__init__ assigns an empty dict
            raise AttributeError("DistributedOptimizer.state is a read-only view; load state with load_state_dict")

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim``'s schema: what the wrapped optimizer
        class over the same param groups would return without fxzero (it loads into one, or
        back into a DistributedOptimizer at any world size), plus each param's fp32 master
        values where they are kept apart from the params (``MASTER_KEY``).

        At world size > 1 it is collective, like FSDP's ``optim_state_dict``: every rank of
        the group calls it, and every rank gets the whole state. A call on some ranks only
        (``if rank == 0: torch.save(opt.state_dict())``) fails on the ranks that made it
        within ``Config.state_dict_timeout`` seconds, naming the fix, instead of saving one
        rank's shard. The exception is ZeroRedundancyOptimizer's protocol, which Lightning
        and :class:`fxzero.hugging_face.CheckpointCallback` follow: after
        :meth:`consolidate_state_dict` on every rank, rank ``to`` alone returns the
        consolidated state (until the next ``step()``). Hooks registered on the optimizer
        run around it, as in torch.optim."""
        return with_state_dict_hooks(self, self.runtime.sharded_state.whole_state_dict)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank, or a plain ``torch.optim`` state
        dict of the same optimizer class (a run without fxzero: each rank takes its shard).
        Collective (the params are gathered afterwards): every rank loads, or, if any rank's
        state dict is wrong, every rank raises, naming that rank's problem. Load-state-dict
        hooks registered on the optimizer run around it, as in torch.optim."""
        with_load_state_dict_hooks(self, state_dict, self.runtime.sharded_state.load_state_dict)  # type: ignore[arg-type]

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Gather the whole state onto rank ``to`` of the group (``None``: every rank;
        collective: every rank calls it), where the next :meth:`state_dict` returns it without
        a collective, as ``torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict``
        does. Lightning calls it on every rank before saving a checkpoint on rank 0. What is
        held is dropped at the next ``step()``, so a later save never returns stale state."""
        self.runtime.sharded_state.consolidate_state_dict(to)

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in plain ``torch.optim`` format, on every rank
        (collective: every rank of the group calls it). It loads into the wrapped
        optimizer class over the same param groups without fxzero, or back into a
        DistributedOptimizer at any world size (:meth:`load_state_dict`). What
        :meth:`state_dict` returns, without its check that every rank called it."""
        return self.runtime.sharded_state.consolidated_state_dict()

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (fxzero's own format, ``STATE_FORMAT``), for a
        resume at the same world size, layout and rank: no collective, and every rank must
        save its own (``load_state_dict`` refuses another rank's, naming it). What
        ``state_dict()`` returned before fxzero 0.2, and what DTensor params still need."""
        return self.runtime.sharded_state.rank_state_dict()

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: wrapped-optimizer state + separate fp32 mains."""
        return self.runtime.sharded_state.nbytes

    # ---- what it costs ----------------------------------------------------------
    @property
    def balance(self) -> Optional[Balance]:
        """Under whole-param ownership, how evenly the params (and so the optimizer state) are
        spread over ranks, and the padding that costs; ``None`` for fragments (even by construction)."""
        if not self._whole_params:
            return None
        return balance([b.plan for b in self.buffers], [b.params for b in self.buffers])

    @property
    def runtime_bytes(self) -> int:
        """Bytes of the runtime's own buffers on this rank: flat param and grad buffers,
        the chunked all-to-all reduction's receive slots (gloo), the MXFP8 gather's (only this
        rank's row when it reuses the grad buffer) and the scratch that checks bf16/fp16 or
        MXFP8 params for values written outside the optimizer."""
        return sum(b.nbytes for b in self.buffers) + self.runtime.nbytes()

    @property
    def collectives_per_step(self) -> dict[str, int]:
        """Collectives one training step issues on this rank with ``Config.clip_grad`` or no
        clipping, by ``c10d`` op name: the gradient reductions, the all-reduce of the norm and
        gradient flags, the param gathers, the module buffers' broadcast. None at world size 1."""
        return self.runtime.collectives_per_step(self.dp.size)


def find_distributed_optimizer(optimizer: Any) -> Optional[DistributedOptimizer]:
    """The DistributedOptimizer inside Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer`` (and any wrapper that keeps the one it wraps as ``.optimizer``), or ``None``."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, DistributedOptimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return optimizer if isinstance(optimizer, DistributedOptimizer) else None
