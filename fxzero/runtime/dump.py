"""Writing compiled graphs to a dump directory, before and after fxzero's passes."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Callable, Optional

import torch.fx as fx

__all__ = ["GraphDumper"]

log = logging.getLogger(__name__)

_graph_ids = itertools.count()


class GraphDumper:
    """Dumps one Dynamo graph's AOT graphs as ``{id}_{kind}_{before|after}.py``."""

    def __init__(self, dump_dir: Optional[str]) -> None:
        self.graph_id = next(_graph_ids)
        self.dir = Path(dump_dir) if dump_dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, stage: str, gm: fx.GraphModule) -> None:
        if self.dir is None:
            return
        path = self.dir / f"{self.graph_id:03d}_{kind}_{stage}.py"
        path.write_text(gm.print_readable(print_output=False))
        log.info("wrote %s", path)

    def around(self, kind: str, gm: fx.GraphModule, passes: Callable[[fx.GraphModule], fx.GraphModule]) -> fx.GraphModule:
        """Run ``passes`` on ``gm``, dumping the graph before and after."""
        self.write(kind, "before", gm)
        gm = passes(gm)
        self.write(kind, "after", gm)
        return gm
