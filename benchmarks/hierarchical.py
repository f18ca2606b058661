"""Hierarchical (2 instances x 2 shards) vs flat sharding at world 4: what crosses the nodes.

    python benchmarks/hierarchical.py [--steps 6]

World 4 on gloo, read as 2 "nodes" of 2 ranks (ranks 0-1 and 2-3; on this machine every
link is loopback, so this counts bytes, it does not time a slow network). Both configs train
the main job's GPT (``examples/train_gpt.py``'s model, dim 128, 2 layers; eager) on the same
batches:

* **flat**: ``process_group=None`` (the world): every reduction and gather spans both nodes;
* **hierarchical**: ``process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate",
  "shard"))``: reductions and gathers inside a node, one all-reduce of this rank's shard per
  bucket across the nodes.

During the timed steps every ``torch.distributed`` collective fxzero issues is recorded with
its payload (the bytes of the tensor it is given: a broadcast's or all-reduce's tensor, an
all-to-all's nonzero send split, a reduce-scatter's input) and its group, classed *inside a
node* when all of the group's ranks are on one node, else *across nodes*. Printed per rank and
step: payload bytes by class, optimizer state bytes, and peak RSS (VmHWM) per rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402

import fxzero  # noqa: E402
from fxzero.testing import close_pools, run_ranks  # noqa: E402

PER_NODE, WORLD = 2, 4
WRAPPED = ("all_to_all_single", "broadcast", "all_reduce", "reduce_scatter_single", "all_gather_single")


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    if name == "all_to_all_single":  # (output, input, output_splits, input_splits): this rank's nonzero send
        send, splits = args[1], args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        return send.element_size() * (sum(splits) if splits else send.numel())
    tensor = args[1] if name in ("reduce_scatter_single", "all_gather_single") else args[0]
    return tensor.nbytes


class Recorder:
    """Wraps ``torch.distributed``'s collectives (the module attributes fxzero calls) to add
    each call's payload to ``inside`` or ``across``."""

    def __init__(self) -> None:
        self.inside = self.across = 0
        self.on = False
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                group = kwargs.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
                nodes = {r // PER_NODE for r in ranks}
                if len(nodes) == 1:
                    self.inside += _payload(name, args, kwargs)
                else:
                    self.across += _payload(name, args, kwargs)
            return fn(*args, **kwargs)

        return recorded


def _vm_kib(key: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1])


def train(kind: str, steps: int) -> dict[str, Any]:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    recorder = Recorder()
    group = None if kind == "flat" else fxzero_mesh()
    torch.manual_seed(0)
    model = train_gpt.Transformer(train_gpt.ModelArgs(dim=128, n_layer=2, n_head=2))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, process_group=group, module=model,
                                      config=fxzero.Config(bucket_size=100_000))  # fmt: skip
    data = torch.frombuffer(bytearray(train_gpt.load_bytes(None)), dtype=torch.uint8).long()
    batch = type("Batch", (), {"seq": 64, "global_batch": 8})()
    losses = []
    for step in range(1, steps + 2):
        recorder.on = step > 1  # the first step's construction-time broadcasts are not a step's traffic
        x, y = train_gpt.get_batch(data, step, batch, dist.get_rank(), WORLD, torch.device("cpu"))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    recorder.on = False
    return {"inside": recorder.inside / steps, "across": recorder.across / steps, "state": opt.state_bytes,
            "peak_mib": _vm_kib("VmHWM") / 1024, "losses": losses}  # fmt: skip


def fxzero_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD // PER_NODE, PER_NODE), mesh_dim_names=("replicate", "shard"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    results = {}
    for kind in ("flat", "hierarchical"):
        try:
            results[kind] = run_ranks(WORLD, train, kind, args.steps, timeout=900)
        finally:
            close_pools()
    print(f"# fxzero flat vs hierarchical sharding: world {WORLD} = 2 nodes x {PER_NODE} ranks (gloo, cpu), "
          f"GPT dim 128, 2 layers, AdamW, eager; {args.steps} recorded steps\n")
    rows = []
    for kind, runs in results.items():
        rows.append((kind, f"{max(r['inside'] for r in runs):,.0f}", f"{max(r['across'] for r in runs):,.0f}",
                     f"{max(r['state'] for r in runs):,}", f"{max(r['peak_mib'] for r in runs):.0f}"))  # fmt: skip
    print(tabulate(rows, headers=["sharding", "payload bytes/rank/step inside a node", "across nodes",
                                  "opt state bytes/rank", "peak RSS MiB/rank"], tablefmt="github"))  # fmt: skip
    flat, hier = (results[k] for k in ("flat", "hierarchical"))
    ratio = max(r["across"] for r in hier) / max(r["across"] for r in flat)
    state = max(r["state"] for r in hier) / max(r["state"] for r in flat)
    gap = max(abs(a - b) for a, b in zip(flat[0]["losses"], hier[0]["losses"]))
    print(f"\nhierarchical / flat: bytes across nodes {ratio:.3f}, optimizer state per rank {state:.3f}; "
          f"losses (rank 0) max |flat - hierarchical| = {gap:.2e}")


if __name__ == "__main__":
    main()
