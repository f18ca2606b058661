""":func:`fxzero.explain`'s facts as JSON (``json_file=`` / ``--json FILE``).

Why: a script that checks a layout (a CI job asserting no bucket pads more than 5%, a
sweep over bucket sizes, a notebook plotting launch positions) should read numbers, not
parse a table. The file holds what the summary shows, and each bucket's params by name.
Schema (``"schema": 2``; graphs are named by their ids, ``"0/0"``, since 2)::

    conditions   model, world_size, backend, collectives_assume, bucket_size, inner_compiler,
                 overlap_param_gather, fxzero and torch versions
    buckets      [{index, params: [module paths], elements, padded, padding, shard_per_rank,
                   grad_bytes, gather_bytes, param_dtype, grad_dtype, graphs: [graph ids]}]
    graphs       [{id, params: [{name, bucket, placeholder}], buckets,
                   parts: {forward|backward|inference: {nodes, launches, handoffs, waits, ms}}}]
                 where launches/handoffs/waits are [{bucket, node, ms}] (node: position among the graph's
                 nodes; ms: the estimated time into the part at which the node runs, and the part's ms its
                 estimated time, :mod:`~fxzero.explainer.node_costs`; null without a measured speed)
    collectives  {per_step: {c10d op: count}, reduction, gather, group_ranks,
                  model_own: [{graph, part, op, group, ranks, count}]}
    exposed      [{bucket, graph, node, nodes, share, suggested_bucket_size}]: buckets whose
                 reduction launches in the last 10% of the last backward to run (no overlap)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from ..version import __version__
from . import collectives, layout, schedule
from .node_costs import Speed

if TYPE_CHECKING:
    from .explained import Explained

__all__ = ["as_data", "write_json"]

SCHEMA = 2


def _conditions(explained: "Explained") -> dict[str, Any]:
    dp = explained.optimizer.dp
    return {
        "model": explained.model,
        "world_size": dp.size,
        "backend": collectives.backend(dp),
        "collectives_assume": collectives.assumed_backend(dp),
        "bucket_size": explained.bucket_size,
        "inner_compiler": explained.inner_compiler,
        "overlap_param_gather": explained.overlap,
        "fxzero": __version__,
        "torch": torch.__version__,
        "speed": None if explained.speed is None else explained.speed.describe(),
    }


def _bucket(facts: layout.BucketFacts) -> dict[str, Any]:
    data = dataclasses.asdict(facts)
    data["params"], data["graphs"] = list(facts.params), list(facts.graphs)
    data["padding"], data["shard_per_rank"] = facts.padding, data.pop("shard")
    return data


def _starts_ms(part: schedule.PartSchedule, speed: Optional[Speed]) -> Optional[list[float]]:
    """The estimated time (ms) at which each node starts, and the part's end last; None without a speed."""
    if speed is None or len(part.costs) != part.nodes:
        return None
    starts = [0.0]
    for flops, nbytes in part.costs:
        starts.append(starts[-1] + 1e3 * speed.seconds(flops, nbytes))
    return starts


def _part(part: schedule.PartSchedule, speed: Optional[Speed]) -> dict[str, Any]:
    starts = _starts_ms(part, speed)
    events = {
        what: [{"bucket": e.bucket, "node": e.node, "ms": None if starts is None else starts[e.node]} for e in part.of(what)]
        for what in ("launch", "handoff", "wait")
    }
    return {"nodes": part.nodes, "launches": events["launch"], "handoffs": events["handoff"], "waits": events["wait"],
            "ms": None if starts is None else starts[-1]}  # fmt: skip


def _graphs(explained: "Explained") -> list[dict[str, Any]]:
    found = []
    for graph, planned in zip(explained.graphs, schedule.schedules(explained)):
        params = [{"name": name, "bucket": bucket, "placeholder": ph} for ph, name, bucket in explained.params_of(graph)]
        parts = {part.kind: _part(part, explained.speed) for part in planned.parts}
        found.append({"id": planned.id, "params": params, "buckets": list(planned.buckets), "parts": parts})
    return found


def _collectives(explained: "Explained") -> dict[str, Any]:
    dp = explained.optimizer.dp
    return {
        "per_step": dict(sorted(explained.optimizer.collectives_per_step.items())),
        "reduction": collectives.reduction_name(dp) if dp.size > 1 else None,  # none issued at world size 1
        "gather": collectives.gather_name(dp) if dp.size > 1 else None,
        "group_ranks": collectives.group_ranks(dp),
        "model_own": [dataclasses.asdict(c) for c in collectives.model_collectives(explained)],
    }


def as_data(explained: "Explained") -> dict[str, Any]:
    """The facts as plain JSON-ready data (what :func:`write_json` writes)."""
    return {
        "schema": SCHEMA,
        "conditions": _conditions(explained),
        "buckets": [_bucket(f) for f in layout.bucket_facts(explained)],
        "graphs": _graphs(explained),
        "collectives": _collectives(explained),
        "exposed": [dataclasses.asdict(e) for e in schedule.exposed(explained)],
    }


def write_json(data: dict[str, Any], path: Union[str, "os.PathLike[str]"]) -> None:
    with open(path, "w") as file:
        json.dump(data, file, indent=1)
        file.write("\n")
