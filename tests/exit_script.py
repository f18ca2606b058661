"""One rank of the exit tests (tests/test_exit.py): train a little, leave work behind, exit.

``python exit_script.py SCENARIO DESTROY`` with torchrun's RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT in the environment. Every scenario ends by returning from the script; the test
wants exit code 0 and no ``terminate called`` from each rank, in bounded time.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import fxzero


def _boom(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom")


def main(scenario: str, destroy: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    config = fxzero.Config(bucket_size=70_000, overlap_param_gather=True)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model, config=config)
    x = torch.randn(8, 256)
    if scenario == "caught-backward-error":  # the last layers' buckets launched, then an exception
        model[0].weight.register_hook(_boom)
        try:
            model(x).square().mean().backward()
        except RuntimeError as err:
            assert "boom" in str(err)
    elif scenario == "gathers-in-flight":  # step() launches the next forward's gathers
        model(x).square().mean().backward()
        opt.step()
    elif scenario == "peer-gone":  # rank 1 leaves; rank 0's reductions fail, are caught, and it exits
        if dist.get_rank() == 1:
            return
        try:
            model(x).square().mean().backward()
            opt.step()
        except fxzero.CollectiveError as err:
            print(f"caught: {err}", file=sys.stderr)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
