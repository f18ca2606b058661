"""Multi-node drill: two torchrun agents (two "nodes") on this machine, one of them lost mid-run.

    python benchmarks/multinode_drill.py            # two 2-node jobs at once

Each job is examples/train_gpt.py on ``--nnodes 2 --nproc-per-node 2`` (world 4, gloo; ``--nproc-per-node``), the two
agents meeting by c10d rendezvous on 127.0.0.1 (node 0's agent hosts the store,
``--rdzv-conf is_host=1``), checkpointing every ``--ckpt-every`` steps into one directory (the
shared file system of a real cluster). The agents heartbeat the rendezvous every second and count
a node dead after 3 missed beats (``keep_alive_interval=1,keep_alive_max_attempt=3``; torchrun's
default, 5 s x 3, kept the survivors waiting ~15 s for the lost node to leave the rendezvous: in the
test suite's small uncompiled run, the node-lost job took 47 s with it and 37 s with these):

* **uninterrupted**: both agents run to the end;
* **node lost**: both agents under ``--max-restarts 1``. When node 1's ranks reach step
  ``--lose-at`` (benchmarks/restart_drill_worker.py ``--lose-node-at``), this script SIGKILLs
  node 1's agent and all its workers at once, as a machine that loses power. It then times how
  long node 0's ranks take to fail (their next collective raises ``CollectiveError``; nothing
  hangs until a timeout), and starts a replacement node-1 agent with the same command: node 0's
  agent restarts its workers, the rendezvous completes with the newcomer, and all four ranks
  resume from the last checkpoint.

It prints both jobs' final losses and the time from the kill to the survivors' error, compares
every logged loss after the resume and every tensor of the two final checkpoints (exit 0 when
losses are equal as printed and tensors within 1e-6). ``--train-args`` passes more flags to
train_gpt.py (e.g. ``--train-args=--instances 2`` for one optimizer replica per node).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path
from typing import Iterator

from restart_drill import MODEL, REPO, final_tensors, last_losses

_ERROR = re.compile(r"CollectiveError")
HEARTBEAT = "keep_alive_interval=1,keep_alive_max_attempt=3"
"""The rendezvous counts a node dead after 3 missed 1-second beats (torchrun's default: 5 s x 3)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(node: int, port: int, job_id: str, ckpt_dir: Path, args: argparse.Namespace, lose_at: int | None) -> list[str]:
    """Node ``node``'s torchrun command (``lose_at``: the node-lost job's, with a restart). The agent
    looks at its workers every second (``--monitor-interval 1``): its restart, and its end, follow
    its workers' exit within a second."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(args.nproc_per_node)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id]
    cmd += ["--rdzv-conf", f"is_host={int(node == 0)},{HEARTBEAT}", "--monitor-interval", "1"]
    cmd += ["--max-restarts", "1"] if lose_at else []
    cmd += [str(REPO / "benchmarks" / "restart_drill_worker.py")]
    cmd += ["--lose-node-at", str(lose_at), "--marker", str(ckpt_dir / "node_lost")] if lose_at else []
    cmd += ["--steps", str(args.steps), "--log-every", "1", *MODEL, *shlex.split(args.train_args)]
    cmd += ["--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(args.ckpt_every), "--compile", args.compile]
    return cmd


class Agent:
    """One torchrun agent ("node") in its own session, its output collected line by line with
    the time each line arrived (the drill times the survivors' error from the kill)."""

    def __init__(self, node: int, port: int, job_id: str, ckpt_dir: Path, args: argparse.Namespace, lose_at: int | None) -> None:
        cmd = agent_command(node, port, job_id, ckpt_dir, args, lose_at)
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append((time.monotonic(), line))

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def lose(self) -> None:
        """SIGKILL the agent and every process under it (its workers run in sessions of their own)."""
        pids = [self.proc.pid, *_descendants(self.proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def run_job(ckpt_dir: Path, args: argparse.Namespace, lose_at: int | None) -> tuple[str, float, float | None]:
    """Run one 2-node job; returns its output, wall seconds, and (node-lost job) seconds from
    the kill to the first ``CollectiveError`` line of node 0."""
    ckpt_dir.mkdir(parents=True)
    port, job_id, start = free_port(), f"drill{os.getpid()}{int(bool(lose_at))}", time.perf_counter()
    nodes = [Agent(n, port, job_id, ckpt_dir, args, lose_at) for n in range(2)]
    to_error = None
    if lose_at:
        marker = ckpt_dir / "node_lost"
        deadline = time.monotonic() + args.timeout
        while not marker.exists():
            if time.monotonic() > deadline or nodes[0].proc.poll() is not None:
                sys.exit(f"node 1 never reached step {lose_at}:\n{nodes[0].output()[-3000:]}\n{nodes[1].output()[-3000:]}")
            time.sleep(0.05)
        killed = time.monotonic()
        nodes[1].lose()
        to_error = _seconds_to_error(nodes[0], killed, args.timeout)
        nodes.append(Agent(1, port, job_id, ckpt_dir, args, lose_at))  # the replacement machine
    codes = [node.finish(args.timeout) for node in nodes[:1] + nodes[-1:]]
    # in arrival order: a step logged before the loss and again after the resume keeps the later line
    output = "".join(line for _, line in sorted(line for node in nodes for line in node.lines))
    if any(codes):
        sys.exit(f"job failed (exit codes {codes}):\n{output[-5000:]}")
    return output, time.perf_counter() - start, to_error


def _seconds_to_error(survivor: Agent, since: float, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for at, line in list(survivor.lines):
            if at >= since and _ERROR.search(line):
                return at - since
        time.sleep(0.05)
    return None


@contextlib.contextmanager
def _job_dir(keep: Path | None) -> Iterator[str]:
    """``keep`` (made if missing), or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield str(keep)
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (world = 2 x this)")
    p.add_argument("--ckpt-every", type=int, default=6)
    p.add_argument("--lose-at", type=int, default=9)
    p.add_argument("--compile", choices=["inductor", "eager", "none"], default="inductor", help="train_gpt.py's --compile")
    p.add_argument("--train-args", default="", help="more train_gpt.py flags, one string")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--keep", type=Path, default=None, help="keep both jobs' checkpoints here (uninterrupted/, node_lost/)")
    args = p.parse_args()
    with _job_dir(args.keep) as tmp:
        plain, lost = Path(tmp) / "uninterrupted", Path(tmp) / "node_lost"
        with ThreadPoolExecutor(2) as pool:  # both jobs at once: each is mostly process start-up and rendezvous
            jobs = pool.submit(run_job, plain, args, None), pool.submit(run_job, lost, args, args.lose_at)
            (out_a, t_a, _), (out_b, t_b, to_error) = (job.result() for job in jobs)
        resumed = re.search(r"resumed from .*step_(\d+) \(step (\d+)\)", out_b)
        a, b = last_losses(out_a), last_losses(out_b)
        want, got = final_tensors(plain, args.steps), final_tensors(lost, args.steps)
        same_keys = want.keys() == got.keys()
        diff = max((want[k].double() - got[k].double()).abs().max().item() for k in want) if same_keys else float("inf")
    header = f"final loss (step {args.steps})"
    print(f"| 2 nodes x {args.nproc_per_node} ranks | wall s | {header} |")
    print(f"|-------------------|--------|-{'-' * len(header)}-|")
    print(f"| uninterrupted     | {t_a:6.1f} | {a.get(args.steps, '-'):>{len(header)}} |")
    print(f"| node 1 lost       | {t_b:6.1f} | {b.get(args.steps, '-'):>{len(header)}} |")
    shown = f"{to_error:.2f} s" if to_error is not None else "never"
    print(f"node 1 (agent and workers) SIGKILLed at step {args.lose_at}; node 0 raised CollectiveError after {shown}; "
          f"a new node-1 agent joined; resumed from step {resumed.group(2) if resumed else None}")
    print(f"losses of steps 1..{args.steps} equal as printed: {a == b}; max |difference| over the {len(want)} final checkpoint tensors: {diff:.3g}")
    ok = bool(resumed) and to_error is not None and a == b and args.steps in a and diff <= 1e-6
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
