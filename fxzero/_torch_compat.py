"""Every private torch API (``torch._*``) fxzero uses, in one place.

Why: private APIs move between torch releases without notice. Keeping them here makes a
torch upgrade one file to read: each entry says what fxzero needs it for and what would
replace it if torch moved or removed it. Checked against torch 2.13.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import sys
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

__all__ = [
    "DcpCheckpointable",
    "InductorCompilers",
    "active_ddp_module",
    "aot_autograd",
    "batch_norm_base",
    "compile_id",
    "current_graph_task_id",
    "dtensor_global_offset",
    "dtensor_local",
    "dynamo_input_names",
    "dynamo_runs_eagerly_at_top_level",
    "engine_accumulates_all",
    "group_ranks_by_name",
    "flat_input_positions",
    "is_dtensor",
    "foreach_add_",
    "foreach_mul_",
    "foreach_norm",
    "gradient_ops",
    "in_backward",
    "inductor_compile_context",
    "inductor_decompositions",
    "inductor_partition",
    "inductor_post_grad_pass",
    "inductor_pre_grad_passes",
    "leaf_gradient_uses",
    "plain_torch_function",
    "process_group_store",
    "process_group_timeout",
    "profiler_enabled",
    "queue_end_of_backward",
    "register_ordered_effect",
    "register_torch_log",
    "set_dtensor_local",
    "storageless_like",
    "trace_artifact",
    "tracing",
    "will_engine_execute_node",
]


# ---- AOTAutograd and Inductor: what the backend is built on --------------------------
def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    """A Dynamo backend running AOTAutograd with the given compilers and partitioner.
    ``torch._dynamo.backends.common.aot_autograd`` (what torch's own ``aot_eager`` uses).
    Replacement: ``functorch.compile.aot_module_simplified`` wrapped the same way."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def inductor_pre_grad_passes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Inductor's pre-AOTAutograd passes, which ``torch.compile``'s Inductor backend runs
    first. ``torch._inductor.compile_fx._recursive_pre_grad_passes``; if gone: skip them
    (a speed difference, not a correctness one)."""
    from torch._inductor.compile_fx import _recursive_pre_grad_passes

    return _recursive_pre_grad_passes(gm, example_inputs)


@contextlib.contextmanager
def inductor_compile_context(example_inputs: Sequence[Any]) -> Iterator[None]:
    """The state ``torch.compile``'s Inductor backend sets up around its AOTAutograd call
    (``torch._inductor.compile_fx._compile_fx_main``), for fxzero's own AOTAutograd call.

    What for: Inductor's joint-graph and post-grad passes read it. Without ``V.fake_mode``
    the random-op pass (``replace_random.fuse_seed_creation_pass``, run on every graph with
    dropout, ``rand``/``randn`` or ``bernoulli``) fails, and without ``unlift_effect_tokens``
    effectful ops compile differently from plain ``torch.compile``. Mirrors, in the same
    order: ``_use_lazy_graph_module``, ``enable_python_dispatcher``, ``V.set_fake_mode``,
    ``torch._guards.tracing``, ``compiled_autograd._disable`` and
    ``torch._functorch.config.patch(unlift_effect_tokens=True, selective_decompose=...)``.
    If torch moves them: the same list from ``_compile_fx_main``'s new body (torch's own
    ``autograd_cache_key`` copies it too)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._dynamo import compiled_autograd
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, detect_fake_mode
    from torch._inductor import config
    from torch._inductor.virtualized import V
    from torch._subclasses import FakeTensorMode
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    tracing_context = TracingContext.try_get() or TracingContext(fake_mode)
    patch = {"unlift_effect_tokens": True}
    if hasattr(config, "selective_decompose"):  # torch 2.13; 2.11 (the GPU machines') has none
        patch["selective_decompose"] = config.selective_decompose
    with contextlib.ExitStack() as stack:
        stack.enter_context(_use_lazy_graph_module(dynamo_config.use_lazy_graph_module))
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(V.set_fake_mode(fake_mode))
        stack.enter_context(torch._guards.tracing(tracing_context))
        stack.enter_context(compiled_autograd._disable())
        stack.enter_context(functorch_config.patch(**patch))
        yield


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions Inductor lowers with: AOTAutograd must apply them, or Inductor
    refuses the graphs. ``torch._inductor.decomposition.select_decomp_table``."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Inductor's partitioner: its joint-graph passes, then min-cut rematerialization.
    ``torch._inductor.compile_fx.partition_fn``; replacement:
    ``functorch.compile.min_cut_rematerialization_partition``."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn(joint, joint_inputs, **kwargs)


class InductorCompilers:
    """Inductor's forward/backward compilers for the AOT graphs of one Dynamo graph, set up
    as ``torch.compile``'s own Inductor backend sets them up (``compile_fx``'s
    ``fw_compiler_base`` / ``bw_compiler``): the same static inputs (params are never
    checked for alignment, never copied at run time), the same joint-graph passes on
    inference graphs, and the forward's user outputs keep the strides eager gives them.

    One addition: ``forward(..., keep_outputs=...)`` names forward outputs that Inductor
    must return exactly as it got them. fxzero names the params the forward returns for
    the backward: with layout optimization (conv models) Inductor would otherwise make a
    channels-last copy of each such conv weight *when it lowers the input*, before any
    node of the graph, and every later user of the input, fxzero's gather wait and the
    backward included, would get that copy, filled before the wait (a stale read). Kept
    as they are, the conv's own lowering makes its channels-last copy where the conv is,
    after the wait (ordered by the wait's declared write), and the backward converts the
    param again (one copy of the weight per conv in the backward). The marking is
    ``output.meta["user_visible_output_idxs"]``, the meta Inductor's lowering reads to
    decide which outputs keep their strides (``GraphLowering.run_node``), derived from the
    graph's own code, so Inductor's FX graph cache (keyed on the code) stays sound.

    Uses ``torch._inductor.compile_fx.{compile_fx_forward, compile_fx_backward,
    compile_fx_inner, create_compiler_config_extra, get_num_model_outputs}``. If they
    move: ``compile_fx_inner`` directly, setting the output meta the same way."""

    def __init__(self, dynamo_gm: fx.GraphModule, num_example_inputs: int) -> None:
        from torch._inductor.compile_fx import create_compiler_config_extra, get_num_model_outputs

        self._extra = create_compiler_config_extra(_config_extra_arg(create_compiler_config_extra, dynamo_gm))
        self._num_outputs = get_num_model_outputs(dynamo_gm)
        self._num_inputs = num_example_inputs

    def forward(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, is_inference: bool, keep_outputs: Sequence[int]
    ) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx_forward, compile_fx_inner

        def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            output = graph.graph.find_nodes(op="output")[0]
            visible = output.meta.get("user_visible_output_idxs") or []
            output.meta["user_visible_output_idxs"] = sorted({*visible, *keep_outputs})
            return compile_fx_inner(graph, inputs, **kwargs)

        return compile_fx_forward(
            gm,
            example_inputs,
            num_orig_model_outputs=self._num_outputs,
            num_example_inputs=self._num_inputs,
            compiler_config_extra=self._extra,
            inner_compile=inner,
            is_inference=is_inference,
        )

    def backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx_backward

        return compile_fx_backward(gm, example_inputs, compiler_config_extra=self._extra)


def _config_extra_arg(create: Callable[..., Any], dynamo_gm: fx.GraphModule) -> Any:
    """What ``create_compiler_config_extra`` takes: the Dynamo graph (torch 2.13, which reads
    its cudagraph annotation) or, in older torch (2.11, the GPU machines' build), Inductor's
    config module. Chosen by the parameter's name: ``config`` gets the module, any other name
    the graph (2.13's shape)."""
    name = next(iter(inspect.signature(create).parameters))
    if name == "config":
        from torch._inductor import config

        return config
    return dynamo_gm


@contextlib.contextmanager
def inductor_post_grad_pass(fn: Callable[[fx.Graph], Any], uuid: bytes) -> Iterator[None]:
    """Run ``fn(graph)`` as the last of Inductor's post-grad FX passes of every graph
    compiled inside the block, after any pass the user configured there.

    What for: the param-gather wait must precede every read of its params in the FX graph
    Inductor lowers; its pattern-matcher passes rewrite the graph after fxzero's passes.
    Uses ``torch._inductor.config.post_grad_custom_post_pass`` (a documented hook of a
    private module) and ``torch._inductor.custom_graph_pass.CustomGraphPass`` (``uuid``
    keys Inductor's FX graph cache). If torch moves them: the same hook under its new
    name, or a ``compile_fx_inner`` wrapper that applies ``fn`` before lowering.
    """
    from torch._inductor import config
    from torch._inductor import custom_graph_pass

    class _Pass(custom_graph_pass.CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> bytes:
            return uuid

    with config.patch(post_grad_custom_post_pass=_chained(config.post_grad_custom_post_pass, _Pass())):
        yield


def _chained(user_pass: Any, ours: Any) -> Any:
    """The user's post-grad passes, then ours. torch 2.13 takes a tuple
    (``custom_graph_pass.get_custom_graph_passes``); older torch (2.11, the GPU machines'
    build) takes one pass, so there a pass of the user's own is refused, not dropped."""
    from torch._inductor import custom_graph_pass

    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        return (*custom_graph_pass.get_custom_graph_passes(user_pass), ours)
    if user_pass is not None:
        raise RuntimeError(
            f"torch._inductor.config.post_grad_custom_post_pass is set ({user_pass!r}) and torch {torch.__version__} "
            "takes one such pass, which fxzero needs: unset it, or use torch>=2.13 (which chains them)"
        )
    return ours


def register_ordered_effect(op: Any, lib: Any) -> None:
    """Declare that ``op`` has effects beyond its outputs, ordered among effectful ops:
    never dead-code eliminated, never reordered against other effects.

    What for: ``fxzero::grads_ready`` writes ``main_grad`` and launches collectives, none
    of them graph values. Uses ``torch.library._register_effectful_op`` with
    ``torch._library.effects.EffectType.ORDERED`` (torch's effects system, which FX's and
    Inductor's impurity checks read). If torch renames it: its public successor
    (``torch.library.register_effectful_op``), else ``torch.fx.node.has_side_effect``.
    """
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(op, EffectType.ORDERED, lib=lib)


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def dynamo_input_names(gm: fx.GraphModule) -> list[str]:
    """Each Dynamo graph input's module path (``blocks.0.fc.weight``) where its source is
    a module attribute, else the placeholder's name, so dumps name params as users do.
    Reads ``node.meta["grapharg"].source.name`` (Dynamo's ``L['self']._modules['fc']...``
    spelling). If it changes: placeholder names (``l_self_modules_fc_parameters_weight_``)."""
    names = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
        parts = _SOURCE_PART.findall(source if isinstance(source, str) else "")
        names.append(".".join(parts) if parts else node.name)
    return names


def dynamo_runs_eagerly_at_top_level(fn: Callable[..., Any]) -> None:
    """Dynamo runs ``fn``'s frames as they are when it meets them at the top level (called
    by eager code inside a compiled region: a module's forward pre-hook after a graph break)
    and still inlines ``fn`` where it traces a caller (the same hook, traced into the graph of
    the module it runs for). ``torch._dynamo.eval_frame.skip_code`` (what
    ``torch._dynamo.skip`` applies, without the ``_torchdynamo_disable`` mark that would make
    Dynamo break the graph at every call). If it goes: do nothing (such a frame compiles into
    a graph of its own, once per guard set, and runs as that graph: slower, the same effect).
    Called through its C half (``torch._C._dynamo.eval_frame``), which ``skip_code`` calls:
    importing ``torch._dynamo`` for it cost every ``import fxzero`` ~1.4 s on this machine,
    also in processes that never compile (the eager ranks of a torchrun job)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        from torch._dynamo.eval_frame import skip_code

        skip_code(fn.__code__)
        return
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def undisabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the ``torch._dynamo.disable`` wrapper AOTAutograd's backend puts on
    the function it returns. Dynamo disables whatever a backend returns, so a backend that
    wraps that function in its own Python would otherwise pay two disable layers (four
    ``set_eval_frame`` calls and more) on every graph call. ``torch._dynamo.eval_frame.innermost_fn``;
    if gone: ``fn`` itself (one layer more per call, the same effect)."""
    from torch._dynamo.eval_frame import innermost_fn

    return innermost_fn(fn)


def compile_id() -> Optional[Any]:
    """The Dynamo compile id of the compile in progress (``[0/0]``), for dump titles and
    trace artifacts. ``torch._guards.CompileContext.current_compile_id()``; if gone: None."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


# ---- logging and tracing ------------------------------------------------------------------
def register_torch_log(name: str, module: str) -> None:
    """Make ``TORCH_LOGS=name`` one of torch's registered logs (``set_logs`` and torch's
    re-inits configure it like torch's own). ``torch._logging._internal``; if gone: torch
    still resolves ``TORCH_LOGS`` entries that are module names."""
    from torch._logging._internal import log_registry, register_log

    if not log_registry.is_log(name):
        register_log(name, module)


def tracing() -> bool:
    """Whether a ``TORCH_TRACE`` handler is installed (only then are artifacts rendered).
    ``torch._logging._internal.trace_log``."""
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def trace_artifact(name: str, encoding: str, payload: Any, compile_id: Optional[Any]) -> None:
    """Write a structured-trace artifact (tlparse shows it next to Dynamo's and Inductor's
    graphs of the same compile). ``torch._logging.trace_structured``."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: payload,
        compile_id=compile_id,
    )


# ---- autograd engine and profiler ---------------------------------------------------------
def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return current_graph_task_id() != -1


current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""``current_graph_task_id()``: the id of the backward pass running on this thread, or -1 outside backward.

What for: telling one backward from the next (their first gradient settles which
compiled forwards they will deliver for) and whether an op runs inside the autograd
engine at all. Uses ``torch._C._current_graph_task_id`` itself, not a wrapper: every gradient
hand-off asks it (a Python frame around it cost as much as the call). If torch removes it, a
counter bumped by a callback queued on the engine at each backward's first gradient.
"""


def will_engine_execute_node(node: Any) -> bool:
    """Whether the backward running now executes (or is executing) autograd ``node``.

    What for: a compiled forward whose backward this pass will not run (a validation
    loss computed with grad enabled) must not keep its buckets waiting. Uses
    ``torch._C._will_engine_execute_node`` (what ``torch.autograd.graph.register_multi_grad_hook``
    uses), which only knows the nodes *below* the backward's root: when the root itself is
    the compiled function (a model that computes its loss inside the graph, as Hugging Face
    models do), it says False while that very node runs, so the node running now
    (``torch._C._current_autograd_node``) counts as executing too. If torch removes them:
    a pre-hook on the node that marks it as run, checked at the end of backward.
    """
    return torch._C._will_engine_execute_node(node) or torch._C._current_autograd_node() is node


def engine_accumulates_all(nodes: Sequence[Any]) -> bool:
    """Whether the running backward executes every ``AccumulateGrad`` node in ``nodes`` (a
    plain ``.backward()`` does): the fast form of :func:`leaf_gradient_uses`."""
    try:
        return all(map(torch._C._will_engine_execute_node, nodes))
    except RuntimeError:
        return False


def leaf_gradient_uses(nodes: Sequence[Any]) -> tuple[str, ...]:
    """Per ``AccumulateGrad`` node, what the running backward does with its gradient:
    ``"accumulate"`` (``.backward()``), ``"capture"`` (``autograd.grad(..., inputs=[it])``)
    or ``"skip"`` (not reached: ``autograd.grad`` w.r.t. others, ``backward(inputs=...)``).

    What for: ``autograd.grad`` must not touch fxzero's buffers. ``torch._C._will_engine_execute_node``
    answers True/False and raises for a captured leaf ("... currently running autograd.grad()",
    torch 2.13). If that changes: a tensor pre-hook (captured gradients pass through those)."""
    return tuple(map(_leaf_gradient_use, nodes))


def _leaf_gradient_use(node: Any) -> str:
    try:
        return "accumulate" if torch._C._will_engine_execute_node(node) else "skip"
    except RuntimeError as error:
        if "autograd.grad" not in str(error):
            raise
        return "capture"


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward finishes (DDP launches its last
    buckets this way). ``torch.autograd.Variable._execution_engine.queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` is recording. ``torch._C._autograd._profiler_enabled``;
    if gone: ``torch.autograd.profiler._is_profiler_enabled``."""
    return torch._C._autograd._profiler_enabled()


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """``optimizer.step`` without the wrapper ``torch.optim.Optimizer`` puts around every
    class's ``step`` (``Optimizer.profile_hook_step``: a profiler range and the global and
    per-instance step hooks), for the optimizer fxzero wraps. Under DDP a hook registered
    with ``register_optimizer_step_pre_hook`` runs once per step, with the user's
    optimizer; through the wrapper it would also run for the private wrapped one, a
    second time. When the wrapped optimizer has hooks of its own (its class registered
    some), or its class's ``step`` is not the wrapper, its plain ``step`` runs them.
    Reads ``step.hooked``, ``step.__wrapped__`` and ``_optimizer_step_{pre,post}_hooks``."""
    step = type(optimizer).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        return optimizer.step

    def run() -> Any:
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            return optimizer.step()
        return inner(optimizer)

    return run


def with_state_dict_hooks(optimizer: torch.optim.Optimizer, produce: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``produce()`` between ``optimizer``'s state-dict hooks (``register_state_dict_pre_hook``
    / ``_post_hook``), run as ``torch.optim.Optimizer.state_dict`` runs them: a post-hook may
    return a replacement. An optimizer that overrides ``state_dict`` gets none of this from
    torch. Reads ``_optimizer_state_dict_{pre,post}_hooks``."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = produce()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def with_load_state_dict_hooks(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]
) -> None:
    """``load(state_dict)`` between ``optimizer``'s load-state-dict hooks, as
    ``torch.optim.Optimizer.load_state_dict`` runs them: pre-hooks see a shallow copy and may
    return a replacement. Reads ``_optimizer_load_state_dict_{pre,post}_hooks``."""
    state_dict = state_dict.copy()
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)


# ---- p.grad views of sharded gradients ---------------------------------------------------
def storageless_like(cls: type, like: torch.Tensor) -> torch.Tensor:
    """An instance of tensor subclass ``cls`` with ``like``'s shape, dtype and device and
    no storage.

    What for: ``p.grad`` views of gradients that live sharded over ranks
    (:mod:`fxzero.optim.gradients.grad_views`). Uses ``torch.Tensor._make_wrapper_subclass`` (what
    DTensor and FSDP2 build on); if torch renames it, the same under its new name.
    """
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)


def plain_torch_function() -> ContextManager[None]:
    """Inside the block, torch functions called on a tensor subclass run as on a plain
    tensor (no ``__torch_function__``).

    What for: metadata reads of the ``p.grad`` views (shape, strides: what torch.compile
    reads when it traces params). Uses ``torch._C.DisableTorchFunctionSubclass``; if torch
    moves it, ``torch.overrides``' equivalent context manager.
    """
    return torch._C.DisableTorchFunctionSubclass()


def gradient_ops() -> dict[str, Callable[..., Any]]:
    """The private ops that ``torch.nn.utils.clip_grad_norm_`` (``foreach`` path) and
    ``torch.amp.GradScaler`` call on gradients, by role.

    What for: the ``p.grad`` views recognize them in ``__torch_function__`` and run them
    over every rank's shards. If torch renames one, the new op goes here (the views
    then raise a clear "not supported" error for the old name until it does).
    """
    return {
        "foreach_norm": torch._foreach_norm,
        "foreach_mul_": torch._foreach_mul_,
        "foreach_div_": torch._foreach_div_,
        "amp_unscale": torch._amp_foreach_non_finite_check_and_unscale_,
    }


# ---- distributed ----------------------------------------------------------------------------
def process_group_timeout(group: Optional[dist.ProcessGroup], device: torch.device) -> float:
    """Seconds a collective of ``group`` waits before it fails (``init_process_group(timeout=...)``).

    What for: the checkpoint handshake waits as long as a collective would (DDP and DCP wait
    that long for a late rank). Reads ``ProcessGroup._get_backend(device).options._timeout``;
    if torch moves it, ``torch.distributed.default_pg_timeout`` (30 minutes) is used."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return float(pg._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.default_pg_timeout.total_seconds())


def group_ranks_by_name(name: str) -> Optional[list[int]]:
    """Global ranks of the process group a functional collective in a graph names (its
    ``group_name`` argument), or None when this process does not know the name.

    What for: ``fxzero.explain`` says which ranks a model's own collective (tensor parallel's
    all-gathers, reduce-scatters) runs over. Private: ``torch.distributed.distributed_c10d.
    _resolve_process_group`` is how functional collectives themselves find their group."""
    try:
        group = dist.distributed_c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
    return list(dist.get_process_group_ranks(group))


def process_group_store(group: Optional[dist.ProcessGroup]) -> dist.Store:
    """The key-value store the ranks of ``group`` (``None``: the default group) share.

    What for: the checkpoint handshake (:mod:`fxzero.checkpoint.ranks`) meets the other
    ranks without a collective, with its own short timeout, under gloo and NCCL alike.
    Uses ``torch.distributed.distributed_c10d._get_process_group_store`` (the store that
    ``init_process_group`` / ``new_group`` recorded for the group, already prefixed per
    group). If torch moves it: keep the store the job passed to ``init_process_group``, or
    meet through ``dist.monitored_barrier`` on a gloo group (which has its own timeout).
    """
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(group if group is not None else dist.group.WORLD)


def active_ddp_module() -> Optional[nn.Module]:
    """The ``DistributedDataParallel`` whose forward is running, if any.

    What for: a model whose params fxzero manages must not also be wrapped in DDP (HF
    Trainer and Accelerate wrap it under torchrun): DDP would all-reduce every gradient
    fxzero already reduce-scatters. fxzero's forward pre-hook asks this and refuses.
    Uses ``DistributedDataParallel._get_active_ddp_module()`` (what Dynamo's DDPOptimizer
    asks; set around the wrapped module's forward by the C++ reducer's DDP). If torch drops
    it: look for a ``DistributedDataParallel`` among ``gc.get_referrers(module)`` at construction.
    """
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


class DcpCheckpointable:
    """Base of objects ``torch.distributed.checkpoint`` plans like a sharded tensor.

    What for: fxzero's checkpoints store each rank's fragment of a logical 1-D tensor
    (:class:`fxzero.checkpoint.state.Chunk`). DCP asks such objects through its private
    ``_Checkpointable`` protocol (the dunder methods below); subclasses implement the
    plainly named ``write_items`` / ``chunk_list``. If DCP renames the protocol, only the
    dunders here change; without it: ``ShardedTensor`` / ``DTensor`` pieces.
    """

    def write_items(self, fqn: str) -> list[Any]:
        raise NotImplementedError

    def chunk_list(self) -> list[Any]:
        raise NotImplementedError

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        return self.write_items(fqn)

    def __create_chunk_list__(self) -> list[Any]:
        return self.chunk_list()


# ---- DTensor params (tensor parallelism) ----------------------------------------------------
dtensor_local: Callable[[torch.Tensor], torch.Tensor] = operator.attrgetter("_local_tensor")
"""The local tensor a ``DTensor`` (or a ``DTensor`` param) holds on this rank, itself (not a
view made through autograd, as ``to_local()`` makes one). An ``attrgetter``, so mapping it
over the params each step stays in C.

What for: fxzero's flat buffers hold each DTensor param's local tensor, and the optimizer
checks by pointer every step that it still does. Reads ``DTensor._local_tensor`` (what
FSDP2's ``FSDPParam`` reads); if torch renames it: ``tensor.to_local()`` under
``torch.no_grad()``, which returns a view of the same memory."""


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing ``torch.distributed.tensor``: no DTensor
    exists before that module is loaded (nor where torch has no distributed package), and
    loading it cost every ``import fxzero`` ~0.6 s on this machine."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(value, cls)


def flat_input_positions(example_inputs: Sequence[Any]) -> tuple[list[int], int]:
    """Where each Dynamo graph input lands among AOTAutograd's flattened graph inputs (a
    tensor subclass input, a DTensor, becomes one placeholder per ``__tensor_flatten__``
    attribute, its local tensor first), and how many there are.

    What for: fxzero finds managed params among Dynamo's inputs, while its passes index the
    joint, forward and backward graphs, whose placeholders are the flattened ones (a DTensor
    param is its local tensor there, then its device mesh). Uses
    ``torch.utils._python_dispatch.is_traceable_wrapper_subclass`` (AOTAutograd's own test).
    Static shapes only: with dynamic shapes AOTAutograd appends the outer sizes' symbols per
    subclass; a count that disagrees with the joint graph's makes fxzero leave that graph's
    gradients to autograd (its eager hooks take them)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def count(value: Any) -> int:
        if not is_traceable_wrapper_subclass(value):
            return 1
        attrs, _ = value.__tensor_flatten__()
        return sum(count(getattr(value, a)) for a in attrs)

    positions, total = [], 0
    for value in example_inputs:
        positions.append(total)
        total += count(value)
    return positions, total


def set_dtensor_local(param: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of DTensor ``param``, in place (same Parameter object).

    What for: a DTensor param's local tensor becomes a view of fxzero's flat param buffer,
    so the gathers write what the model reads, while the module keeps its Parameter (hooks,
    optimizer references, tied weights stay valid). ``local`` must have the old local's
    shape, dtype and device (the DTensor's metadata is not changed).

    Why not only assign ``DTensor._local_tensor`` (as FSDP2's ``FSDPParam.reset_sharded_param``
    does): the DTensor wrapper records its local tensor's storage offset when it is made
    (``torch.Tensor._dtensor__new__``), and Dynamo's fakeification rebuilds the wrapper from a
    fake local (``__tensor_unflatten__``, taking the fake local's offset) and compares the two
    offsets (``torch/_subclasses/meta_utils.py``, ``MetaConverter.meta_tensor``, torch 2.13):
    a wrapper still saying 0 over a local at a nonzero offset into the buffer takes the ``set_``
    branch there and fails ("Attempted to set the storage of a tensor on device "cpu" to a
    storage on different device "meta""), so ``torch.compile`` of the model failed. A local at
    a new offset therefore gets a fresh wrapper made from it, swapped into ``param`` with
    ``torch.utils.swap_tensors`` (the object, its attributes, hooks and grad are kept; the
    hooks live on the C++ tensor, so their dicts are handed over before the swap). Uses
    ``DTensor._spec``; if torch renames it: ``DTensor.from_local(local, param.device_mesh,
    param.placements, shape=param.shape, stride=param.stride(), run_check=False)``."""
    if local.storage_offset() == param.storage_offset():
        param._local_tensor = local  # type: ignore[attr-defined]
        return
    from torch.distributed.tensor import DTensor

    fresh = DTensor(local, param._spec, requires_grad=param.requires_grad)  # type: ignore[attr-defined]
    fresh.__dict__.update(param.__dict__)
    for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        if getattr(param, hooks, None) is not None:
            setattr(fresh, hooks, getattr(param, hooks))
    if param.grad is not None:
        fresh.grad = param.grad
    torch.utils.swap_tensors(param, fresh)


def dtensor_global_offset(param: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's local tensor of DTensor ``param`` starts in the global tensor, per dim.

    What for: fxzero's checkpoints store each param's optimizer state as the global tensor, so
    a run with another tensor-parallel degree reads it; a rank's fragment of the local tensor
    is placed there. Uses ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
    (what DCP's own DTensor write items use). If torch moves it:
    ``param.__create_chunk_list__()[0].offsets``, DCP's checkpointable protocol on DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)  # type: ignore[attr-defined]
    return tuple(int(o) for o in offset)


# ---- multi-tensor kernels -----------------------------------------------------------------
# torch.optim's own fast path: one kernel launch for a list of tensors instead of one each.
# If they move: a Python loop over the tensors (same numbers, more launches).
foreach_add_: Callable[..., Any] = torch._foreach_add_
foreach_mul_: Callable[..., Any] = torch._foreach_mul_
foreach_norm: Callable[..., Any] = torch._foreach_norm


def batch_norm_base() -> type[nn.Module]:
    """The base class of every batch norm (``BatchNorm1d/2d/3d``, their lazy forms,
    ``SyncBatchNorm`` and user subclasses).

    What for: ``fxzero parity`` flags batch norms in train mode (per-rank statistics make
    N ranks incomparable to a global-batch reference). Uses
    ``torch.nn.modules.batchnorm._BatchNorm`` (a private name). If torch moves it: the
    tuple of the public classes above, which misses user subclasses of the base.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm
