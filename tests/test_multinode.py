"""Two torchrun agents ("nodes") on this machine: the main job at world 4 over c10d rendezvous,
a lost node (its agent and workers SIGKILLed together), the survivors' bounded failure, and the
resume with a replacement node (benchmarks/multinode_drill.py, which the README shows), with one
optimizer instance per node."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from parity_checks import assert_parity

_REPO = Path(__file__).resolve().parents[1]


def _final_checkpoint(job: Path, step: int) -> dict[str, Any]:
    """Every tensor of a job's checkpoint at ``step``, read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(job / f"step_{step:07d}", job / "final.pt")
    return torch.load(job / "final.pt", weights_only=True)


@pytest.mark.job
def test_a_lost_node_fails_its_peers_fast_and_a_replacement_node_resumes_to_the_same_end(tmp_path: Path) -> None:
    """~35 s: two 2-node jobs at once, one optimizer instance per node (hierarchical sharding:
    the state sharded inside a node, one copy per node), eager (uncompiled) so the drill's
    subject (rendezvous, loss, restart, resume) is not buried under four cold Inductor compiles.
    The ends are compared here, from both jobs' final checkpoints, not from the drill's verdict."""
    proc = subprocess.run(
        [sys.executable, str(_REPO / "benchmarks" / "multinode_drill.py"), "--compile", "none",
         "--steps", "8", "--ckpt-every", "3", "--lose-at", "5", "--timeout", "240",
         "--train-args=--instances 2", f"--keep={tmp_path}"],
        capture_output=True, text=True, timeout=400, cwd=_REPO,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "resumed from step 3" in out
    uninterrupted, resumed = (_final_checkpoint(tmp_path / job, 8) for job in ("uninterrupted", "node_lost"))
    assert sorted(uninterrupted) == sorted(resumed) and uninterrupted
    assert_parity({"params": resumed}, {"params": uninterrupted})  # bitwise: the same steps on the same data
    seconds = float(re.search(r"node 0 raised CollectiveError after ([\d.]+) s", out).group(1))
    assert seconds < 10, out  # the next collective fails at once; no rank waits for the process-group timeout


def test_the_drills_agents_count_a_silent_node_dead_after_three_seconds() -> None:
    """The README: the drill's agents pass keep_alive_interval=1,keep_alive_max_attempt=3 in
    --rdzv-conf (torchrun's default kept the survivors ~15 s waiting for the lost node)."""
    sys.path.insert(0, str(_REPO / "benchmarks"))
    try:
        import multinode_drill
    finally:
        sys.path.remove(str(_REPO / "benchmarks"))
    args = argparse.Namespace(nproc_per_node=2, steps=8, train_args="", ckpt_every=3, compile="none")
    for node in (0, 1):
        cmd = multinode_drill.agent_command(node, 29500, "job", _REPO, args, lose_at=5)
        conf = dict(kv.split("=") for kv in cmd[cmd.index("--rdzv-conf") + 1].split(","))
        assert conf == {"is_host": str(int(node == 0)), "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
