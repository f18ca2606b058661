"""The ``fxzero`` torch.compile backend: AOTAutograd plus fxzero's graph passes.

    cmodel = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"})

In the shape of torch's ``aot_eager`` (``torch/_dynamo/backends/debugging.py``): options
in, AOTAutograd out. What happens to each graph is :class:`fxzero.graph_compiler.GraphCompiler`'s
business; graphs with no managed params compile exactly as plain ``torch.compile`` would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch.fx as fx

from . import _torch_compat as compat
from . import torch_log
from .dump import Recorder
from .graph_compiler import GraphCompiler

__all__ = ["BackendOptions", "fxzero_backend"]


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
    # The ops first: a graph this compile loads from Inductor's or AOTAutograd's cache calls them.
    from .compiled import ops  # noqa: F401  defines the fxzero:: ops (on first use, not on import)

    torch_log.register()
    opts = BackendOptions.from_mapping(options)
    inductor = opts.inner_compiler == "inductor"
    if inductor:  # as torch.compile's Inductor backend does, before AOTAutograd
        gm = compat.inductor_pre_grad_passes(gm, example_inputs)
    graph = GraphCompiler.for_graph(gm, example_inputs, inner_compiler=opts.inner_compiler, dump_dir=opts.dump_dir, recorder=opts.recorder)
    # Inductor's passes read the state its own backend sets up (the fake mode above all:
    # the random-op pass needs it); the eager inner compiler runs none of them.
    context = compat.inductor_compile_context(example_inputs) if inductor else contextlib.nullcontext()
    with context:
        compiled = compat.aot_autograd(
            fw_compiler=graph.forward,
            bw_compiler=graph.backward,
            inference_compiler=graph.inference,
            partition_fn=graph.partition,
            decompositions=compat.inductor_decompositions() if inductor else None,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    return graph.counting(compiled)
