"""Restart drill: a rank SIGKILLed mid-run, torchrun restarts the job from its last checkpoint,
and the job ends where an uninterrupted one does.

    python benchmarks/restart_drill.py            # ~20 s on 2 CPU cores

Runs examples/train_gpt.py twice at once, each on 2 gloo ranks with --ckpt-dir/--ckpt-every:

* uninterrupted;
* under ``torchrun --max-restarts=1``, through ``benchmarks/restart_drill_worker.py --kill-at N``
  (train_gpt.py with its step wrapped): the last rank kills itself (SIGKILL) at step N; the other
  rank's pending collective fails with a CollectiveError, torchrun restarts both, and they
  resume from the latest checkpoint (the restarted attempt kills nothing).

Then it compares every logged loss after the resume point and every tensor of the two final
checkpoints (model params, fp32 masters, AdamW moments and steps). Exit status 0 when they
agree (losses as printed, tensors within 1e-6), 1 otherwise.

Both runs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's default (the agent's
store shared with the workers), the restarted workers' gloo init failed here
("connectFullMesh failed ... Connection refused", torch 2.13; pytorch/pytorch#135712).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--dim", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--global-batch", "8", "--bucket-size", "20000"]
_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss ([\d.]+)", re.M)  # train_log.py's step lines


def start_job(ckpt_dir: Path, args: argparse.Namespace, kill_at: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # torchrun checks its workers every 0.1 s and then SIGTERMs the survivors: under load that
    # can beat the survivor's own CollectiveError (~0.1 s after the kill), which this drill
    # checks for, so the killed job's agent looks every 3 s instead.
    cmd += ["--max-restarts", "1", "--monitor-interval", "3"] if kill_at else []
    if kill_at:  # train_gpt.py whose last rank SIGKILLs itself at step kill_at, on the first attempt
        cmd += [str(REPO / "benchmarks" / "restart_drill_worker.py"), "--kill-at", str(kill_at)]
    else:
        cmd += [str(REPO / "examples" / "train_gpt.py")]
    cmd += ["--steps", str(args.steps), "--log-every", "1", *MODEL]
    cmd += ["--ckpt-dir", str(ckpt_dir), "--ckpt-every", str(args.ckpt_every), "--compile", args.compile]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_job(proc: subprocess.Popen, start: float) -> tuple[str, float]:
    output, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        sys.exit(f"job failed (exit {proc.returncode}):\n{output[-4000:]}")
    return output, time.perf_counter() - start


def last_losses(output: str) -> dict[int, str]:
    """Loss per step as printed; a step logged twice (before the kill and after the resume) keeps the later one."""
    return {int(step): loss for step, loss in _STEP.findall(output)}


def final_tensors(ckpt_dir: Path, step: int) -> dict[str, torch.Tensor]:
    out = ckpt_dir / "final.pt"
    dcp_to_torch_save(ckpt_dir / f"step_{step:07d}", out)
    return torch.load(out, weights_only=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ckpt-every", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=13)
    p.add_argument("--compile", choices=["inductor", "eager", "none"], default="inductor", help="train_gpt.py's --compile")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain, restarted = Path(tmp) / "uninterrupted", Path(tmp) / "restarted"
        start = time.perf_counter()  # both jobs at once: each is mostly process start-up
        jobs = start_job(plain, args, None), start_job(restarted, args, args.kill_at)
        (out_a, t_a), (out_b, t_b) = (finish_job(job, start) for job in jobs)
        resumed = re.search(r"resumed from .*step_(\d+) \(step (\d+)\)", out_b)
        died = "CollectiveError" in out_b
        a, b = last_losses(out_a), last_losses(out_b)
        want, got = final_tensors(plain, args.steps), final_tensors(restarted, args.steps)
        same_keys = want.keys() == got.keys()
        diff = max((want[k].double() - got[k].double()).abs().max().item() for k in want) if same_keys else float("inf")
    header = f"final loss (step {args.steps})"
    print(f"| run           | wall s | {header} |")
    print(f"|---------------|--------|-{'-' * len(header)}-|")
    print(f"| uninterrupted | {t_a:6.1f} | {a[args.steps]:>{len(header)}} |")
    print(f"| restarted     | {t_b:6.1f} | {b[args.steps]:>{len(header)}} |")
    print(f"rank 1 SIGKILLed at step {args.kill_at}; survivor raised CollectiveError: {died}; "
          f"resumed from step {resumed.group(2) if resumed else None}")
    if not died:  # say what the survivor raised instead
        print("survivor's errors:", *sorted({line.strip() for line in out_b.splitlines() if "Error" in line})[:8], sep="\n  ")
    print(f"losses of steps 1..{args.steps} equal as printed: {a == b}; max |difference| over the {len(want)} final checkpoint tensors: {diff:.3g}")
    ok = bool(resumed) and died and a == b and diff <= 1e-6
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
