"""The ``fxzero`` torch.compile backend: AOTAutograd plus fxzero's graph passes.

    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})

Graph inputs that are params managed by a :class:`fxzero.DistributedOptimizer` are found
by identity. Their gradients leave the backward graph through ``fxzero::grads_ready``
launches (:mod:`fxzero.passes.bucket_reduce_scatter`) instead of autograd. Each run of
the compiled forward tells the runtime how many gradients its backward will deliver
per bucket, so a bucket whose params span several graphs and eager regions launches
once, when its last gradient arrives; a forward whose backward never runs is taken out
again (:mod:`fxzero.runtime.pending_forwards`). A managed param that has tensor hooks
(``param.register_hook``) when its graph compiles keeps autograd's path in that graph's
backward, so its hooks see the real gradient (the eager post-accumulate hook then
moves it into ``main_grad``). Graphs with no managed params compile exactly as plain
``torch.compile`` would.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from functorch.compile import default_partition, make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ._torch_compat import inductor_post_grad_pass
from .passes import param_gather_wait, run_backward_passes, run_forward_passes
from .passes.bucket_reduce_scatter import BucketLaunch, ManagedParam
from .runtime.dump import GraphDumper, input_names
from .runtime.grad_sync import GradSync
from .passes.param_gather_wait import GatherWait, hoist_waits_above_readers
from .runtime.ops import GraphBucket, GraphGather, register_graph_bucket

__all__ = ["BackendOptions", "fxzero_backend"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """``torch.compile(..., backend="fxzero", options={...})``."""

    inner_compiler: Literal["inductor", "eager"] = "inductor"
    """``"inductor"`` compiles the rewritten graphs to kernels; ``"eager"`` runs them as
    FX code (fast to compile, for debugging and most tests)."""
    dump_dir: Union[str, "os.PathLike[str]", None] = None
    """Write every graph before and after each of fxzero's passes here as readable
    ``.py`` files, with diffs and a JSON summary (:mod:`fxzero.runtime.dump`). Unset:
    ``$FXZERO_DUMP_DIR``, if set."""

    def __post_init__(self) -> None:
        if self.inner_compiler not in ("inductor", "eager"):
            raise ValueError(f"fxzero option 'inner_compiler' must be 'inductor' or 'eager', got {self.inner_compiler!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"fxzero option 'dump_dir' must be a path string, got {self.dump_dir!r}")

    @classmethod
    def from_mapping(cls, options: Optional[Mapping[str, Any]]) -> "BackendOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown fxzero option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)


def _inner_compile(options: BackendOptions, gm: fx.GraphModule, example_inputs: Sequence[Any], *, is_backward: bool) -> Callable:
    if options.inner_compiler == "eager":
        return make_boxed_func(gm.forward)
    from torch._inductor.compile_fx import compile_fx_inner

    if is_backward:
        return compile_fx_inner(gm, example_inputs, is_backward=True)
    # Inductor's own FX rewrites run after fxzero's passes: the last of them puts any
    # param read they moved above its bucket's wait back below it.
    with inductor_post_grad_pass(hoist_waits_above_readers, _pass_uuid()):
        return compile_fx_inner(gm, example_inputs, is_backward=False)


@functools.lru_cache(maxsize=None)
def _pass_uuid() -> bytes:
    """Keys Inductor's FX graph cache to the post-grad pass's source."""
    return hashlib.sha256(Path(param_gather_wait.__file__).read_bytes()).digest()


def _owner(param: Any) -> Any:
    """The live DistributedOptimizer managing ``param``, or None."""
    ref = getattr(param, "_fxzero_owner", None)
    return ref() if ref is not None else None


class _CompiledGraph:
    """fxzero's state for one Dynamo graph: its managed inputs and its forward counts."""

    def __init__(self, example_inputs: Sequence[Any], options: BackendOptions, names: Sequence[str]) -> None:
        self.options = options
        self.owners: list[Any] = []  # the DistributedOptimizers whose params this graph reads
        self.managed: list[ManagedParam] = []
        self.params: dict[int, torch.Tensor] = {}
        for position, value in enumerate(example_inputs):
            owner = _owner(value)
            if owner is None:
                continue
            if owner not in self.owners:
                self.owners.append(owner)
            slot = owner.grad_sync.slot_of[id(value)]
            bucket = owner.grad_sync.bucket_of_slot[slot]
            self.managed.append(ManagedParam(position, self.owners.index(owner), bucket, slot))
            self.params[position] = value
        self.syncs: list[GradSync] = [owner.grad_sync for owner in self.owners]
        self.grad_managed = [g for g in self.managed if not _has_tensor_hooks(self.params[g.position], names, g.position)]
        """Managed params whose gradients this graph's backward hands to fxzero."""
        self.forward_counts = self._counts((g.owner, g.bucket) for g in self.grad_managed)
        self.dumper = GraphDumper(options.dump_dir, self.owners, self.managed, names)

    def _counts(self, keys: Any) -> list[tuple[GradSync, list[tuple[int, int]]]]:
        per_owner: dict[int, dict[int, int]] = {}
        for owner, bucket in keys:
            buckets = per_owner.setdefault(owner, {})
            buckets[bucket] = buckets.get(bucket, 0) + 1
        return [(self.syncs[o], sorted(b.items())) for o, b in sorted(per_owner.items())]

    def register_with_runtime(self) -> None:
        for owner, sync in enumerate(self.syncs):
            sync.register_compiled(g.slot for g in self.grad_managed if g.owner == owner)

    def compile_forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self._forward_passes("forward", gm, example_inputs)
        return _inner_compile(self.options, gm, example_inputs, is_backward=False)

    def compile_inference(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self._forward_passes("inference", gm, example_inputs)
        return _inner_compile(self.options, gm, example_inputs, is_backward=False)

    def _forward_passes(self, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        def register_wait(wait: GatherWait) -> int:
            return register_graph_bucket(GraphGather(self.owners[wait.owner].param_sync, wait.bucket))

        return self.dumper.around(
            kind,
            gm,
            lambda g, observe: run_forward_passes(
                g, example_inputs, observe=observe, managed=self.managed, register_wait=register_wait
            ),
        )

    def compile_backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        launches: list[BucketLaunch] = []

        def register(launch: BucketLaunch) -> int:
            launches.append(launch)
            return register_graph_bucket(self._graph_bucket(launch))

        gm = self.dumper.around(
            "backward",
            gm,
            lambda g, observe: run_backward_passes(
                g, example_inputs, observe=observe, managed=self.grad_managed, register=register
            ),
        )
        # Only gradients this graph really produces are expected from its forward runs.
        self.forward_counts = self._counts(
            (launch.owner, launch.bucket) for launch in launches for _ in launch.positions
        )
        return _inner_compile(self.options, gm, example_inputs, is_backward=True)

    def _graph_bucket(self, launch: BucketLaunch) -> GraphBucket:
        params = [self.params[p] for p in launch.positions]
        sync = self.syncs[launch.owner]
        with unset_fake_temporarily():  # a real tensor, though a lazy backward compiles under fake mode
            slots = torch.tensor([sync.slot_of[id(p)] for p in params], dtype=torch.int64)
        return GraphBucket(sync, launch.bucket, [p.main_grad for p in params], slots)

    def counting(self, compiled: Callable) -> Callable:
        """``compiled``, telling the runtime after each run how many gradients the
        backward from its outputs will deliver (nothing when no output needs one)."""

        def run(*args: Any) -> Any:
            outputs = compiled(*args)
            node = _backward_node(outputs)
            if node is not None:
                for sync, counts in self.forward_counts:
                    sync.forward_ran(counts, node)
            return outputs

        return run


def _has_tensor_hooks(param: torch.Tensor, names: Sequence[str], position: int) -> bool:
    if not param._backward_hooks:
        return False
    name = getattr(param, "_fxzero_name", None) or (names[position] if position < len(names) else f"input {position}")
    log.info("param %s has tensor hooks: its gradient takes autograd's path so they see it", name)
    return True


def _backward_node(outputs: Any) -> Any:
    """The compiled function's autograd node behind ``outputs`` (views of outputs are
    regenerated outside it, so their ``grad_fn`` leads there), or ``None``."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    nodes = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    frontier = nodes
    for _ in range(4):
        for node in frontier:
            if node.name().startswith("CompiledFunction"):
                return node
        frontier = [n for node in frontier for n, _ in node.next_functions if n is not None]
    return nodes[0] if nodes else None


def _has_unmanaged_trainable_params(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.nn.Parameter) and x.requires_grad and _owner(x) is None for x in example_inputs)


def _compile_bound(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable:
    """AOT-compile ``gm`` with its managed-param bindings taken from ``example_inputs``."""
    graph = _CompiledGraph(example_inputs, opts, input_names(gm))
    graph.register_with_runtime()
    inductor = opts.inner_compiler == "inductor"
    decompositions = None
    if inductor:
        from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    backend = aot_autograd(
        fw_compiler=graph.compile_forward,
        bw_compiler=graph.compile_backward,
        inference_compiler=graph.compile_inference,
        decompositions=decompositions,
        # Inductor's own partitioner: its joint-graph passes, then min-cut rematerialization
        partition_fn=inductor_partition_fn if inductor else default_partition,
        keep_inference_input_mutations=True,
    )
    return graph.counting(backend(gm, example_inputs))


class _ParamBoundDispatch:
    """Dynamo reuses one compiled graph for structurally identical modules (every block
    of a model whose loop graph-broke) with *different* params as inputs. Gradients must
    land in each param's own ``main_grad``, so each set of params gets its own binding:
    an O(1) identity check of the first and last managed input picks it."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, positions: list[int]) -> None:
        self.gm, self.opts = gm, opts
        self.first, self.last = positions[0], positions[-1]
        self.variants = {self._key(example_inputs): _compile_bound(gm, example_inputs, opts)}

    def _key(self, args: Sequence[Any]) -> tuple[int, int]:
        return id(args[self.first]), id(args[self.last])

    def __call__(self, *args: Any) -> Any:
        compiled = self.variants.get(self._key(args))
        if compiled is None:
            log.info("graph reused with other params: binding a new variant")
            compiled = self.variants[self._key(args)] = _compile_bound(self.gm, list(args), self.opts)
        return compiled(*args)


def fxzero_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None
) -> Callable:
    """The ``torch.compile`` backend entry point (registered as ``"fxzero"``)."""
    if mode is not None:
        raise ValueError(f"fxzero does not take torch.compile(mode={mode!r}); pass options={{'inner_compiler': ...}}")
    opts = BackendOptions.from_mapping(options)
    if opts.inner_compiler == "inductor":  # as torch.compile's Inductor backend does, before AOTAutograd
        from torch._inductor.compile_fx import _recursive_pre_grad_passes

        gm = _recursive_pre_grad_passes(gm, example_inputs)
    positions = [i for i, x in enumerate(example_inputs) if _owner(x) is not None]
    if not positions:
        if _has_unmanaged_trainable_params(example_inputs):
            warnings.warn(
                "fxzero: this compiled graph's trainable params are not managed by any fxzero.DistributedOptimizer; "
                "it compiles and trains as plain torch.compile (gradients go to param.grad)",
                stacklevel=2,
            )
        return _compile_bound(gm, example_inputs, opts)
    return _ParamBoundDispatch(gm, example_inputs, opts, positions)
