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
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ._torch_compat import inductor_compile, recompile_limit

__all__ = ["InductorFunction", "compile_stats", "shared"]


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
