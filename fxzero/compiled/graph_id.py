"""The one name of a compiled graph: what its dump files, its log lines, fxzero's warnings
about it and :func:`fxzero.explain` call it.

Why Dynamo's compile id: it is carried by the compile itself, so fxzero keeps no counter
of its own (nothing process-wide, nothing an import or an earlier explain moves on), and
torch names the same graph by it (``[0/0]`` in ``TORCH_LOGS`` lines, tlparse, recompile
messages), so fxzero's names line up with torch's. ``"0/0"`` is the first compile of the
first frame Dynamo compiled, ``"0/1"`` its recompile, ``"!0/1/0"`` a graph of compiled
autograd. Torch starts the ids over after ``torch.compiler.reset()``; a :class:`GraphId`
compares by identity, so caches keyed by it never take a graph for an earlier one of the
same name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _torch_compat as compat

__all__ = ["GraphId"]


@dataclasses.dataclass(frozen=True, eq=False)
class GraphId:
    """One compiled Dynamo graph (one call of the backend)."""

    compile_id: Any = None
    """Dynamo's ``CompileId`` of the compile that made it; ``None`` when the backend was
    called outside a Dynamo compile (a test calling it directly)."""

    @classmethod
    def of_this_compile(cls) -> "GraphId":
        """The id of the graph the compile in progress hands the backend."""
        return cls(compat.compile_id())

    @property
    def name(self) -> str:
        """``"0/0"``: what every text names the graph by."""
        if self.compile_id is not None:
            return str(self.compile_id)
        return f"direct-{id(self):x}"  # unique while the graph lives, which holds its id

    @property
    def stem(self) -> str:
        """The name as file names carry it (``0_0_forward_after.py``)."""
        return self.name.replace("/", "_")

    def __str__(self) -> str:
        return self.name
