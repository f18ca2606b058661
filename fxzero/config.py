"""fxzero's one configuration object.

Every option is resolved here, once, at construction: the runtime receives plain
values (a bucket size, a divisor, a dtype) and never re-reads flags on the step path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union

import torch

__all__ = ["Config", "default_bucket_size"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


GLOO_BUCKET_SIZE = 4_000_000
"""Elements per bucket on gloo (see :func:`default_bucket_size`)."""


def default_bucket_size(dp_size: int, backend: str = "nccl") -> int:
    """The default bucket size in elements for ``dp_size`` ranks on ``backend``.

    NCCL (and every backend but gloo): Megatron-LM's ``max(40e6, 1e6 * dp_size)``. Its
    reduce-scatter and all-gather run in place in the buckets (no scratch at any size),
    and a collective reaches bus bandwidth only when each rank's shard is large, so larger
    groups get larger buckets.

    gloo: :data:`GLOO_BUCKET_SIZE` (4M elements, 16 MiB of fp32) at any ``dp_size``. Its
    collectives need no scratch either (fxzero gathers by per-rank broadcasts and reduces by
    a chunked all-to-all), and a 1M-element all-to-all already costs several times gloo's
    fixed per-collective cost (the "Gradients" paragraph of docs/design.md has the measurements), so
    the bucket size only decides when a bucket can launch: a 40M bucket holds a whole small
    model, which then launches only when backward ends.

    Args:
        dp_size: ranks in the data-parallel group.
        backend: the process group's backend name (``"nccl"``, ``"gloo"``, ...).

    Returns:
        Elements per bucket.

    Example::

        fxzero.default_bucket_size(64)  # 64_000_000 on NCCL
    """
    if backend == "gloo":
        return GLOO_BUCKET_SIZE
    return max(40_000_000, 1_000_000 * dp_size)


@dataclasses.dataclass(frozen=True)
class Config:
    """Options of :class:`fxzero.DistributedOptimizer` (and, later, the compiler passes).

    Args:
        Every field below, by keyword; each is described under it. All have defaults.

    Raises:
        TypeError: a field of the wrong type (a flag that is not a bool, a bucket size that is
            not an int, ``"auto"`` or ``None``).
        ValueError: a value outside its choices or range (a bucket size of 0, an unknown
            ``grad_collective``, ``reuse_grad_buf_for_mxfp8_param_ag`` without
            ``mxfp8_param_gather``).

    Example::

        config = fxzero.Config(bucket_size=20_000_000, overlap_param_gather=True)
    """

    bucket_size: Union[int, Literal["auto"], None] = "auto"
    """Elements per gradient bucket before it closes. ``"auto"`` is
    :func:`default_bucket_size`: Megatron's ``max(40_000_000, 1_000_000 * dp_size)`` on
    NCCL, 4M elements on gloo; ``None`` puts every param of a dtype group in one bucket.
    Smaller buckets start reduce-scatters earlier in backward (more overlap) at the cost
    of more, smaller collectives. No scratch memory grows with it (with the default
    collectives and fp32 params)."""

    pad_for_high_busbw: bool = False
    """Pad every bucket to a multiple of ``lcm(dp, 128, 2**16)`` instead of
    ``lcm(dp, 128)`` (Megatron-LM's rule: bucket sizes divisible by a large power of two
    keep NCCL's ring algorithms at full bus bandwidth at large dp). The rank's shard is
    then a multiple of ``2**16 / gcd(dp, 2**16)`` elements, not necessarily of 2^16
    (``fxzero.explain`` shows which). Costs padding memory."""

    grad_dtype: Optional[torch.dtype] = torch.float32
    """dtype of the flat gradient buffer (``main_grad``). ``None`` means the param's own
    dtype. fp32 (the default) accumulates and reduces gradients without rounding loss;
    bf16/fp16 halve the reduce-scatter bytes. With them, gloo's all-to-all reduction (the
    default on gloo) sums each shard's copies in fp32 and rounds once; NCCL's reduce-scatter
    sums in its own kernels."""

    clip_grad: Optional[float] = None
    """Clip gradients to this global L2 norm (over all ranks' shards, padding excluded,
    one all-reduce), with the same formula as ``torch.nn.utils.clip_grad_norm_``.
    ``None`` disables clipping; the norm is still computed and reported by ``step()``
    (unless ``measure_grad_norm=False``)."""

    measure_grad_norm: bool = True
    """Measure the global gradient norm in every ``step()``: ``StepResult.grad_norm``, and a
    step whose norm is not finite is skipped (``reason="non_finite"``). It reads every
    gradient once more (1.0-1.4 ms per 5.2M fp32 elements on one CPU core, a fifth of a fused
    AdamW step). ``False`` skips that read and steps as ``torch.optim`` does: ``grad_norm`` is
    ``None`` and a NaN or inf gradient is applied. ``clip_grad`` needs the norm, so the two are
    refused together; ``clip_grad_norm_`` through ``p.grad`` or ``opt.clip_grad_norm_`` still
    measure it when called, and ``GradScaler`` still skips a step with an inf."""

    grad_collective: Literal["auto", "reduce_scatter", "all_reduce", "all_to_all"] = "auto"
    """How gradients reach this rank's shard. ``"reduce_scatter"`` averages each bucket
    straight into the rank's shard view (ZeRO's collective; NCCL's is the fastest).
    On gloo that is the slowest choice (it sets up a halving-doubling algorithm on every
    call), so there are two more: ``"all_to_all"`` sends each rank its shard of the
    bucket and sums the ``dp`` copies received (the same bytes as a reduce-scatter, plus
    receive buffers for two buckets); ``"all_reduce"`` sums the whole bucket in place
    (twice the bytes, no extra memory). ``"auto"``: all-to-all on gloo, reduce-scatter
    elsewhere (the "Gradients" paragraph of docs/design.md has the measurements)."""

    overlap_param_gather: bool = False
    """Overlap the param all-gather after ``step()`` with the next forward (opt-in, as
    Megatron-LM's ``overlap_param_gather``). Off (the default), ``step()`` returns with every
    param current, so anything may read params right after it: an EMA or ``AveragedModel``,
    logged norms, ``model.state_dict()`` on rank 0 only, a second compiled model sharing the
    params. On, ``step()`` launches every bucket's gather (in forward order, on every rank, so
    a rank-0-only read afterwards never waits for a peer) and returns; each bucket is waited
    right before its first read in the forward (compiled graphs: inserted waits, which graphs
    compiled with this off do not carry; eager
    modules: forward pre-hooks; the managed module's ``state_dict()`` and copies of it:
    ``copy.deepcopy``, ``torch.save``). Any other read of
    the params before the next forward (another module holding the same Parameters,
    ``parameters_to_vector``, a submodule's ``state_dict()``) must call
    ``opt.finish_param_sync()`` first, or it sees this rank's shard updated and the rest not.
    Needs ``DistributedOptimizer(..., module=model)``; without a module ``step()`` waits for
    its gathers itself."""

    overlap_param_gather_with_optimizer_step: bool = True
    """Update one bucket at a time in ``step()`` and launch each bucket's all-gather as soon
    as its shard is updated (Megatron-LM's ``--overlap-param-gather-with-optimizer-step``), so
    the gathers run under the rest of the update; buckets go in the order the next forward
    reads them. The result is bitwise the same as updating every shard first. Applies to the
    torch.optim classes that update each param on its own (the elementwise ones, Adafactor,
    Muon); any other class updates every shard before the gathers start (it may couple
    params). With ``overlap_param_gather`` off ``step()`` still returns with every param
    current; on, the gathers are left to the forward as before."""

    mxfp8_param_gather: bool = False
    """All-gather params as MXFP8 (1 byte per element plus one scale byte per 32, about
    0.26x of fp32's bytes): each rank quantizes its updated fp32 main shard, the
    gather moves codes and scales, and each bucket is dequantized into the params, so
    the model computes on MXFP8-representable weights while the optimizer keeps fp32
    masters (separate from the params, also for fp32 params). Buckets are padded so
    every rank's shard is a whole number of 32-element blocks."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Land the MXFP8 gather inside each bucket's own ``grad_data`` memory (viewed as
    bytes) instead of a separate buffer: the gather then needs no buffer of its own (only a
    copy of this rank's row, 1/dp of it). Gradients and gathered params are never live at
    once: a bucket's region is zeroed right after its params are dequantized, before any
    gradient is added to it. Needs ``mxfp8_param_gather=True``."""

    init_sync: bool = True
    """Broadcast rank 0's params (and, with ``module=``, the module's buffers and other
    params) when the optimizer is built, as DDP's ``init_sync`` does, so ranks seeded
    differently still start from one model. ``False`` keeps each rank's values (the
    cross-rank check that every rank lays out the same params runs either way), except
    the module's buffers while ``broadcast_buffers`` is on: DDP broadcasts those before
    the first forward whatever its ``init_sync``."""

    broadcast_buffers: bool = True
    """Give every rank rank 0's module buffers (BatchNorm's running statistics) once per
    step, as DDP's ``broadcast_buffers=True`` (``forward_sync_buffers`` since torch 2.13)
    does before each training forward: each step's forwards start from rank 0's buffers
    on every rank, bit for bit (:mod:`fxzero.optim.params.buffer_sync` says when and why).
    Needs ``DistributedOptimizer(..., module=model)``: without a module no buffer is known
    and nothing is broadcast; a module without buffers costs nothing. ``False`` lets each
    rank's buffers follow its own data after the construction-time broadcast (which
    ``init_sync`` controls), as DDP's ``forward_sync_buffers=False`` does."""

    gradient_divide_factor: Optional[int] = None
    """The number of ranks each gradient is averaged over: ``None`` is the data-parallel size
    (the optimizer's ``process_group``, all instances). Expert-parallel params need the
    whole data-parallel size instead: their optimizer's group is the *expert* data-parallel
    group (the ranks holding the same experts), but each local expert's gradient already sums
    the tokens of its whole expert-parallel group, so its sum over that group must be divided
    by every data-parallel rank (``ep * edp``), as torchtitan sets FSDP2's
    ``set_gradient_divide_factor`` and Megatron-LM scales expert gradients by
    ``expert_data_parallel_size / data_parallel_size``. The "Expert-parallel params" section of
    docs/parallelism.md builds one."""

    state_sharding: Literal["auto", "elementwise", "whole_params"] = "auto"
    """How the wrapped optimizer's state is split over ranks.

    ``"elementwise"``: every rank owns 1/dp of the elements of every bucket, so the wrapped
    optimizer gets 1-D fragments of params (Megatron-LM's distributed optimizer). Exact only
    for an optimizer that updates each element from that element's own gradient and state
    (Adam, SGD, Lion): one whose update reads a param's shape or combines its elements
    (Adafactor's factored moment, Muon's orthogonalization, LAMB's trust ratio) would compute
    something else on fragments, without an error.

    ``"whole_params"``: every param is owned, whole, by one rank, balanced by size
    (:mod:`fxzero.optim.layout.ownership`); the wrapped optimizer gets views shaped like the params.
    Exact for any optimizer that updates each param on its own; costs padding where the
    params of a bucket do not split evenly over ranks (``fxzero.explain`` shows it).

    ``"auto"`` (the default): ``"elementwise"`` for the torch.optim classes known to be
    elementwise (``fxzero.optim.layout.optimizer_classes.ELEMENTWISE_OPTIMIZERS``), ``"whole_params"`` for
    every other class, subclasses and third-party optimizers included: an optimizer fxzero
    does not know is served exactly. Say ``"elementwise"`` for one you know is (Lion) to
    get the even split."""

    optimizer_state_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    """How Adam/AdamW keep their two moments between steps (Megatron-LM's ``--exp-avg-dtype`` and
    ``--exp-avg-sq-dtype``; this is the shorthand that sets both, ``exp_avg_dtype`` and
    ``exp_avg_sq_dtype`` set one each): ``"fp32"`` (the default; the wrapped
    ``torch.optim`` class steps as it is), ``"bf16"`` (half the bytes), or ``"fp8"``: 8-bit
    codes in blocks of 32 elements (blocks never span two ranks' shards): the first moment
    as E4M3 with one power-of-two scale per block (1.03 bytes per element), the second as its
    square root in an unsigned 8-bit float with one bf16 scale per block (1.06 bytes per
    element; :mod:`fxzero.optim.update.moment_store` says why). Any setting but ``"fp32"`` steps with fxzero's own Adam update over
    runs of the flat shard (:mod:`fxzero.optim.update.shard_adam`), which always computes in
    fp32; only ``torch.optim.Adam`` and ``torch.optim.AdamW`` (exactly) have it: any other
    class is refused, naming this option. docs/precision.md has each mode's measured drift."""

    exp_avg_dtype: Optional[Literal["fp32", "bf16", "fp8"]] = None
    """How Adam's first moment is kept (Megatron-LM's ``--exp-avg-dtype``); ``None``: as
    ``optimizer_state_dtype`` says."""

    exp_avg_sq_dtype: Optional[Literal["fp32", "bf16", "fp8"]] = None
    """How Adam's second moment is kept (Megatron-LM's ``--exp-avg-sq-dtype``); ``None``: as
    ``optimizer_state_dtype`` says."""

    compiled_update: Optional[bool] = None
    """Compile fxzero's own per-run work with Inductor instead of running it as an eager chain of
    torch ops, once per process, in the first ``step()`` (on a 2-core CPU: 11-16 s with Inductor's cache
    cold, about 3 s warm):

    * narrow moments (``bf16``/``fp8`` in ``optimizer_state_dtype``, ``exp_avg_dtype`` or
      ``exp_avg_sq_dtype``) step with one generated pass per run of the shard
      (:mod:`fxzero.optim.update.fused_run`); its arithmetic is Inductor's, not op for op
      torch.optim's, so params differ from the eager update's in the last bits;
    * the bit operations of ``param_rounding="half_away"`` / ``"stochastic"`` and of
      ``param_remainders`` run as one loop each (:mod:`fxzero.optim.params.rounding_kernels`), with the
      eager ops' bits: remainders stay bitwise the half-away fp32-master run; so does the per-step
      check that bf16 params still hold their masters' rounding (writes from outside the optimizer).

    ``None`` (the default) compiles, and where Inductor cannot (no C++ compiler for the CPU, no Triton
    for the GPU) logs one warning and runs the eager ops from then on; ``True`` compiles and raises
    where it cannot; ``False`` runs the eager ops (in one run of ``benchmarks/update.py`` on one CPU
    thread, 3.1x the compiled step with bf16 moments, 7.9x with fp8 ones, 1.5x with remainders:
    docs/precision.md). fp32 state keeps torch.optim's update (bitwise the wrapped class) whatever this says."""

    param_remainders: bool = False
    """Keep no fp32 master for bf16 params: the bf16 param holds its high 16 bits and an int16
    remainder per element its low 16 (Megatron-LM's ``store_param_remainders``), 2 bytes per
    element instead of 4, and the master is rebuilt exactly for each update. Training is
    bitwise the fp32-master run's with ``param_rounding="half_away"`` (the rounding the split
    needs; see :mod:`fxzero.optim.params.bf16_rounding`). Needs bf16 params, steps with fxzero's
    own Adam update (Adam/AdamW only), and cannot go with ``mxfp8_param_gather`` (the params
    then hold MXFP8 values, not the master's high half)."""

    param_rounding: Literal["auto", "nearest_even", "half_away", "stochastic"] = "auto"
    """How fp32 masters are rounded into bf16 params after each update: ``"nearest_even"``
    (torch's ``copy_``), ``"half_away"`` (ties away from zero: what ``param_remainders`` needs)
    or ``"stochastic"`` (rounds up with probability equal to the dropped fraction, from a hash of
    the master's bits, so runs and resumes are bitwise reproducible). ``"auto"``: ``"half_away"``
    with ``param_remainders``, else ``"nearest_even"``. Only bf16 params are rounded: another
    setting than ``"auto"`` needs some, and cannot go with ``mxfp8_param_gather``."""

    state_dict_timeout: float = 120.0
    """Seconds ``opt.state_dict()`` (collective at world size > 1) waits for every rank to call
    it before it fails on the ranks that did, naming the fix. A call on rank 0 only (the DDP habit
    ``if rank == 0: torch.save(opt.state_dict())``) would otherwise block until the process
    group's timeout, or return one rank's shard: a checkpoint missing the others' state.
    ``state_dict()`` warns after 10 s of waiting, naming the late ranks."""

    def __post_init__(self) -> None:
        _check_bucket_size(self.bucket_size)
        timeout = self.state_dict_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"Config.state_dict_timeout must be a finite number of seconds > 0, got {timeout!r}")
        flags = ("overlap_param_gather", "overlap_param_gather_with_optimizer_step", "pad_for_high_busbw", "mxfp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "init_sync",
                 "broadcast_buffers", "param_remainders", "measure_grad_norm")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.compiled_update is not None and not isinstance(self.compiled_update, bool):
            raise TypeError(f"Config.compiled_update must be None (compile, eager where Inductor cannot), True or False, got {self.compiled_update!r}")
        if self.reuse_grad_buf_for_mxfp8_param_ag and not self.mxfp8_param_gather:
            raise ValueError(
                "Config.reuse_grad_buf_for_mxfp8_param_ag=True needs mxfp8_param_gather=True: only the "
                "MXFP8 gather (about 1.03 bytes per element) is guaranteed to fit in the grad buffer"
            )
        if self.grad_dtype is not None and self.grad_dtype not in _GRAD_DTYPES:
            raise ValueError(
                f"Config.grad_dtype must be one of {_GRAD_DTYPES} or None (the param dtype), "
                f"got {self.grad_dtype!r}"
            )
        if self.grad_collective not in ("auto", "reduce_scatter", "all_reduce", "all_to_all"):
            raise ValueError(
                f"Config.grad_collective must be 'auto', 'reduce_scatter', 'all_reduce' or 'all_to_all', "
                f"got {self.grad_collective!r}"
            )
        if self.state_sharding not in ("auto", "elementwise", "whole_params"):
            raise ValueError(f"Config.state_sharding must be 'auto', 'elementwise' or 'whole_params', got {self.state_sharding!r}")
        _check_precision(self)
        factor = self.gradient_divide_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int) or factor < 1):
            raise ValueError(f"Config.gradient_divide_factor must be an int >= 1 or None (the data-parallel size), got {factor!r}")
        if self.clip_grad is not None:
            if isinstance(self.clip_grad, bool) or not isinstance(self.clip_grad, (int, float)):
                raise TypeError(f"Config.clip_grad must be a positive number or None, got {self.clip_grad!r}")
            if not (math.isfinite(self.clip_grad) and self.clip_grad > 0):
                raise ValueError(f"Config.clip_grad must be a finite number > 0, got {self.clip_grad!r}")
            if not self.measure_grad_norm:
                raise ValueError(
                    f"Config.clip_grad={self.clip_grad!r} clips by the global gradient norm, which "
                    "measure_grad_norm=False skips: keep measure_grad_norm=True (the default) or set clip_grad=None"
                )

    def resolved_bucket_size(self, dp_size: int, backend: str = "nccl") -> Optional[int]:
        """The bucket size in elements for a data-parallel group of ``dp_size`` ranks on ``backend``."""
        return default_bucket_size(dp_size, backend) if self.bucket_size == "auto" else self.bucket_size

    @property
    def resolved_param_rounding(self) -> str:
        """``param_rounding`` with ``"auto"`` resolved."""
        if self.param_rounding != "auto":
            return self.param_rounding
        return "half_away" if self.param_remainders else "nearest_even"

    @property
    def moment_dtypes(self) -> tuple[str, str]:
        """How the first and second moments are kept, each flag resolved against ``optimizer_state_dtype``."""
        shorthand = self.optimizer_state_dtype
        return (self.exp_avg_dtype or shorthand, self.exp_avg_sq_dtype or shorthand)

    @property
    def shard_multiple(self) -> int:
        """Every rank's shard of a bucket is a multiple of this many elements."""
        return 32 if self.mxfp8_param_gather else 1


def _check_bucket_size(value: object) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.bucket_size must be an int > 0, 'auto' or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"Config.bucket_size must be > 0 elements (or 'auto' / None), got {value}")


def _check_precision(config: Config) -> None:
    if config.optimizer_state_dtype not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"Config.optimizer_state_dtype must be 'fp32', 'bf16' or 'fp8', got {config.optimizer_state_dtype!r}")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(config, name) not in (None, "fp32", "bf16", "fp8"):
            raise ValueError(
                f"Config.{name} must be 'fp32', 'bf16', 'fp8' or None (as optimizer_state_dtype says), got {getattr(config, name)!r}"
            )
    if config.param_rounding not in ("auto", "nearest_even", "half_away", "stochastic"):
        raise ValueError(
            f"Config.param_rounding must be 'auto', 'nearest_even', 'half_away' or 'stochastic', got {config.param_rounding!r}"
        )
    if config.param_remainders and config.param_rounding not in ("auto", "half_away"):
        raise ValueError(
            f"Config.param_remainders=True rounds params half away from zero (a 16-bit remainder cannot rebuild the "
            f"master otherwise); param_rounding={config.param_rounding!r} cannot go with it: leave it 'auto'"
        )
    if config.mxfp8_param_gather and (config.param_remainders or config.param_rounding != "auto"):
        flag = "param_remainders=True" if config.param_remainders else f"param_rounding={config.param_rounding!r}"
        raise ValueError(
            f"Config.{flag} cannot go with mxfp8_param_gather=True: the params then hold MXFP8 values decoded from the "
            "fp32 masters, not bf16 roundings of them"
        )
