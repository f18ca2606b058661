"""Estimated time of each node of a compiled graph: the time axis of the timeline picture.

Why estimated, and why this way: overlap is a matter of time (a launch at 90% of backward's
nodes may still have half of its time ahead, when the heavy matmuls come last), but explain
runs no step to time. Each node's cost is what a roofline model reads off the graph itself: its
FLOPs (torch's own formulas, :mod:`torch.utils.flop_counter`, for matmuls, convolutions and
attention) and the bytes of the tensors it reads and writes (``node.meta["val"]``; a view moves
none), turned into seconds as ``max(flops / peak FLOP/s, bytes / bandwidth)``. The two speeds
are measured once, on the model's device, by a matmul and a copy (:func:`measure_speed`), so
the times are this machine's. fxzero's own nodes cost nothing here: a launch or a wait is drawn
where it sits in the compute, and the collective's own time is not modelled.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

__all__ = ["Speed", "measure_speed", "node_costs"]


@dataclasses.dataclass(frozen=True)
class Speed:
    """What the machine does per second: FLOPs of a large matmul, bytes of a large copy."""

    flops: float
    bytes: float
    device: str

    def seconds(self, flops: float, nbytes: int) -> float:
        return max(flops / self.flops, nbytes / self.bytes)

    def describe(self) -> str:
        return f"{self.flops / 1e9:.0f} GFLOP/s, {self.bytes / 1e9:.1f} GB/s, measured on {self.device}"


def _best_seconds(fn: Any, device: torch.device, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_speed(device: torch.device, n: int = 1024, copy_bytes: int = 1 << 26) -> Speed:
    """The best of 3 of an ``n x n`` fp32 matmul (``2 n^3`` FLOPs) and a ``copy_bytes`` copy (read
    and written: twice the bytes) on ``device``: a fifth of a second on a CPU core."""
    a = torch.randn(n, n, device=device)
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    a @ a  # first call: thread pools and library loading are not the op's time
    flops = 2 * n**3 / _best_seconds(lambda: a @ a, device)
    bandwidth = 2 * copy_bytes / _best_seconds(lambda: dst.copy_(src), device)
    return Speed(flops, bandwidth, str(device))


def _val_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:  # noqa: BLE001 - a size only a symbol knows: not counted
            return 0
    if isinstance(value, (tuple, list)):
        return sum(_val_bytes(v) for v in value)
    return 0


def _flops(node: fx.Node) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - an argument without a value (a symbolic shape): no FLOPs counted
        return 0.0


def _cost(node: fx.Node) -> tuple[float, int]:
    if node.op != "call_function" or getattr(node.target, "is_view", False):
        return 0.0, 0
    inputs = {id(n): n for n in node.all_input_nodes}
    nbytes = sum(_val_bytes(n.meta.get("val")) for n in inputs.values()) + _val_bytes(node.meta.get("val"))
    return _flops(node), nbytes


def node_costs(gm: fx.GraphModule) -> tuple[tuple[float, int], ...]:
    """``(FLOPs, bytes)`` of each node of ``gm``, in node order (placeholders, views, output: 0)."""
    return tuple(_cost(node) for node in gm.graph.nodes)
