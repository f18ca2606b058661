"""The ``fxzero`` torch.compile backend: AOTAutograd plus fxzero's graph passes.

    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})

Graph inputs that are params managed by a :class:`fxzero.DistributedOptimizer` are found
by identity (``optimizer.bind(example_inputs)``). The passes insert ops that receive those
params as graph values (:mod:`fxzero.ops`): the joint graph gets the bucket launches
(:mod:`fxzero.passes.bucket_reduce_scatter`), the forward the all-gather waits
(:mod:`fxzero.passes.param_gather_wait`). Nothing here holds an optimizer: at run time the
ops find it through the params (:mod:`fxzero.optim.binding`). Each run of a compiled forward
tells the owners how many gradients its backward will deliver per bucket, tied to its
autograd node, so a bucket spread over several graphs and eager regions launches once,
when its last gradient arrives, and a forward whose backward never runs is taken out again
(:mod:`fxzero.optim.ledger`). A managed param that has tensor hooks
(``param.register_hook``) when its graph compiles keeps autograd's path in that graph's
backward, so its hooks see the real gradient (the eager post-accumulate hook then moves
it into ``main_grad``). Graphs with no managed params compile exactly as plain
``torch.compile`` would.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from functorch.compile import default_partition, make_boxed_func

from . import _torch_compat as compat
from .dump import GraphDumper, Recorder
from .optim.binding import counting_forward, owner_of
from .passes import param_gather_wait, run_backward_passes, run_forward_passes, run_joint_passes
from .passes.bucket_reduce_scatter import ManagedParam
from .passes.matchers import is_grads_ready
from .passes.param_gather_wait import hoist_waits_above_readers, waited_params_returned

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
    ``.py`` files, with diffs and a JSON summary (:mod:`fxzero.dump`). Unset:
    ``$FXZERO_DUMP_DIR``, if set."""

    recorder: Optional[Recorder] = None
    """Called with every graph fxzero's passes finish in this compile
    (``recorder(dumper, kind, gm)``): how :func:`fxzero.explain` sees the graphs of its own
    compile only, with no process-wide registration."""

    def __post_init__(self) -> None:
        if self.inner_compiler not in ("inductor", "eager"):
            raise ValueError(f"fxzero option 'inner_compiler' must be 'inductor' or 'eager', got {self.inner_compiler!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"fxzero option 'dump_dir' must be a path string, got {self.dump_dir!r}")
        if self.recorder is not None and not callable(self.recorder):
            raise TypeError(f"fxzero option 'recorder' must be callable, got {self.recorder!r}")

    @classmethod
    def from_mapping(cls, options: Optional[Mapping[str, Any]]) -> "BackendOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown fxzero option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)


def fxzero_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None
) -> Callable:
    """The ``torch.compile`` backend entry point (registered as ``"fxzero"``)."""
    if mode is not None:
        raise ValueError(f"fxzero does not take torch.compile(mode={mode!r}); pass options={{'inner_compiler': ...}}")
    opts = BackendOptions.from_mapping(options)
    inductor = opts.inner_compiler == "inductor"
    if inductor:  # as torch.compile's Inductor backend does, before AOTAutograd
        gm = compat.inductor_pre_grad_passes(gm, example_inputs)
    owners, managed = managed_params(example_inputs)
    if not managed:
        _warn_if_unmanaged(example_inputs)
    names = compat.dynamo_input_names(gm)
    dumper = GraphDumper(opts.dump_dir, owners, managed, names, example_inputs, opts.recorder)
    hooked = _hooked_positions(example_inputs, managed, names)
    inductor_compilers = compat.InductorCompilers(gm, len(example_inputs)) if inductor else None
    hooks = _GraphCompiler(opts, len(example_inputs), [m for m in managed if m.position not in hooked], dumper, inductor_compilers)
    compiled = compat.aot_autograd(
        fw_compiler=hooks.forward,
        bw_compiler=hooks.backward,
        inference_compiler=hooks.inference,
        partition_fn=hooks.partition,
        decompositions=compat.inductor_decompositions() if inductor else None,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
    return hooks.counting(compiled, len(owners))


def managed_params(example_inputs: Sequence[Any]) -> tuple[list[Any], list[ManagedParam]]:
    """The optimizers owning params among ``example_inputs`` (first appearance first) and
    those params, as each optimizer's ``bind`` describes them."""
    owners: list[Any] = []
    for value in example_inputs:
        owner = owner_of(value)
        if owner is not None and all(owner is not o for o in owners):
            owners.append(owner)
    managed = [
        ManagedParam(position, index, bucket, example_inputs[position].numel())
        for index, owner in enumerate(owners)
        for position, bucket in zip(*dataclasses.astuple(owner.bind(example_inputs)))
    ]
    return owners, sorted(managed, key=lambda m: m.position)


def _hooked_positions(example_inputs: Sequence[Any], managed: Sequence[ManagedParam], names: Sequence[str]) -> set[int]:
    """Managed params with tensor hooks: their gradients keep autograd's path, so the hooks see them."""
    hooked = {m.position for m in managed if example_inputs[m.position]._backward_hooks}
    for position in sorted(hooked):
        name = getattr(example_inputs[position], "_fxzero_name", None) or names[position]
        log.info("param %s has tensor hooks: its gradient takes autograd's path so they see it", name)
    return hooked


def _warn_if_unmanaged(example_inputs: Sequence[Any]) -> None:
    if any(isinstance(x, torch.nn.Parameter) and x.requires_grad for x in example_inputs):
        warnings.warn(
            "fxzero: this compiled graph's trainable params are not managed by any fxzero.DistributedOptimizer; "
            "it compiles and trains as plain torch.compile (gradients go to param.grad)",
            stacklevel=3,
        )


_graph_ids = itertools.count()


class _GraphCompiler:
    """AOTAutograd's hooks for one Dynamo graph: fxzero's passes, then the inner compiler.
    It keeps plain data (positions, plans) and the dump record, never an optimizer.
    ``managed`` are the params whose gradients go to fxzero (tensor-hooked ones excluded)."""

    def __init__(
        self,
        opts: BackendOptions,
        num_inputs: int,
        managed: list[ManagedParam],
        dumper: GraphDumper,
        inductor: Optional[compat.InductorCompilers],
    ) -> None:
        self.opts, self.num_inputs, self.managed, self.dumper, self.inductor = opts, num_inputs, managed, dumper, inductor
        self.id = next(_graph_ids)
        self.delivered: frozenset[int] = frozenset()
        """Forward input positions whose gradients the backward hands to fxzero."""

    def partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        # AOTAutograd also partitions higher-order-op subgraphs with this function: only the
        # graph whose primals are our inputs gets the launches.
        primals = joint_inputs[0] if isinstance(joint_inputs, tuple) and len(joint_inputs) == 2 else ()
        if len(primals) == self.num_inputs:
            joint = self.dumper.around("joint", joint, lambda g, observe: run_joint_passes(
                g, joint_inputs, observe=observe, managed=self.managed, num_fwd_outputs=kwargs["num_fwd_outputs"]))  # fmt: skip
            self.delivered = _delivered_positions(joint)
        inner = compat.inductor_partition if self.opts.inner_compiler == "inductor" else default_partition
        return inner(joint, joint_inputs, **kwargs)

    def forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self._forward_graph("forward", gm, example_inputs)

    def counting(self, compiled: Callable, owners: int) -> Callable:
        """The compiled Dynamo graph, telling each owner after every run which gradients
        the backward from its outputs will deliver."""
        if not self.managed:
            return compiled
        groups = [tuple(m.position for m in self.managed if m.owner == o) for o in range(owners)]
        return counting_forward(self.id, groups, lambda: self.delivered, compiled)

    def inference(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self._forward_graph("inference", gm, example_inputs)

    def backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self.dumper.around("backward", gm, lambda g, observe: run_backward_passes(g, example_inputs, observe=observe))
        if self.inductor is None:
            return make_boxed_func(gm.forward)
        return self.inductor.backward(gm, example_inputs)

    def _forward_graph(self, kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = self.dumper.around(kind, gm, lambda g, observe: run_forward_passes(g, example_inputs, observe=observe, managed=self.managed))
        if self.inductor is None:
            return make_boxed_func(gm.forward)
        # Inductor's own FX rewrites run after fxzero's passes: the last of them puts any
        # param read they moved above its bucket's wait back below it. The params the
        # forward returns for the backward are returned as they are (no layout copy made
        # at the graph's start, before the waits: see compat.InductorCompilers).
        keep = waited_params_returned(gm)
        with compat.inductor_post_grad_pass(hoist_waits_above_readers, _pass_uuid()):
            return self.inductor.forward(gm, example_inputs, is_inference=kind == "inference", keep_outputs=keep)


def _delivered_positions(joint: fx.GraphModule) -> frozenset[int]:
    """Positions of the params whose gradients the joint graph's launches take."""
    primals = [n for n in joint.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(primals)}
    return frozenset(index[p] for n in joint.graph.nodes if is_grads_ready(n) for p in n.args[1])


@functools.lru_cache(maxsize=None)
def _pass_uuid() -> bytes:
    """Keys Inductor's FX graph cache to the post-grad pass's source."""
    return hashlib.sha256(Path(param_gather_wait.__file__).read_bytes()).digest()
