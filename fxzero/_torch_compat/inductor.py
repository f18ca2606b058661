"""AOTAutograd and Inductor: what the backend is built on, set up as ``torch.compile``'s own
Inductor backend sets them up.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

__all__ = [
    "InductorCompilers",
    "aot_autograd",
    "inductor_compile",
    "inductor_compile_context",
    "inductor_decompositions",
    "inductor_eager_random",
    "nccl_collective_ms",
    "inductor_partition",
    "inductor_post_grad_pass",
    "inductor_pre_grad_passes",
    "register_ordered_effect",
]


def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    """A Dynamo backend running AOTAutograd with the given compilers and partitioner.
    ``torch._dynamo.backends.common.aot_autograd`` (what torch's own ``aot_eager`` uses).
    Replacement: ``functorch.compile.aot_module_simplified`` wrapped the same way."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """What ``torch.compile(backend="inductor")`` does with a Dynamo graph, as a callable backend a
    caller can wrap (to count its compiles). ``torch._inductor.compile_fx.compile_fx``; replacement:
    ``torch._dynamo.lookup_backend("inductor")``."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


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


@contextlib.contextmanager
def inductor_eager_random(on: bool = True) -> Iterator[None]:
    """Inductor compiles random ops as eager's aten calls in program order, drawing eager's
    values from the default generator (``torch._inductor.config.fallback_random``), while
    ``on``. What for: ``fxzero parity`` compares a model with dropout against an eager
    reference that draws each rank's masks; Inductor's own random kernels draw other
    values. Read at compile time: the compile must happen inside. If torch drops the flag,
    the parity check of random models under Inductor needs the reference compiled instead."""
    if not on:
        yield
        return
    from torch._inductor import config

    with config.patch(fallback_random=True):
        yield


def nccl_collective_ms(nbytes: int, group_size: int, kind: str, bandwidth_gbps: float) -> float:
    """Inductor's NCCL time model for one collective of ``nbytes`` over ``group_size`` ranks,
    each link ``bandwidth_gbps`` GB/s (intra- and inter-node alike):
    ``torch._inductor.comm_analysis.estimate_nccl_collective_runtime_impl`` under
    ``torch._inductor.config.patch(intra_node_bw=..., inter_node_bw=...)``. What for: ``fxzero
    explain --size`` predicts each collective's time without a GPU. If torch moves it: the same
    function by its new name (it mirrors NCCL's ``ncclTopoTuneModel``)."""
    from torch._inductor import comm_analysis, config

    coll = {"reduce_scatter": comm_analysis.NCCL_COLL.REDUCE_SCATTER, "all_gather": comm_analysis.NCCL_COLL.ALL_GATHER,
            "all_reduce": comm_analysis.NCCL_COLL.ALL_REDUCE}[kind]  # fmt: skip
    with config.patch(intra_node_bw=float(bandwidth_gbps), inter_node_bw=float(bandwidth_gbps)):
        return float(comm_analysis.estimate_nccl_collective_runtime_impl(nbytes, group_size, coll))


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
