"""A function of the update compiled by Inductor once per process (``Config.compiled_update``).

The update's per-run work (fxzero's own Adam on narrow moments, the bit operations that round fp32
masters into bf16 params or split them into remainders) is a chain of torch ops when run eagerly:
each op is a pass over the run's memory with a temporary of its own. Compiled by Inductor, each
chain is one generated loop that reads and writes the run's bytes about once.

* **Once per process**, shared by every optimizer: the compile depends on the function and the
  kinds of its inputs (dtypes, flags), not on an optimizer, so :func:`shared` keeps one
  :class:`InductorFunction` per Python function (the function object itself is the key: two
  functions never share an entry). Inductor's FX graph cache makes a later process's compile warm.
* **No recompiles per step**: shapes are dynamic (one graph serves every run), and the callers
  pass per-step values (hyperparameters, bias corrections) in tensors, never as Python numbers
  Dynamo would guard on.
* **Counted and timed**: :func:`compile_stats` reports the compiles and their seconds (the
  benchmark prints them).
* **Required or wanted** (:class:`Compiling`): ``Config.compiled_update=True`` requires the compiled
  loops (a compile that fails raises); ``None``, the default, wants them: where Inductor cannot build
  one (no C++ compiler for the CPU, no Triton for the GPU), one warning is logged and its owner runs
  the eager ops from then on, so a first run never fails for want of a compiler.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from ._torch_compat import inductor_compile, recompile_limit

__all__ = ["Compiling", "InductorFunction", "compile_stats", "shared"]

log = logging.getLogger(__name__)


class InductorFunction:
    """``fn`` compiled by Inductor with dynamic shapes, up to ``graphs`` graphs (one per kinds of input)."""

    def __init__(self, fn: Callable[..., Any], graphs: int) -> None:
        self.graphs = graphs
        self.compiles = 0
        self.compile_seconds = 0.0
        self._fn = torch.compile(fn, backend=self._backend, dynamic=True, fullgraph=True)

    def _backend(self, gm: Any, example_inputs: Any) -> Any:
        start = time.perf_counter()
        compiled = inductor_compile(gm, example_inputs)
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def __call__(self, *args: Any) -> Any:
        with recompile_limit(self.graphs):
            return self._fn(*args)


_SHARED: dict[Callable[..., Any], InductorFunction] = {}


def shared(fn: Callable[..., Any], graphs: int) -> InductorFunction:
    """The process's one compiled ``fn`` (made on first use)."""
    compiled = _SHARED.get(fn)
    if compiled is None:
        compiled = _SHARED[fn] = InductorFunction(fn, graphs)
    return compiled


def compile_stats() -> tuple[int, float]:
    """Graphs compiled in this process by every shared function, and the seconds they took."""
    return sum(c.compiles for c in _SHARED.values()), sum(c.compile_seconds for c in _SHARED.values())


class Compiling:
    """Whether one owner's work (an optimizer's run update, a gather's rounding) runs compiled now.

    ``setting`` is ``Config.compiled_update``: ``True`` requires the compiled loops, ``None`` wants
    them (a failed compile logs one warning and makes :attr:`active` false for good: the owner runs
    its eager ops from then on), ``False`` never compiles. A compile fails before its loop runs,
    so the eager ops then start from the inputs as they were."""

    def __init__(self, setting: Optional[bool], what: str) -> None:
        self.required = setting is True
        self.active = setting is not False
        self.what = what
        """What the owner compiles, for the warning (``"the narrow moments' Adam update"``)."""

    def call(self, fn: Callable[..., Any], graphs: int, *args: Any) -> tuple[bool, Any]:
        """``(True, result)`` of the compiled ``fn``; ``(False, None)`` where it is not active or its compile
        failed without :attr:`required` (the caller runs the eager ops)."""
        if not self.active:
            return False, None
        try:
            return True, shared(fn, graphs)(*args)
        except Exception as error:  # a compile that failed, whatever its kind: the eager ops do the same work
            if self.required or isinstance(error, torch.OutOfMemoryError):  # memory, not the compiler: the eager ops need it too
                raise
            self.active = False
            log.warning(
                "fxzero: %s could not be compiled by Inductor (%s: %s); it runs as eager torch ops from now on, "
                "slower (docs/troubleshooting.md: set up a C++ compiler for Inductor, or Config(compiled_update=False) "
                "to skip the attempt)", self.what, type(error).__name__, error,
            )
            return False, None
