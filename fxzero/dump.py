"""What fxzero's passes did to each compiled graph: a dump directory, ``TORCH_TRACE``
artifacts and one log line per graph.

Why: the nodes fxzero inserts (``fxzero::wait_params``, ``fxzero::grads_ready``) are
invisible in a training loop, and a wrong insertion point shows up only as lost overlap
or a hang. Every compile therefore says what it inserted (an INFO line on the
``fxzero`` logger: ``TORCH_LOGS="fxzero"``), and on request keeps the evidence:

- ``options={"dump_dir": DIR}`` (or ``FXZERO_DUMP_DIR=DIR``; the option wins) writes,
  per Dynamo graph ``{id}`` (its :class:`~fxzero.compiled.graph_id.GraphId`, Dynamo's compile
  id with ``_`` for ``/``: ``0_0``) and AOT graph ``{kind}`` (``joint``: the joint forward+backward
  graph before partitioning, where the bucket launches go in; ``forward``, ``backward``,
  ``inference``: the partitioned graphs)::

      {id}_{kind}_before.py            the graph as AOTAutograd handed it to fxzero
      {id}_{kind}_pass{k}_{name}.py    after pass k (only when more than one pass ran)
      {id}_{kind}_after.py             after all of fxzero's passes
      {id}_{kind}.diff                 unified diff, one hunk set per pass
      {id}_summary.json                buckets, inserted nodes, graph ids (this graph)
      summary.json                     index of the graphs dumped here (a graph replaces an
                                       earlier one of the same id: a new process, or after
                                       torch.compiler.reset(), starts the ids over)

  The ``.py`` files import-load (each starts with ``import torch``). Ranks of a
  multi-rank job write to ``DIR/rank{r}/`` so they never overwrite each other.
- under ``TORCH_TRACE`` the same texts go to ``torch._logging.trace_structured`` as
  artifacts named like the files (``fxzero_0_0_forward_after``, ...), so tlparse shows
  them next to Dynamo's and Inductor's graphs for the same compile id.

Graph texts are only rendered when a dump directory or a trace handler wants them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx

from . import _torch_compat as compat
from .compiled.graph_id import GraphId
from .passes.matchers import LAUNCH_META, WAIT_META

__all__ = [
    "DUMP_DIR_ENV",
    "GraphDumper",
    "InsertedNode",
    "inserted_nodes",
    "Recorder",
    "resolve_dump_dir",
]

log = logging.getLogger(__name__)

DUMP_DIR_ENV = "FXZERO_DUMP_DIR"
_OPS = {LAUNCH_META: "fxzero::grads_ready", WAIT_META: "fxzero::wait_params"}
_HEADER = "import torch\nimport torch.fx._pytree as fx_pytree  # joint graphs flatten their inputs with it\nfrom math import inf, nan\nfrom torch import device\n\n"
Recorder = Callable[["GraphDumper", str, fx.GraphModule], None]
"""``recorder(dumper, kind, gm)``: sees each graph fxzero's passes finish, for one compile
(the backend's ``recorder`` option; :func:`fxzero.explain` records through it)."""


@dataclasses.dataclass(frozen=True)
class InsertedNode:
    """One node fxzero's passes inserted, with the bucket it was planned for."""

    name: str
    index: int
    """Position in the graph's node list (placeholders included)."""
    op: str
    manager_index: int
    """Index of the optimizer among the Dynamo graph's managers (:attr:`GraphDumper.managers`)."""
    bucket: int

    @property
    def launch(self) -> bool:
        """True for a reduce-scatter launch, False for an all-gather wait."""
        return self.op == "fxzero::grads_ready"


def inserted_nodes(gm: fx.GraphModule) -> tuple[InsertedNode, ...]:
    """fxzero's nodes in ``gm``, in graph order (the passes tag them in ``node.meta``)."""
    found = []
    for index, node in enumerate(gm.graph.nodes):
        for key, op in _OPS.items():
            if key in node.meta:
                manager_index, bucket = node.meta[key]
                found.append(InsertedNode(node.name, index, op, manager_index, bucket))
    return tuple(found)


def resolve_dump_dir(option: Union[str, "os.PathLike[str]", None]) -> Optional[Path]:
    """The ``dump_dir`` option, else ``$FXZERO_DUMP_DIR``; ``rank{r}/`` below it when
    several processes would otherwise write the same file names."""
    chosen = option if option is not None else os.environ.get(DUMP_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen)
    # A "fake" group (python -m fxzero explain --world-size) is one process: no subdir.
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        path = path / f"rank{dist.get_rank()}"
    return path


def _readable(gm: fx.GraphModule, title: str) -> str:
    return f"# {title}\n{_HEADER}{gm.print_readable(print_output=False)}"


@dataclasses.dataclass
class _Part:
    """One AOT graph's record: what the passes changed and what was inserted."""

    kind: str
    nodes_before: int
    nodes_after: int
    stages: list[tuple[str, str]]
    """``(file stem, text)`` from before the first pass to after the last (may be empty)."""
    inserted: tuple[InsertedNode, ...]


def _final_stages(stages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Name the last stage ``after``; keep per-pass stages only when several passes ran."""
    if len(stages) <= 2:
        return [stages[0], ("after", stages[-1][1])]
    return [*stages, ("after", stages[-1][1])]


def _diff(stem: str, stages: list[tuple[str, str]]) -> str:
    """Unified diff from each stage to the next (the ``after`` copy of the last pass skipped)."""
    chain = stages if len(stages) == 2 else stages[:-1]
    hunks = []
    for (old_name, old), (new_name, new) in zip(chain, chain[1:]):
        body_old, body_new = old.split("\n", 1)[1], new.split("\n", 1)[1]  # drop the title line
        changed = list(
            difflib.unified_diff(
                body_old.splitlines(keepends=True),
                body_new.splitlines(keepends=True),
                f"{stem}_{old_name}.py",
                f"{stem}_{new_name}.py",
            )
        )
        hunks += changed or [f"# {stem}_{new_name}.py: no change\n"]
    return "".join(hunks)


class GraphDumper:
    """Records one Dynamo graph's AOT graphs as fxzero's passes rewrite them."""

    def __init__(
        self,
        dump_dir: Union[str, "os.PathLike[str]", None],
        managers: Sequence[Any] = (),
        managed: Sequence[Any] = (),
        names: Sequence[str] = (),
        inputs: Sequence[Any] = (),
        recorder: Optional[Recorder] = None,
        graph_id: Optional[GraphId] = None,
    ) -> None:
        self.graph_id = graph_id if graph_id is not None else GraphId.of_this_compile()
        """The graph's one id (:mod:`fxzero.compiled.graph_id`): its file names, log lines and explain's name."""
        self.recorder = recorder
        self.dir = resolve_dump_dir(dump_dir)
        # a record must keep neither optimizers nor params alive
        self._managers = [weakref.ref(manager) for manager in managers]
        self._params = {m.position: weakref.ref(inputs[m.position]) for m in managed} if inputs else {}
        self.managed, self.names = list(managed), list(names)
        self.parts: dict[str, _Part] = {}
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def managers(self) -> list[Any]:
        """The optimizers whose params the graph reads (None for one since dropped)."""
        return [ref() for ref in self._managers]

    def param(self, position: int) -> Optional[torch.Tensor]:
        """The managed param that was the graph's input ``position`` when it compiled."""
        ref = self._params.get(position)
        return ref() if ref is not None else None

    @property
    def stem(self) -> str:
        return self.graph_id.stem

    def _title(self, kind: str, stage: str) -> str:
        return f"fxzero graph {self.graph_id} {kind}: {stage}"

    def around(
        self,
        kind: str,
        gm: fx.GraphModule,
        passes: Callable[[fx.GraphModule, Callable[[str, fx.GraphModule], None]], fx.GraphModule],
    ) -> fx.GraphModule:
        """Run ``passes(gm, observe)`` (which calls ``observe(pass_name, gm)`` after each
        pass) and record the graph before, between and after the passes."""
        wanted = self.dir is not None or compat.tracing()  # no text rendered otherwise
        nodes_before = len(gm.graph.nodes)
        stages = [("before", _readable(gm, self._title(kind, "before fxzero's passes")))] if wanted else []

        def observe(name: str, graph: fx.GraphModule) -> None:
            if wanted:
                stages.append((f"pass{len(stages)}_{name}", _readable(graph, self._title(kind, f"after {name}"))))

        gm = passes(gm, observe)
        part = _Part(
            kind, nodes_before, len(gm.graph.nodes), _final_stages(stages) if wanted else [], inserted_nodes(gm)
        )
        self.parts[kind] = part
        log.info("%s", self._describe(part))
        if self.recorder is not None:
            self.recorder(self, kind, gm)
        if wanted:
            self._emit(part)
        return gm

    def _describe(self, part: _Part) -> str:
        launches = [str(n.bucket) for n in part.inserted if n.launch]
        waits = [str(n.bucket) for n in part.inserted if not n.launch]
        what = [f"reduce-scatter launches for buckets {', '.join(launches)}"] if launches else []
        what += [f"all-gather waits for buckets {', '.join(waits)}"] if waits else []
        changed = f"{part.nodes_before} -> {part.nodes_after} nodes"
        return f"{self._title(part.kind, changed)}; {'; '.join(what) or 'nothing inserted'}"

    # ---- outputs ------------------------------------------------------------------
    def _emit(self, part: _Part) -> None:
        prefix = f"{self.stem}_{part.kind}"
        files = {f"{prefix}_{name}.py": text for name, text in part.stages}
        files[f"{prefix}.diff"] = _diff(prefix, part.stages)
        summary = self.summary()
        if self.dir is not None:
            for name, text in files.items():
                (self.dir / name).write_text(text)
            self._write_json(f"{self.stem}_summary.json", summary)
            self._write_index()
            log.info("%s", self._title(part.kind, f"dumped to {self.dir / (prefix + '_after.py')}"))
        for name, text in files.items():  # artifact names: 0_0_forward_after, 0_0_forward_diff, ...
            self._trace(name.removesuffix(".py").replace(".", "_"), "string", text)
        self._trace(f"{self.stem}_summary", "json", summary)

    def _trace(self, name: str, encoding: str, payload: Any) -> None:
        compat.trace_artifact(f"fxzero_{name}", encoding, payload, self.graph_id.compile_id)

    def _write_json(self, name: str, value: Any) -> None:
        assert self.dir is not None
        (self.dir / name).write_text(json.dumps(value, indent=1) + "\n")

    def _write_index(self) -> None:
        """Add this graph to the directory's index. The index file is the only record of
        what was dumped there (fxzero keeps none in the process): read, updated, written."""
        assert self.dir is not None
        entry = {
            "graph_id": self.graph_id.name,
            "stem": self.stem,
            "kinds": sorted(self.parts),
            "buckets": sorted({(m.manager_index, m.bucket) for m in self.managed}),
            "summary": f"{self.stem}_summary.json",
        }
        index = self.dir / "summary.json"
        try:
            entries = json.loads(index.read_text())["graphs"]
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one of ours
            entries = []
        ours = [isinstance(e, dict) and e.get("graph_id") == entry["graph_id"] for e in entries]
        # in place: a graph's backward is dumped when it first runs, maybe after other graphs
        entries = [entry if mine else e for e, mine in zip(entries, ours)] if any(ours) else [*entries, entry]
        self._write_json("summary.json", {"graphs": entries})

    # ---- the JSON summary -----------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """This graph's managed inputs, the buckets they belong to (``numel``: param
        elements; ``padded_numel``: the bucket's buffer, alignment and padding included)
        and the nodes inserted, as plain JSON data."""
        ranked = dist.is_available() and dist.is_initialized()
        return {
            "graph_id": self.graph_id.name,
            "rank": dist.get_rank() if ranked else 0,
            "world_size": dist.get_world_size() if ranked else 1,
            "params": [
                {"input": m.position, "name": self._name(m.position), "optimizer": m.manager_index, "bucket": m.bucket}
                for m in self.managed
            ],
            "buckets": [
                self._bucket_summary(manager_index, index)
                for manager_index, index in sorted({(m.manager_index, m.bucket) for m in self.managed})
            ],
            "graphs": {kind: self._part_summary(part) for kind, part in self.parts.items()},
        }

    def _name(self, position: int) -> str:
        return self.names[position] if position < len(self.names) else f"input {position}"

    def _bucket_summary(self, manager_index: int, index: int) -> dict[str, Any]:
        optimizer = self.managers[manager_index]
        bucket = next(b for b in optimizer.runtime.buckets if b.index == index)
        padded = bucket.param_data.numel()
        return {
            "optimizer": manager_index,
            "index": index,
            "params": [self._name(m.position) for m in self.managed if (m.manager_index, m.bucket) == (manager_index, index)],
            "params_in_bucket": len(bucket.params),
            "numel": sum(p.numel() for p in bucket.params),
            "padded_numel": padded,
            "shard_numel": padded // optimizer.dp.size,
            "dtype": str(bucket.param_data.dtype).removeprefix("torch."),
            "grad_dtype": str(bucket.grad_data.dtype).removeprefix("torch."),
        }

    def _part_summary(self, part: _Part) -> dict[str, Any]:
        return {
            "nodes_before": part.nodes_before,
            "nodes_after": part.nodes_after,
            "files": [f"{self.stem}_{part.kind}_{name}.py" for name, _ in part.stages] if self.dir is not None else [],
            "inserted": [
                {"name": n.name, "op": n.op, "optimizer": n.manager_index, "bucket": n.bucket, "index": n.index}
                for n in part.inserted
            ],
        }
